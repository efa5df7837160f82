//! One path of a connection, as its sender sees it: the PSN sequence, the
//! packets in flight, RTT and RTO, the congestion window and the pacer.

use std::collections::VecDeque;

use crate::congestion::{aimd::Aimd, Controller, Delay};
use crate::sack;
use crate::time::{Micros, MS, SEC};
use crate::wire::{AckEntry, SACK_BITS};

/// What a packet carried, so a loss re-queues exactly that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    Seg { msg: u32, seg: u32 },
    Rts { msg: u32 },
    Cts { msg: u32, accepted: u32 },
    Ping,
}

#[derive(Clone, Debug)]
pub struct SentPacket {
    pub psn: u32,
    pub frame: Frame,
    pub bytes: u32,
    pub sent_at: Micros,
    /// The connection's send order across all paths (see `late_deadline`).
    pub order: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathState {
    Active,
    /// Timed out repeatedly: no new data, probed until it answers.
    Failed,
}

/// Smoothed RTT and variance (RFC 6298), in microseconds.
#[derive(Clone, Copy, Debug)]
pub struct Rtt {
    pub srtt: Micros,
    pub rttvar: Micros,
    pub min: Micros,
    has_sample: bool,
}

impl Rtt {
    pub fn has_sample(&self) -> bool {
        self.has_sample
    }

    fn new(initial: Micros) -> Self {
        Self { srtt: initial, rttvar: initial / 2, min: Micros::MAX, has_sample: false }
    }
    fn update(&mut self, sample: Micros) {
        self.min = self.min.min(sample);
        if !self.has_sample {
            self.srtt = sample;
            self.rttvar = sample / 2;
            self.has_sample = true;
            return;
        }
        let err = self.srtt.abs_diff(sample);
        self.rttvar = (3 * self.rttvar + err) / 4;
        self.srtt = (7 * self.srtt + sample) / 8;
    }
}

/// The lowest RTT sample of the last one to two buckets (a windowed minimum in
/// two halves, so it forgets a sample after at most two bucket lengths).
#[derive(Clone, Copy, Debug)]
pub struct RecentMin {
    bucket_start: Micros,
    current: Micros,
    previous: Micros,
}

/// RecentMin's bucket for a path's own queue: long enough to hold a few samples
/// of every busy path.
pub const RECENT_MIN_BUCKET: Micros = MS;

impl RecentMin {
    fn new() -> Self {
        Self { bucket_start: 0, current: Micros::MAX, previous: Micros::MAX }
    }

    fn update(&mut self, now: Micros, sample: Micros, bucket: Micros) {
        if now >= self.bucket_start + 2 * bucket {
            self.previous = Micros::MAX;
            self.current = Micros::MAX;
            self.bucket_start = now;
        } else if now >= self.bucket_start + bucket {
            self.previous = self.current;
            self.current = Micros::MAX;
            self.bucket_start = now;
        }
        self.current = self.current.min(sample);
    }

    pub fn get(&self) -> Micros {
        self.current.min(self.previous)
    }
}

/// The PSNs a timeout declared lost, [lo, hi), and the window before the cut.
#[derive(Clone, Debug)]
struct TimedOut {
    lo: u32,
    hi: u32,
    oldest_sent_at: Micros,
    cc_before: Aimd,
    /// The suspect mark the timeout set (undone if it proves spurious).
    suspect_until: Micros,
}

/// A packet declared late, kept until an ACK shows it arrived after all (or it ages out).
#[derive(Clone, Copy, Debug)]
struct LateDeclared {
    psn: u32,
    sent_at: Micros,
    /// The path's next PSN when it was declared: no packet sent since, no floor moved.
    next_psn: u32,
}

/// A floor learned at `at` that halves every second after.
fn halved_per_second(floor: Micros, at: Micros, now: Micros) -> Micros {
    floor >> (now.saturating_sub(at) / SEC).min(63)
}

/// What an ACK entry did to a path.
#[derive(Debug, Default)]
pub struct AckOutcome {
    pub acked: Vec<Frame>,
    pub lost: Vec<Frame>,
    pub acked_bytes: u64,
    /// The send order of the newest packet this entry acknowledged.
    pub newest_order: Option<u64>,
}

#[derive(Debug)]
pub struct PathTimers {
    pub min_rto: Micros,
    pub max_rto: Micros,
}

#[derive(Debug)]
pub struct Path {
    pub index: u8,
    pub epoch: u16,
    pub state: PathState,
    next_psn: u32,
    pub in_flight: VecDeque<SentPacket>,
    pub inflight_bytes: u64,
    pub rtt: Rtt,
    pub recent_rtt: RecentMin,
    /// The lowest sample of the last one to two srtt (Copa's standing RTT): a
    /// queue the window builds persists through it, a stall of the hosts shorter
    /// than an RTT does not.
    pub standing_rtt: RecentMin,
    pub cc: Aimd,
    /// Consecutive timeouts without an ACK in between.
    pub backoff: u32,
    pub last_ack_at: Micros,
    pub last_send_at: Micros,
    /// Until then the path had loss or CE: new packets prefer other paths.
    pub suspect_until: Micros,
    pub failed_since: Micros,
    pub next_probe_at: Micros,
    ce_seen: u32,
    rcvd_seen: u32,
    // Pacer: a token bucket refilled at the path's rate, capped at one burst.
    tokens: f64,
    tokens_at: Micros,
    // Statistics.
    pub pkts_sent: u64,
    pub retransmits: u64,
    pub losses: u64,
    pub ce_echoed: u64,
    pub tlp_armed: bool,
    /// What the last timeout gave up on, until an ACK shows whether it was spurious.
    timed_out: Option<TimedOut>,
    /// After a timeout, the rest of the window waits (see `on_timeout`) until a
    /// packet sent from this send order on is acknowledged on any path.
    held_until_order: Option<u64>,
    /// A floor under the RTO learned from spurious timeouts (see `rto`).
    rto_floor: Micros,
    rto_floor_at: Micros,
    pub spurious_rtos: u64,
    /// Packets declared late, until an ACK shows one arrived after all.
    late_declared: VecDeque<LateDeclared>,
    /// RTT samples taken (see `late_after`).
    rtt_samples: u32,
    late_floor: Micros,
    late_floor_at: Micros,
    /// The suspect mark the last late declaration set (undone if it proves spurious).
    late_suspect_until: Micros,
    /// Late-declared packets shown to have arrived after all.
    pub spurious_late: u64,
    /// Delivery rate, bytes per microsecond (EWMA of samples about an RTT long).
    pub rate_est: f64,
    rate_sample_start: Micros,
    rate_sample_bytes: u64,
}

/// Bytes the pacer lets out at once: the time slice the driver sleeps in.
pub const PACING_SLICE: Micros = 200;
/// Pacing rate over cwnd/srtt: above 1 so pacing never caps a window that fits.
pub const PACING_GAIN: f64 = 2.0;
/// Weight lost per unit of CE fraction (alpha): 2% marking gives 0.5, 3.6% or
/// more the floor, STEER_MIN (the simulator's 5% link then carries 0.10-0.12 of
/// the bytes, under the 0.125 of half an even share).
pub const STEER_GAIN: f64 = 25.0;
pub const STEER_MIN: f64 = 0.1;
/// Added to srtt + 4 rttvar before a packet is overdue (see `late_after`): the
/// receiver's ACK delay and a little scheduling noise.
pub const LATE_SLACK: Micros = 200;
/// RTT samples a path needs before `late_after` trusts its srtt and rttvar.
const LATE_MIN_SAMPLES: u32 = 16;
/// Late-declared packets remembered per path, to recognise spurious ones.
const LATE_REMEMBERED: usize = 64;
/// A suspect path is paced at this fraction of its rate.
pub const SUSPECT_RATE_FACTOR: f64 = 0.25;

impl Path {
    pub fn new(index: u8, epoch: u16, mss: u64, max_window: u64, initial_rtt: Micros, queue_target: Micros) -> Self {
        Self {
            index,
            epoch,
            state: PathState::Active,
            next_psn: 0,
            in_flight: VecDeque::new(),
            inflight_bytes: 0,
            rtt: Rtt::new(initial_rtt),
            recent_rtt: RecentMin::new(),
            standing_rtt: RecentMin::new(),
            cc: Aimd::new(mss, max_window).with_queue_target(queue_target),
            backoff: 0,
            last_ack_at: 0,
            last_send_at: 0,
            suspect_until: 0,
            failed_since: 0,
            next_probe_at: 0,
            ce_seen: 0,
            rcvd_seen: 0,
            tokens: 0.0,
            tokens_at: 0,
            pkts_sent: 0,
            retransmits: 0,
            losses: 0,
            ce_echoed: 0,
            tlp_armed: false,
            timed_out: None,
            held_until_order: None,
            rto_floor: 0,
            rto_floor_at: 0,
            spurious_rtos: 0,
            late_declared: VecDeque::new(),
            rtt_samples: 0,
            late_floor: 0,
            late_floor_at: 0,
            late_suspect_until: 0,
            spurious_late: 0,
            rate_est: 0.0,
            rate_sample_start: 0,
            rate_sample_bytes: 0,
        }
    }

    /// srtt + 4 rttvar, at least `min_rto` and the floor spurious timeouts taught
    /// (an RTT-tied floor: where the hosts stall for longer than the RTT varies, as
    /// in emulated guests, rttvar alone under-estimates); the floor halves every
    /// second without a new spurious timeout.
    pub fn rto(&self, t: &PathTimers, now: Micros) -> Micros {
        let floor = self.learned_floor(now).max(t.min_rto);
        let base = (self.rtt.srtt + 4 * self.rtt.rttvar).clamp(floor.min(t.max_rto), t.max_rto);
        (base << self.backoff.min(10)).min(t.max_rto)
    }

    /// Probe timeout for the tail-loss probe: about two RTTs, and at least half
    /// the learned RTO floor (a probe into a host stall is a spurious resend too).
    pub fn pto(&self, t: &PathTimers, now: Micros) -> Micros {
        let floor = (t.min_rto / 4).max(self.learned_floor(now) / 2).min(t.max_rto);
        (2 * self.rtt.srtt + MS / 4).clamp(floor, t.max_rto)
    }

    fn learned_floor(&self, now: Micros) -> Micros {
        halved_per_second(self.rto_floor, self.rto_floor_at, now)
    }

    /// A packet sent at `sent_at` is given up on: the window comes down and new
    /// packets prefer other paths for a while.
    fn note_loss(&mut self, now: Micros, sent_at: Micros) {
        self.losses += 1;
        self.cc.on_loss(now, sent_at, self.rtt.srtt);
        self.suspect_until = now + 8 * self.rtt.srtt.max(100);
    }

    /// PSNs in flight must stay within the receiver's 256-bit SACK window.
    pub fn window_room(&self) -> bool {
        match self.in_flight.front() {
            Some(oldest) => self.next_psn.wrapping_sub(oldest.psn) < SACK_BITS,
            None => true,
        }
    }

    pub fn cwnd_room(&self, bytes: u64) -> bool {
        self.inflight_bytes + bytes <= self.cc.window().max(bytes)
    }

    /// Rate in bytes per microsecond.
    pub fn pacing_rate(&self, now: Micros, cap_bytes_per_us: f64) -> f64 {
        let srtt = self.rtt.srtt.max(1) as f64;
        let mut rate = PACING_GAIN * self.cc.window() as f64 / srtt;
        if now < self.suspect_until {
            rate *= SUSPECT_RATE_FACTOR;
        }
        rate.min(cap_bytes_per_us)
    }

    fn refill(&mut self, now: Micros, rate: f64) {
        let burst = (rate * PACING_SLICE as f64).max(2.0 * 9216.0);
        let dt = now.saturating_sub(self.tokens_at) as f64;
        self.tokens = (self.tokens + dt * rate).min(burst);
        self.tokens_at = now;
    }

    /// True when the pacer lets `bytes` out now.
    pub fn pacer_allows(&mut self, now: Micros, bytes: u64, rate: f64) -> bool {
        self.refill(now, rate);
        self.tokens >= bytes as f64 || self.tokens >= 0.0 && self.in_flight.is_empty()
    }

    /// When the pacer will have `bytes` tokens.
    pub fn pacer_ready_at(&self, now: Micros, bytes: u64, rate: f64) -> Micros {
        if self.tokens >= bytes as f64 || rate <= 0.0 {
            return now;
        }
        now + ((bytes as f64 - self.tokens) / rate).ceil() as Micros
    }

    /// Record a packet as sent; returns its PSN and the distance back to the
    /// oldest PSN still awaited on this path (the receiver's floor).
    pub fn on_sent(&mut self, now: Micros, frame: Frame, bytes: u32, is_retransmit: bool, order: u64) -> (u32, u16) {
        let psn = self.next_psn;
        let floor_delta = self.in_flight.front().map_or(0, |p| psn.wrapping_sub(p.psn).min(u16::MAX as u32) as u16);
        self.next_psn = self.next_psn.wrapping_add(1);
        self.in_flight.push_back(SentPacket { psn, frame, bytes, sent_at: now, order });
        self.inflight_bytes += bytes as u64;
        self.tokens -= bytes as f64;
        self.last_send_at = now;
        self.pkts_sent += 1;
        if is_retransmit {
            self.retransmits += 1;
        }
        self.tlp_armed = true;
        (psn, floor_delta)
    }

    /// Apply one ACK entry for this path (same epoch). Packets the entry shows
    /// received are acked; any unacked packet below the highest received PSN is
    /// lost (a path is FIFO, so a gap is a loss, not reordering).
    /// `common` is the lowest recent RTT of the connection's live paths (see `congestion::Delay`).
    pub fn on_ack(&mut self, now: Micros, entry: &AckEntry, ack_delay: Micros, common: Micros) -> AckOutcome {
        let stalled = self.check_timeout(now, entry);
        let mut out = AckOutcome::default();
        let highest = sack::sacked(entry).last().unwrap_or(entry.cum.wrapping_sub(1));
        let below_cum = |psn: u32| psn.wrapping_sub(entry.cum) >= 1 << 31;
        let is_received = |psn: u32| below_cum(psn) || sack::sack_bit(entry, psn);
        let mut newest_acked: Option<Micros> = None;
        let mut newest_order: Option<u64> = None;
        let mut keep = VecDeque::with_capacity(self.in_flight.len());
        for p in std::mem::take(&mut self.in_flight) {
            if is_received(p.psn) {
                out.acked_bytes += p.bytes as u64;
                newest_acked = Some(newest_acked.map_or(p.sent_at, |t: Micros| t.max(p.sent_at)));
                newest_order = Some(newest_order.map_or(p.order, |o: u64| o.max(p.order)));
                out.acked.push(p.frame);
            } else if highest.wrapping_sub(p.psn) < 1 << 31 && highest != p.psn {
                self.note_loss(now, p.sent_at);
                out.lost.push(p.frame);
            } else {
                keep.push_back(p);
            }
        }
        self.in_flight = keep;
        self.inflight_bytes = self.in_flight.iter().map(|p| p.bytes as u64).sum();
        out.newest_order = newest_order;
        if let Some(sent_at) = newest_acked {
            if !stalled {
                let sample = now.saturating_sub(sent_at).saturating_sub(ack_delay).max(1);
                self.rtt.update(sample);
                self.rtt_samples = self.rtt_samples.saturating_add(1);
                self.recent_rtt.update(now, sample, RECENT_MIN_BUCKET);
                self.standing_rtt.update(now, sample, self.rtt.srtt.max(RECENT_MIN_BUCKET));
                let recent = self.recent_rtt.get();
                let delay = Delay {
                    rtt: sample,
                    min_rtt: self.rtt.min,
                    srtt: self.rtt.srtt,
                    recent,
                    common: common.min(recent),
                    standing: self.standing_rtt.get(),
                };
                self.cc.on_ack(now, out.acked_bytes, delay);
            }
            self.backoff = 0;
            self.last_ack_at = now;
            self.sample_rate(now, out.acked_bytes);
            self.tlp_armed = !self.in_flight.is_empty();
            self.held_until_order = None; // the path answers: its gaps speak now
        }
        self.check_late_spurious(now, entry);
        // CE and received counts are cumulative: take the deltas.
        let ce = entry.ce.wrapping_sub(self.ce_seen);
        let rcvd = entry.rcvd.wrapping_sub(self.rcvd_seen);
        if rcvd < 1 << 31 && rcvd > 0 {
            self.ce_seen = entry.ce;
            self.rcvd_seen = entry.rcvd;
            if ce > 0 && ce <= rcvd {
                self.ce_echoed += ce as u64;
                self.cc.on_ce(now, ce, rcvd, self.rtt.srtt);
                self.suspect_until = now + 8 * self.rtt.srtt.max(100);
            } else {
                self.cc.on_ce(now, 0, rcvd, self.rtt.srtt);
            }
        }
        out
    }

    fn sample_rate(&mut self, now: Micros, acked: u64) {
        if self.rate_sample_start == 0 {
            self.rate_sample_start = now;
            return;
        }
        self.rate_sample_bytes += acked;
        let elapsed = now.saturating_sub(self.rate_sample_start);
        if elapsed >= self.rtt.srtt.max(100) {
            let r = self.rate_sample_bytes as f64 / elapsed as f64;
            self.rate_est = if self.rate_est == 0.0 { r } else { 0.75 * self.rate_est + 0.25 * r };
            self.rate_sample_start = now;
            self.rate_sample_bytes = 0;
        }
    }

    /// How much of a fair share new packets give this path: 1 unmarked, down to
    /// STEER_MIN as its CE fraction grows (MetaRoCE steers away from marked paths).
    pub fn steer_weight(&self) -> f64 {
        (1.0 - STEER_GAIN * self.cc.alpha()).clamp(STEER_MIN, 1.0)
    }

    /// A retransmission timeout: the window to the minimum and the window in flight
    /// remembered, so that an ACK showing it arrived after all undoes the cut and
    /// raises the RTO floor. Only the oldest packet is given up (returned) at once;
    /// the rest is held, as F-RTO does (RFC 5682), until either an ACK of this path
    /// answers (the normal gap rules take over, and a host stall costs one resend,
    /// not a window) or a packet sent from `next_order` on is acknowledged on any
    /// path (`take_held`: the hosts answer, so this path's silence is real and the
    /// rest moves too), or a second timeout gives up everything.
    pub fn on_timeout(&mut self, now: Micros, next_order: u64) -> Vec<Frame> {
        let suspect_until = now + 8 * self.rtt.srtt.max(100);
        if let Some(oldest) = self.in_flight.front() {
            let cc_before = self.timed_out.take().map_or_else(|| self.cc.clone(), |t| t.cc_before);
            self.timed_out = Some(TimedOut { lo: oldest.psn, hi: self.next_psn, oldest_sent_at: oldest.sent_at, cc_before, suspect_until });
        }
        self.cc.on_timeout(now, self.backoff);
        self.backoff += 1;
        self.suspect_until = suspect_until;
        self.tlp_armed = false;
        if self.held_until_order.is_some() || self.in_flight.len() <= 1 {
            return self.take_all_in_flight();
        }
        self.held_until_order = Some(next_order);
        vec![self.pop_oldest().expect("more than one in flight").frame]
    }

    /// The packets a timeout held, once `evidence` (the send order of the newest
    /// packet acknowledged on any path) shows a packet sent after the timeout arrived.
    pub fn take_held(&mut self, evidence: u64) -> Vec<Frame> {
        match self.held_until_order {
            Some(order) if evidence >= order => self.take_all_in_flight(),
            _ => Vec::new(),
        }
    }

    /// Whether `entry` shows a PSN the last timeout gave up on as received. The
    /// sender's floor moves the receiver's cumulative point to `hi` once a packet
    /// sent after the timeout arrives, so a cumulative point of exactly `hi` is
    /// only proof when no later packet is SACKed (none of them had arrived).
    /// While the rest is held only the oldest packet is given up, so a later packet's
    /// floor moves the cumulative point to `lo + 1`: like `hi`, no proof with a SACK bit set.
    fn timeout_was_spurious(t: &TimedOut, entry: &AckEntry, holding: bool) -> bool {
        let span = t.hi.wrapping_sub(t.lo);
        let cum_in = entry.cum.wrapping_sub(t.lo).wrapping_sub(1) < span;
        // One pass over the SACK bits: whether any is set, and whether one is in range.
        let (any_sacked, sacked_in) =
            sack::sacked(entry).fold((false, false), |(_, inside), psn| (true, inside || psn.wrapping_sub(t.lo) < span));
        let floor_may_explain = entry.cum == t.hi || holding && entry.cum == t.lo.wrapping_add(1);
        cum_in && (!floor_may_explain || !any_sacked) || sacked_in
    }

    /// True when `entry` shows the last timeout spurious: then the packets it held
    /// waited out a stall of the hosts, and their RTT is no sample of the path's
    /// (the stall raises the RTO floor instead, and the delay controller must not
    /// read it as a queue).
    fn check_timeout(&mut self, now: Micros, entry: &AckEntry) -> bool {
        let Some(t) = &self.timed_out else { return false };
        if Self::timeout_was_spurious(t, entry, self.held_until_order.is_some()) {
            let t = self.timed_out.take().expect("checked");
            self.spurious_rtos += 1;
            // The ACK took this long: the next timeout waits a quarter more.
            let took = now.saturating_sub(t.oldest_sent_at);
            self.rto_floor = self.learned_floor(now).max(took + took / 4);
            self.rto_floor_at = now;
            self.cc = t.cc_before;
            self.backoff = 0;
            // Nothing was lost: the path is not suspect either, unless something else
            // (a gap, CE, a late loss) has marked it since. Left in place, the mark
            // paced the path at a quarter of its rate for 8 srtt after every host
            // stall long enough to time out.
            if self.suspect_until == t.suspect_until {
                self.suspect_until = 0;
            }
            return true;
        } else if entry.cum.wrapping_sub(t.hi) < 1 << 31 && entry.cum != t.hi {
            self.timed_out = None; // past it, nothing of it shown: a real loss
        }
        false
    }

    /// The oldest packet in flight leaves the window (given up on).
    fn pop_oldest(&mut self) -> Option<SentPacket> {
        let p = self.in_flight.pop_front()?;
        self.inflight_bytes -= p.bytes as u64;
        Some(p)
    }

    /// Everything in flight is declared lost (a timeout, a failed path).
    pub fn take_all_in_flight(&mut self) -> Vec<Frame> {
        self.held_until_order = None;
        self.inflight_bytes = 0;
        self.in_flight.drain(..).map(|p| p.frame).collect()
    }

    /// A new source port: a fresh PSN space the receiver tells apart by epoch.
    pub fn rotate(&mut self) -> Vec<Frame> {
        let frames = self.take_all_in_flight();
        self.epoch = self.epoch.wrapping_add(1);
        self.next_psn = 0;
        self.ce_seen = 0;
        self.rcvd_seen = 0;
        self.late_declared.clear();
        self.backoff = 0;
        self.cc.reset();
        frames
    }

    /// Whether this path's delay figures speak for the present: active and acked
    /// within the last two RecentMin buckets.
    pub fn delay_is_current(&self, now: Micros) -> bool {
        self.state == PathState::Active && self.rtt.has_sample() && now.saturating_sub(self.last_ack_at) < 2 * RECENT_MIN_BUCKET
    }

    pub fn oldest_sent_at(&self) -> Option<Micros> {
        self.in_flight.front().map(|p| p.sent_at)
    }

    /// How long a packet may stay unacknowledged on this path once a packet sent
    /// after it was acknowledged on another: the path's own srtt + 4 rttvar, and
    /// at least what a spurious late loss taught (`late_floor`, as spurious
    /// timeouts teach `rto_floor`: an ACK that waits behind the peer's own data
    /// on a busy return link is later than the RTT samples say). No RTO floor: that guards
    /// against stalls of the hosts, and a later packet acknowledged elsewhere
    /// shows the hosts were not stalled. This finds a path's lost last packet,
    /// where no later packet on the path opens a gap: a small message sprayed over
    /// 16 paths puts a packet or two on each, so its every loss is such a tail,
    /// which otherwise waited for the tail-loss probe.
    pub fn late_after(&self, now: Micros) -> Option<Micros> {
        if self.rtt_samples < LATE_MIN_SAMPLES {
            return None; // rttvar starts at half the first sample: not yet a spread
        }
        let rtt = self.rtt.srtt + 4 * self.rtt.rttvar;
        Some(rtt.max(halved_per_second(self.late_floor, self.late_floor_at, now)) + LATE_SLACK)
    }

    /// When the oldest packet in flight becomes overdue against `evidence` (the
    /// send order of the newest packet the connection has seen acknowledged: an
    /// order, not a time, as a burst leaves within one microsecond). Only
    /// on a path that answers: one silent for an RTO is the timeout's to handle
    /// (it counts towards the path's failure).
    pub fn late_deadline(&self, t: &PathTimers, now: Micros, evidence: u64) -> Option<Micros> {
        let p = self.in_flight.front()?;
        let silent = now >= self.last_ack_at + self.rto(t, now) || self.held_until_order.is_some();
        if p.order >= evidence || self.state != PathState::Active || silent {
            return None;
        }
        Some(p.sent_at + self.late_after(now)?)
    }

    /// Whether `entry` shows a packet declared late as received after all: a SACK
    /// bit, or the cumulative point past it while no packet was sent on the path
    /// since (a later packet's floor moves the cumulative point past a packet
    /// given up on too, so that alone is no proof). Then the declaration was
    /// premature: wait at least a quarter longer than that packet took.
    fn check_late_spurious(&mut self, now: Micros, entry: &AckEntry) {
        let next_psn = self.next_psn;
        let proven = |d: &LateDeclared| {
            let below_cum = d.psn.wrapping_sub(entry.cum) >= 1 << 31;
            if below_cum {
                d.next_psn == next_psn
            } else {
                sack::sack_bit(entry, d.psn)
            }
        };
        let (mut disproven, mut took) = (0u32, 0);
        for d in self.late_declared.iter().filter(|d| proven(d)) {
            disproven += 1;
            took = took.max(now.saturating_sub(d.sent_at));
        }
        if disproven == 0 {
            return;
        }
        self.late_declared.retain(|d| !proven(d));
        self.spurious_late += disproven as u64;
        self.late_floor = self.late_floor.max(took + took / 4);
        self.late_floor_at = now;
        // Nothing was lost: undo the window's cut, and the suspect mark unless
        // something else (a gap, CE, a timeout) has set it since.
        self.cc.on_loss_disproven(disproven);
        if self.suspect_until == self.late_suspect_until {
            self.suspect_until = 0;
        }
    }

    /// Declare the overdue packets lost (oldest first: a path is FIFO).
    pub fn take_late(&mut self, t: &PathTimers, now: Micros, evidence: u64) -> Vec<Frame> {
        let mut lost = Vec::new();
        while let Some(deadline) = self.late_deadline(t, now, evidence) {
            if now < deadline {
                break;
            }
            let p = self.pop_oldest().expect("a deadline has a packet");
            while self.late_declared.len() >= LATE_REMEMBERED
                || self.late_declared.front().is_some_and(|d| now.saturating_sub(d.sent_at) > SEC)
            {
                self.late_declared.pop_front();
            }
            self.late_declared.push_back(LateDeclared { psn: p.psn, sent_at: p.sent_at, next_psn: self.next_psn });
            self.note_loss(now, p.sent_at);
            self.late_suspect_until = self.suspect_until;
            lost.push(p.frame);
        }
        lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMERS: PathTimers = PathTimers { min_rto: 5 * MS, max_rto: SEC };

    fn ack(cum: u32) -> AckEntry {
        AckEntry { path: 0, epoch: 0, cum, ce: 0, rcvd: cum, sack: [0; 32] }
    }

    #[test]
    fn a_late_loss_shown_spurious_gives_back_its_cut_and_suspect_mark() {
        let mut p = Path::new(0, 0, 1000, 1 << 20, 100, 500);
        let mut now = 1_000;
        for psn in 0..LATE_MIN_SAMPLES + 4 {
            p.on_sent(now, Frame::Ping, 1000, false, psn as u64);
            now += 100;
            p.on_ack(now, &ack(psn + 1), 0, 100);
        }
        let order = (LATE_MIN_SAMPLES + 4) as u64;
        p.on_sent(now, Frame::Ping, 1000, false, order);
        let before = p.cc.window();
        // A packet sent after it was acknowledged elsewhere, and it is overdue.
        now += 2 * MS;
        assert_eq!(p.take_late(&TIMERS, now, order + 1).len(), 1);
        assert_eq!(p.cc.window(), before - 1000);
        assert!(p.suspect_until > now);
        // The ACK shows it arrived after all (no packet sent on the path since).
        now += 100;
        p.on_ack(now, &ack(LATE_MIN_SAMPLES + 5), 0, 100);
        assert_eq!(p.spurious_late, 1);
        assert_eq!(p.cc.window(), before);
        assert_eq!(p.suspect_until, 0);
    }

    /// A path with 8 packets acknowledged, then `n` in flight (orders 8..8+n),
    /// and a time 20 ms after they were sent (past the RTO).
    fn path_with_window(n: u32) -> (Path, Micros) {
        let mut p = Path::new(0, 0, 1000, 1 << 20, 100, 500);
        let mut now = 1_000;
        for psn in 0..8 {
            p.on_sent(now, Frame::Ping, 1000, false, psn as u64);
            now += 100;
            p.on_ack(now, &ack(psn + 1), 0, 100);
        }
        for psn in 8..8 + n {
            p.on_sent(now, Frame::Ping, 1000, false, psn as u64);
        }
        (p, now + 20 * MS)
    }

    #[test]
    fn a_timeout_shown_spurious_gives_back_its_cut_and_suspect_mark() {
        // Sending leaves the window as it is: `before` is the window before the stall.
        let (mut p, mut now) = path_with_window(4);
        let before = p.cc.window();
        // The host stalls past the RTO: the oldest packet is given up on, the rest held.
        assert_eq!(p.on_timeout(now, 12).len(), 1);
        assert_eq!(p.in_flight.len(), 3);
        assert!(p.cc.window() < before);
        assert!(p.suspect_until > now);
        // The ACK shows they all arrived: the timeout was spurious, and the held
        // three were never sent again.
        now += 100;
        p.on_ack(now, &ack(12), 0, 100);
        assert_eq!(p.spurious_rtos, 1);
        assert!(p.in_flight.is_empty());
        assert_eq!(p.cc.window(), before);
        assert_eq!(p.suspect_until, 0, "no longer paced at a quarter of its rate");
    }

    #[test]
    fn a_silent_path_gives_up_its_held_window_once_a_later_packet_is_acked_elsewhere() {
        let (mut p, now) = path_with_window(4);
        assert_eq!(p.on_timeout(now, 12).len(), 1);
        // ACKs of packets sent before the timeout prove nothing about this path.
        assert!(p.take_held(11).is_empty());
        assert_eq!(p.inflight_bytes, 3000);
        // One sent after it (the resend, on another path) arrived: the rest moves.
        assert_eq!(p.take_held(12).len(), 3);
        assert_eq!(p.inflight_bytes, 0);
        assert!(p.take_held(13).is_empty());
    }

    #[test]
    fn a_second_timeout_gives_up_what_the_first_held() {
        let (mut p, now) = path_with_window(4);
        assert_eq!(p.on_timeout(now, 12).len(), 1);
        assert_eq!(p.on_timeout(now + 40 * MS, 12).len(), 3);
        assert_eq!(p.backoff, 2);
    }

    #[test]
    fn while_held_a_cumulative_point_the_floor_moved_is_no_proof() {
        let (mut p, now) = path_with_window(4);
        assert_eq!(p.on_timeout(now, 12).len(), 1);
        // Sent while the rest is held: its floor skips only PSN 8, given up.
        p.on_sent(now, Frame::Ping, 1000, false, 12);
        let mut e = ack(9);
        e.sack[0] = 1 << 2; // 12 (cum + 3) arrived, 8 did not: the floor moved cum to 9
        let out = p.on_ack(now + 100, &e, 0, 100);
        assert_eq!(p.spurious_rtos, 0, "the floor, not an arrival, moved the point to 9");
        assert_eq!(out.lost.len(), 3, "9, 10 and 11 are gaps below 12");
    }

    #[test]
    fn held_packets_are_not_declared_late_one_by_one() {
        let (mut p, now) = path_with_window(4);
        p.rtt_samples = LATE_MIN_SAMPLES;
        assert_eq!(p.on_timeout(now, 12).len(), 1);
        assert_eq!(p.late_deadline(&TIMERS, now, 11), None);
    }
}
