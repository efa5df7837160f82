//! AIMD per path: slow start to the first congestion signal, then one MSS per
//! RTT up; down one MSS per lost packet, at most to BETA_LOSS of the window in
//! one RTT (so the cut follows the fraction lost, as DCTCP's follows the fraction
//! marked: a fabric's random 1% costs a window of W packets about W/100 packets
//! per RTT, where TCP's halving per loss event held the guests' 16 paths to
//! 0.59 of their lossless goodput; an overflowing queue, which drops many
//! packets of a window, still cuts by 1 - BETA_LOSS), DCTCP-style on the fraction
//! of CE-marked packets (alpha, a moving average with gain 1/16), and, like
//! Swift, in proportion to the delay above a target (where no switch marks CE,
//! a growing queue still says so). Two delays are watched, as Swift splits
//! fabric from endpoint delay: the path's own queue (its srtt above the
//! connection's least-delayed path, `queue_target`), and the whole RTT above the
//! path's minimum (`SHARED_QUEUE_FACTOR` times that target), which also grows
//! when the hosts are busy and so must not be held to the tight target. The
//! whole RTT is the path's standing RTT (the least of the last one to two srtt,
//! as Copa's): with stalls of the hosts in every few RTTs, the least of the last
//! millisecond read each stall as a queue, and at 1% loss the windows fell to a
//! few packets a path and half the goodput (`tests/sim.rs`).

use super::{Controller, Delay};
use crate::time::Micros;

pub const INITIAL_WINDOW_PACKETS: u64 = 16;
pub const MIN_WINDOW_PACKETS: u64 = 2;
/// Loss is a weak congestion signal on a fabric that drops at random: one RTT's
/// losses take the window down to no less than this (CUBIC's 0.7).
pub const BETA_LOSS: f64 = 0.7;
pub const ALPHA_GAIN: f64 = 1.0 / 16.0;
/// Default queueing delay a path may build before the window comes down.
pub const QUEUE_TARGET_US: Micros = 500;
/// The whole RTT may exceed the path's minimum by this many queue targets (a
/// queue every path shares: incast at the receiver's port, or the hosts).
pub const SHARED_QUEUE_FACTOR: u64 = 8;
/// Swift's beta and cap on one decrease.
pub const BETA_DELAY: f64 = 0.8;
pub const MAX_DELAY_DECREASE: f64 = 0.5;

#[derive(Debug, Clone)]
pub struct Aimd {
    mss: u64,
    max_window: u64,
    cwnd: u64,
    ssthresh: u64,
    /// Losses of packets sent before this time belong to the current loss round.
    recovery_until: Micros,
    /// The least window the current loss round may cut to (BETA_LOSS of its start).
    round_floor: u64,
    /// The window when the current loss round began: undone cuts return up to it.
    round_start: u64,
    alpha: f64,
    /// CE marks and packets the receiver saw in the current observation window
    /// (about one srtt), and when that window ends. DCTCP counts per window of
    /// data, not per ACK: an ACK's own fraction depends on how many packets it
    /// covers (one marked packet in an ACK of two is half), which the receiver's
    /// ACK policy decides, not the fabric.
    ce_marked: u64,
    ce_total: u64,
    ce_window_end: Micros,
    last_ce_cut: Micros,
    last_delay_cut: Micros,
    queue_target: Micros,
}

impl Aimd {
    pub fn new(mss: u64, max_window: u64) -> Self {
        let cwnd = (INITIAL_WINDOW_PACKETS * mss).min(max_window);
        Self {
            mss,
            max_window,
            cwnd,
            ssthresh: u64::MAX,
            recovery_until: 0,
            round_floor: 0,
            round_start: 0,
            alpha: 0.0,
            ce_marked: 0,
            ce_total: 0,
            ce_window_end: 0,
            last_ce_cut: 0,
            last_delay_cut: 0,
            queue_target: QUEUE_TARGET_US,
        }
    }

    pub fn with_queue_target(mut self, target: Micros) -> Self {
        self.queue_target = target;
        self
    }

    fn min_window(&self) -> u64 {
        MIN_WINDOW_PACKETS * self.mss
    }

    pub fn alpha(&self) -> f64 {
        self.alpha
    }
}

impl Controller for Aimd {
    fn window(&self) -> u64 {
        self.cwnd
    }

    fn on_ack(&mut self, now: Micros, acked: u64, d: Delay) {
        let own_target = self.queue_target.max(d.min_rtt / 2);
        let own = d.recent.saturating_sub(d.common);
        let shared = d.standing.saturating_sub(d.min_rtt);
        let shared_target = SHARED_QUEUE_FACTOR * own_target;
        // Over either target: the fraction of the delay that is queue, as Swift.
        let over = if own > own_target {
            Some((own - own_target) as f64 / d.recent.max(1) as f64)
        } else if shared > shared_target {
            Some((shared - shared_target) as f64 / d.recent.max(1) as f64)
        } else {
            None
        };
        if let Some(frac) = over {
            if now >= self.last_delay_cut + d.srtt.max(1) {
                self.last_delay_cut = now;
                let f = (BETA_DELAY * frac).min(MAX_DELAY_DECREASE);
                self.cwnd = ((self.cwnd as f64 * (1.0 - f)) as u64).max(self.min_window());
                self.ssthresh = self.cwnd;
                self.round_start = self.round_start.min(self.cwnd);
            }
            return;
        }
        let grow = if self.cwnd < self.ssthresh { acked } else { (self.mss * acked / self.cwnd).max(1) };
        self.cwnd = (self.cwnd + grow).min(self.max_window);
    }

    fn on_ce(&mut self, now: Micros, marked: u32, total: u32, srtt: Micros) {
        if total == 0 {
            return;
        }
        self.ce_marked += marked.min(total) as u64;
        self.ce_total += total as u64;
        if self.ce_window_end == 0 {
            self.ce_window_end = now + srtt.max(1);
        }
        if now < self.ce_window_end {
            return;
        }
        // One observation window is over: its fraction feeds alpha, and a window
        // with marks cuts once, by the larger of alpha and its own fraction (a
        // sudden queue is answered at once, not after alpha has caught up).
        let frac = self.ce_marked as f64 / self.ce_total as f64;
        self.alpha = (1.0 - ALPHA_GAIN) * self.alpha + ALPHA_GAIN * frac;
        if self.ce_marked > 0 && now >= self.last_ce_cut + srtt.max(1) {
            self.last_ce_cut = now;
            let cut = (self.cwnd as f64 * (1.0 - self.alpha.max(frac) / 2.0)) as u64;
            self.cwnd = cut.max(self.min_window());
            self.ssthresh = self.cwnd;
            self.round_start = self.round_start.min(self.cwnd);
        }
        self.ce_marked = 0;
        self.ce_total = 0;
        self.ce_window_end = now + srtt.max(1);
    }

    fn on_loss(&mut self, now: Micros, sent_at: Micros, srtt: Micros) {
        if sent_at >= self.recovery_until {
            // A new round: packets sent from now on that are lost count in the next.
            self.recovery_until = now + srtt.max(1);
            self.round_start = self.cwnd;
            self.round_floor = ((self.cwnd as f64 * BETA_LOSS) as u64).max(self.min_window());
        }
        self.cwnd = self.cwnd.saturating_sub(self.mss).max(self.round_floor).max(self.min_window());
        self.ssthresh = self.cwnd;
    }

    fn on_loss_disproven(&mut self, packets: u32) {
        // Give back the MSS each took, never above the window the loss round began
        // with (the other cuts lower that ceiling, so theirs stand), nor take back
        // growth since.
        let undone = self.cwnd + packets as u64 * self.mss;
        self.cwnd = undone.min(self.round_start.max(self.cwnd)).min(self.max_window);
        self.ssthresh = self.ssthresh.max(self.cwnd);
    }

    fn on_timeout(&mut self, now: Micros, consecutive: u32) {
        if consecutive == 0 {
            // One timeout is a lost tail (a lost probe or resend), not yet a dead path
            // or a collapse: cut as one loss round does. The path's failure detection
            // and the backed-off timeouts that follow handle a path that stays silent.
            self.recovery_until = now;
            self.round_start = self.cwnd;
            self.round_floor = ((self.cwnd as f64 * BETA_LOSS) as u64).max(self.min_window());
            self.cwnd = self.round_floor;
            self.ssthresh = self.cwnd;
            return;
        }
        self.ssthresh = (self.cwnd / 2).max(self.min_window());
        self.cwnd = self.min_window();
        self.round_start = self.cwnd;
    }

    fn reset(&mut self) {
        *self = Self::new(self.mss, self.max_window).with_queue_target(self.queue_target);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(rtt: Micros, min_rtt: Micros, srtt: Micros, common: Micros) -> Delay {
        Delay { rtt, min_rtt, srtt, recent: rtt, common, standing: rtt }
    }

    #[test]
    fn each_loss_takes_one_mss_at_most_beta_per_round() {
        let mut c = Aimd::new(1000, 1 << 20);
        c.on_ack(0, 16_000, d(50, 50, 50, 50));
        assert_eq!(c.window(), 32_000);
        c.on_loss(1_000, 900, 100);
        assert_eq!(c.window(), 31_000);
        c.on_loss(1_010, 950, 100);
        assert_eq!(c.window(), 30_000);
        // A burst (a queue overflowing) takes the round down to BETA_LOSS, no further.
        for i in 0..20 {
            c.on_loss(1_020 + i, 960, 100);
        }
        assert_eq!(c.window(), 22_400);
        // Congestion avoidance: about one MSS per window acked.
        c.on_ack(1_200, 22_400, d(50, 50, 50, 50));
        assert_eq!(c.window(), 23_400);
        // A loss of a packet sent after the round began opens a new round.
        c.on_loss(1_300, 1_150, 100);
        assert_eq!(c.window(), 22_400);
    }

    #[test]
    fn disproven_losses_give_their_mss_back_up_to_the_rounds_start() {
        let mut c = Aimd::new(1000, 1 << 20);
        c.on_ack(0, 16_000, d(50, 50, 50, 50));
        for i in 0..3 {
            c.on_loss(1_000 + i, 900, 100);
        }
        assert_eq!(c.window(), 29_000);
        c.on_loss_disproven(2);
        assert_eq!(c.window(), 31_000);
        c.on_loss_disproven(5); // no higher than where the round began
        assert_eq!(c.window(), 32_000);
        // A CE cut after the losses stands: the undo stops at the cut window.
        c.on_loss(2_000, 1_900, 100);
        c.on_ce(1_910, 0, 10, 100); // opens the observation window
        c.on_ce(2_010, 10, 10, 100); // closes it with marks: a cut
        let after_ce = c.window();
        c.on_loss_disproven(1);
        assert_eq!(c.window(), after_ce);
        // Growth since the round began is not taken back.
        let mut g = Aimd::new(1000, 1 << 20);
        g.on_loss(0, 0, 100);
        g.on_ack(200, 200_000, d(50, 50, 50, 50));
        let grown = g.window();
        g.on_loss_disproven(1);
        assert_eq!(g.window(), grown);
    }

    #[test]
    fn one_percent_random_loss_leaves_a_window_of_about_a_hundred_packets() {
        // One MSS up per RTT, one down per lost packet: at 1% the window settles
        // where a round loses about one packet (TCP's halving settles near 12).
        let mut c = Aimd::new(1000, 1 << 30);
        c.on_loss(0, 0, 100); // leave slow start
        let (mut now, mut sent) = (1_000u64, 0u64);
        for _ in 0..20_000 {
            let w = c.window() / 1000;
            for _ in 0..w {
                sent += 1;
                if sent % 100 == 0 {
                    c.on_loss(now, now - 100, 100);
                } else {
                    c.on_ack(now, 1000, d(50, 50, 50, 50));
                }
            }
            now += 100;
        }
        let w = c.window() / 1000;
        assert!((60..=200).contains(&w), "window {w} packets");
    }

    #[test]
    fn ce_fraction_cuts_in_proportion() {
        let mut c = Aimd::new(1000, 1 << 20);
        c.on_ce(1_000, 1, 10, 100); // opens the observation window
        assert_eq!(c.window(), 16_000);
        c.on_ce(1_100, 9, 10, 100); // closes it: half the window's packets marked
        assert_eq!(c.window(), 12_000);
        let w = c.window();
        c.on_ce(1_150, 10, 10, 100); // within the same RTT: no second cut
        assert_eq!(c.window(), w);
    }

    #[test]
    fn the_ce_estimate_does_not_depend_on_how_many_packets_an_ack_covers() {
        // 5% of packets marked, one in every 20, acknowledged two or eight at a time:
        // the same alpha and window (per ACK, an ACK of two holding the mark said
        // "half marked" and halved the window).
        let run = |per_ack: u32| {
            let mut c = Aimd::new(1000, 40_000);
            c.on_loss(0, 0, 100); // leave slow start
            let (mut now, mut seq) = (0u64, 0u32);
            for _ in 0..20_000 {
                let marked = (seq..seq + per_ack).filter(|s| s % 20 == 19).count() as u32;
                seq += per_ack;
                now += per_ack as u64 * 5; // 200 packets per 1 ms
                c.on_ce(now, marked, per_ack, 100);
                c.on_ack(now, per_ack as u64 * 1000, d(50, 50, 50, 50));
            }
            (c.alpha(), c.window())
        };
        let (a2, w2) = run(2);
        let (a8, w8) = run(8);
        assert!((a2 - 0.05).abs() < 0.01 && (a8 - 0.05).abs() < 0.01, "alpha {a2} {a8}");
        let ratio = w2 as f64 / w8 as f64;
        assert!((0.8..1.25).contains(&ratio), "windows {w2} {w8}");
    }

    #[test]
    fn a_path_queued_beyond_its_siblings_is_cut() {
        let mut c = Aimd::new(1000, 1 << 20);
        let srtt = 100 + QUEUE_TARGET_US + 1000;
        c.on_ack(10_000, 1000, d(srtt, 100, srtt, 100));
        assert!(c.window() < 16_000, "{}", c.window());
        let w = c.window();
        c.on_ack(10_010, 1000, d(srtt, 100, srtt, 100));
        assert_eq!(c.window(), w, "one cut per RTT");
        c.on_ack(30_000, 1000, d(120, 100, 120, 100));
        assert!(c.window() > w, "below target it grows again");
    }

    #[test]
    fn host_delay_every_path_shares_is_not_a_queue_on_this_path() {
        // 600 us on every path (a busy host) with a 60 us minimum: the old rule, RTT
        // over min + 500 us, cut every path to a few packets on idle links.
        let mut c = Aimd::new(1000, 1 << 20);
        c.on_ack(1_000, 16_000, d(600, 60, 600, 580));
        assert_eq!(c.window(), 32_000);
        // The shared queue still counts once it is far above the target (incast).
        let rtt = 60 + SHARED_QUEUE_FACTOR * QUEUE_TARGET_US + 2_000;
        c.on_ack(20_000, 1000, d(rtt, 60, rtt, rtt));
        assert!(c.window() < 32_000, "{}", c.window());
    }

    #[test]
    fn a_first_timeout_cuts_like_a_loss_round_and_a_second_collapses() {
        let mut c = Aimd::new(1000, 1 << 20);
        c.on_timeout(5, 0);
        assert_eq!(c.window(), 11_200);
        c.on_timeout(10, 1);
        assert_eq!(c.window(), 2_000);
        c.reset();
        assert_eq!(c.window(), 16_000);
    }
}
