//! One connection between two endpoints: the handshake state, the paths, the
//! messages being sent and received, ACK generation and the timers. Pure: the
//! endpoint feeds it packets and the time and asks it for packets to send.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;

use crate::buf::{RecvBuf, SendBuf};
use crate::congestion::Controller;
use crate::counters::Counters;
use crate::event::{Completion, Error, OpKind, PeerId};
use crate::matching::PostedRecv;
use crate::path::{Frame, Path, PathState, PathTimers};
use crate::sack::{Arrival, RecvWindow};
use crate::time::Micros;
use crate::wire::{self, Ack, AckEntry, DataHeader, DataKind, Header, PacketType, MFLAG_CQ_DATA, MFLAG_TAGGED};

/// Messages a connection tracks at once in each direction (the receiver's
/// message window; the sender gets `Error::Again` beyond it).
pub const MAX_MSGS_IN_FLIGHT: u32 = 4096;
/// Consecutive RTOs after which a path is failed and only probed.
pub const FAIL_AFTER_RTOS: u32 = 3;
/// Packets received before an ACK is due.
pub const ACK_EVERY: u32 = 8;
/// New packets a receive batch must bring for the driver's end-of-batch flush to
/// send an ACK before `ACK_EVERY` or the ACK delay (a batch that completes a
/// message or holds an ACK_REQ packet, a CE mark, a duplicate or a PING flushes
/// whatever its size). A flush after every batch sent one ACK per 3.7 data packets
/// on the busy host fabric: a fifth of the packets its forwarding paid for.
pub const ACK_FLUSH_MIN: u32 = 4;
/// New packets go to the paths in runs of this many, not one each. A path's
/// last packet before the rotation leaves it is a tail no gap on the path shows
/// when it is lost; with one packet per path a small message (a 64 KiB
/// allreduce step is 46 packets over 16 paths) had a tail on every path, so most
/// of its losses waited for a late-packet or tail-loss timer: the 64 KiB
/// allreduce took 2.9x its lossless time at 1% loss. Runs of 8 make one loss in
/// 8 a tail, keep every path in use, and batch 8 packets per socket send.
pub const RUN_PACKETS: u32 = 8;
/// What a datagram costs the receiver's link beyond the transport's own bytes:
/// the Ethernet (14), IPv4 (20) and UDP (8) headers. The rate hint is a link's
/// rate, so the cap counts them (for IPv6 it still under-counts 20 bytes).
pub const LINK_OVERHEAD: u64 = 42;
/// Redundant ACK entries per ACK beyond the paths that changed.
pub const EXTRA_ACK_ENTRIES: usize = 2;
/// ACKs that carry a path's entry after it changed. One ACK in four rode a dark
/// link back (layer-4 hashing is not symmetric, and the receiver has no traffic
/// of its own to find its dead paths): a change sent once left the sender's
/// path full and waiting for a tail-loss probe or timeout, whose copy of a
/// delivered packet was wasted wire (goodput 6% under the wire's in 10 ms bins).
pub const ACK_REPORTS: u8 = 2;

#[derive(Clone, Debug)]
pub struct ConnParams {
    pub mss: u32,
    pub paths: u8,
    pub credit_window: u32,
    pub eager_max: u32,
    pub timers: PathTimers,
    pub max_window: u64,
    pub initial_rtt: Micros,
    pub abort_timeout: Micros,
    pub probe_interval: Micros,
    pub rotate_after: Micros,
    pub ack_delay: Micros,
    pub hello_interval: Micros,
    pub max_ack_entries: usize,
    pub queue_target: Micros,
}

impl Clone for PathTimers {
    fn clone(&self) -> Self {
        PathTimers { min_rto: self.min_rto, max_rto: self.max_rto }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    Connecting,
    Established,
    Failed,
}

#[derive(Debug)]
enum SendPhase {
    Eager,
    /// Rendezvous: waiting for the receiver's CTS.
    WaitCts,
    Cleared {
        accepted: u32,
    },
}

#[derive(Debug)]
struct SendMsg {
    context: u64,
    completion: bool,
    buf: SendBuf,
    len: u32,
    tag: u64,
    tagged: bool,
    cq_data: Option<u64>,
    phase: SendPhase,
    rts_sent: bool,
    next_seg: u32,
    segs: u32,
    acked: Bitmap,
    acked_count: u32,
}

#[derive(Debug)]
enum Target {
    /// Not matched yet: eager data waits in the connection's pool.
    Pool(Vec<u8>),
    /// Not matched yet, rendezvous: only the announcement arrived.
    Announced,
    User {
        buf: RecvBuf,
        context: u64,
        completion: bool,
        accepted: u32,
    },
    Discard,
}

#[derive(Debug)]
struct RecvMsg {
    tag: u64,
    tagged: bool,
    cq_data: Option<u64>,
    len: u32,
    rndv: bool,
    /// Segments expected (eager: the whole message; rendezvous: what was accepted).
    segs: u32,
    bits: Bitmap,
    rcvd: u32,
    target: Target,
    matched: bool,
}

#[derive(Debug, Default)]
struct Bitmap(Vec<u64>);

impl Bitmap {
    fn new(bits: u32) -> Self {
        Bitmap(vec![0; (bits as usize).div_ceil(64)])
    }
    fn get(&self, i: u32) -> bool {
        self.0.get(i as usize / 64).is_some_and(|w| w >> (i % 64) & 1 == 1)
    }
    /// Sets bit i; false if it was set already.
    fn set(&mut self, i: u32) -> bool {
        let w = &mut self.0[i as usize / 64];
        let was = *w >> (i % 64) & 1 == 1;
        *w |= 1 << (i % 64);
        !was
    }
}

/// Header fields of a message, as the matcher needs them.
#[derive(Clone, Copy, Debug)]
pub struct MsgInfo {
    pub msg: u32,
    pub tag: u64,
    pub tagged: bool,
    pub len: u32,
    pub cq_data: Option<u64>,
}

pub struct Connection {
    pub local_token: u64,
    pub peer_token: u64,
    pub peer_incarnation: u64,
    pub addr: SocketAddr,
    pub peer: PeerId,
    pub state: ConnState,
    pub cookie: Option<([u8; 16], u32)>,
    pub next_hello_at: Micros,
    hello_backoff: u32,
    pub created_at: Micros,
    pub last_activity: Micros,
    params: ConnParams,
    pub mss: u32,
    pub peer_credit_window: u32,
    // Send side.
    pub paths: Vec<Path>,
    next_msg: u32,
    smsgs: BTreeMap<u32, SendMsg>,
    tx_queue: VecDeque<u32>,
    retx: VecDeque<(Frame, u8)>,
    /// Frames bound to one path: tail-loss probes and pings.
    probes: VecDeque<(Frame, u8)>,
    ctrl: VecDeque<Frame>,
    eager_started: u64,
    credit_limit: u64,
    rnr_stalled: bool,
    rnr_probe_at: Micros,
    /// The receiver's rate hint as bytes per microsecond (0: none).
    rate_cap: f64,
    cap_tokens: f64,
    cap_tokens_at: Micros,
    rr: usize,
    /// Packets the current path may still take before the rotation moves on.
    run_left: u32,
    last_progress: Micros,
    /// Packets sent so far on all paths, and the send order of the newest one
    /// any path has had acknowledged (see `Path::late_deadline`).
    sent_order: u64,
    newest_acked_order: u64,
    pub rotate_requests: Vec<u8>,
    // Receive side.
    rwin: Vec<Option<RecvWindow>>,
    /// Per peer path: ACKs still to carry its entry (`ACK_REPORTS` after a change).
    rwin_reports: Vec<u8>,
    rmsgs: HashMap<u32, RecvMsg>,
    pub next_match: u32,
    done_floor: u32,
    done_above: BTreeSet<u32>,
    eager_consumed: u64,
    pool_bytes: u64,
    pending_cts: HashMap<u32, u32>,
    ack_pending: bool,
    ack_urgent: bool,
    /// The next end-of-batch flush sends the pending ACK whatever its size.
    ack_eager: bool,
    ack_copies: u8,
    ack_final: bool,
    ack_unacked: u32,
    ack_deadline: Micros,
    ack_rr: usize,
    pub last_data_rcvd_at: Micros,
}

fn seg_count(len: u32, mss: u32) -> u32 {
    len.div_ceil(mss).max(1)
}

impl Connection {
    pub fn new(now: Micros, local_token: u64, addr: SocketAddr, peer: PeerId, params: ConnParams, epochs: &[u16]) -> Self {
        let mss = params.mss;
        let paths = (0..params.paths)
            .map(|i| Path::new(i, epochs[i as usize], mss as u64, params.max_window, params.initial_rtt, params.queue_target))
            .collect();
        Self {
            local_token,
            peer_token: 0,
            peer_incarnation: 0,
            addr,
            peer,
            state: ConnState::Connecting,
            cookie: None,
            next_hello_at: now,
            hello_backoff: 0,
            created_at: now,
            last_activity: now,
            mss,
            peer_credit_window: 0,
            paths,
            next_msg: 0,
            smsgs: BTreeMap::new(),
            tx_queue: VecDeque::new(),
            retx: VecDeque::new(),
            probes: VecDeque::new(),
            ctrl: VecDeque::new(),
            eager_started: 0,
            credit_limit: 0,
            rnr_stalled: false,
            rnr_probe_at: 0,
            rate_cap: 0.0,
            cap_tokens: 0.0,
            cap_tokens_at: now,
            rr: 0,
            run_left: 0,
            last_progress: now,
            sent_order: 0,
            newest_acked_order: 0,
            rotate_requests: Vec::new(),
            rwin: vec![None; 256],
            rwin_reports: vec![0; 256],
            rmsgs: HashMap::new(),
            next_match: 0,
            done_floor: 0,
            done_above: BTreeSet::new(),
            eager_consumed: 0,
            pool_bytes: 0,
            pending_cts: HashMap::new(),
            ack_pending: false,
            ack_urgent: false,
            ack_eager: false,
            ack_copies: 0,
            ack_final: false,
            ack_unacked: 0,
            ack_deadline: Micros::MAX,
            ack_rr: 0,
            last_data_rcvd_at: 0,
            params,
        }
    }

    /// The handshake completed: the peer's token, incarnation and parameters.
    pub fn establish(&mut self, now: Micros, peer_token: u64, incarnation: u64, peer_mss: u16, credit_window: u32) {
        self.peer_token = peer_token;
        self.peer_incarnation = incarnation;
        self.mss = self.params.mss.min(peer_mss as u32).max(256);
        self.peer_credit_window = credit_window;
        self.credit_limit = credit_window as u64;
        self.state = ConnState::Established;
        self.last_progress = now;
        self.last_activity = now;
    }

    pub fn has_outstanding(&self) -> bool {
        !self.smsgs.is_empty() || !self.pending_cts.is_empty()
    }

    pub fn is_idle(&self) -> bool {
        !self.has_outstanding() && self.rmsgs.is_empty()
    }

    // ----- sending -------------------------------------------------------------------

    pub fn queue_send(
        &mut self,
        buf: SendBuf,
        tag: u64,
        tagged: bool,
        cq_data: Option<u64>,
        context: u64,
        completion: bool,
    ) -> Result<(), Error> {
        if self.smsgs.len() as u32 >= MAX_MSGS_IN_FLIGHT {
            return Err(Error::Again);
        }
        let len = u32::try_from(buf.len()).map_err(|_| Error::Invalid)?;
        let msg = self.next_msg;
        self.next_msg = self.next_msg.wrapping_add(1);
        let rndv = len > self.params.eager_max;
        let segs = if rndv { 0 } else { seg_count(len, self.mss) };
        let phase = if rndv { SendPhase::WaitCts } else { SendPhase::Eager };
        self.smsgs.insert(
            msg,
            SendMsg {
                context,
                completion,
                buf,
                len,
                tag,
                tagged,
                cq_data,
                phase,
                rts_sent: false,
                next_seg: 0,
                segs,
                acked: Bitmap::new(segs.max(1)),
                acked_count: 0,
            },
        );
        self.tx_queue.push_back(msg);
        Ok(())
    }

    fn frame_needed(&self, f: &Frame) -> bool {
        match *f {
            Frame::Seg { msg, seg } => self.smsgs.get(&msg).is_some_and(|m| !m.acked.get(seg)),
            Frame::Rts { msg } => self.smsgs.get(&msg).is_some_and(|m| matches!(m.phase, SendPhase::WaitCts)),
            Frame::Cts { msg, .. } => self.pending_cts.contains_key(&msg),
            Frame::Ping => true,
        }
    }

    fn on_frame_acked(&mut self, f: Frame, path: usize, out: &mut Shared) {
        match f {
            Frame::Seg { msg, seg } => {
                let mss = self.mss;
                let done = match self.smsgs.get_mut(&msg) {
                    Some(m) => {
                        if m.acked.set(seg) {
                            m.acked_count += 1;
                            let limit = match m.phase {
                                SendPhase::Cleared { accepted } => accepted,
                                _ => m.len,
                            };
                            out.counters.bytes_acked += (limit - (seg * mss).min(limit)).min(mss) as u64;
                        }
                        m.acked_count >= m.segs && !matches!(m.phase, SendPhase::WaitCts)
                    }
                    None => false,
                };
                if done {
                    self.complete_send(msg, None, out);
                }
            }
            Frame::Rts { .. } => {}
            Frame::Cts { msg, .. } => {
                self.pending_cts.remove(&msg);
            }
            Frame::Ping => {
                let p = &mut self.paths[path];
                if p.state == PathState::Failed {
                    p.state = PathState::Active;
                    p.backoff = 0;
                    p.cc.reset();
                    out.counters.path_readmissions += 1;
                }
            }
        }
    }

    fn complete_send(&mut self, msg: u32, err: Option<Error>, out: &mut Shared) {
        if let Some(m) = self.smsgs.remove(&msg) {
            out.counters.msgs_sent += 1;
            if m.completion || err.is_some() {
                out.completions.push_back(Completion {
                    context: m.context,
                    kind: OpKind::Send,
                    tagged: m.tagged,
                    cq_data: None,
                    err,
                    len: m.len as u64,
                    tag: m.tag,
                    peer: self.peer,
                    olen: 0,
                    buf: None,
                });
            }
        }
    }

    pub fn on_ack(&mut self, now: Micros, ack: &Ack, out: &mut Shared) {
        self.last_activity = now;
        self.credit_limit = self.credit_limit.max(ack.credit);
        if self.rnr_stalled && self.credit_limit > self.eager_started {
            self.rnr_stalled = false;
        }
        // Mbit/s -> bytes/us
        self.rate_cap = ack.rate_hint_mbps as f64 / 8.0;
        // The shared delay, from the paths that carry their full share: a path steered
        // off for CE is kept short of queue on purpose and is no reference.
        // The price: when every full-share path crosses the same loaded links (the
        // unmarked ones while another link marks CE), their common queue is held only by
        // the shared target (SHARED_QUEUE_FACTOR x 500 us = 4 ms), not the own one; the
        // simulator's CE scenario shows those paths at about 4 ms srtt.
        let current = || self.paths.iter().filter(|p| p.delay_is_current(now));
        let common = current()
            .filter(|p| p.steer_weight() >= 1.0)
            .map(|p| p.recent_rtt.get())
            .min()
            .or_else(|| current().map(|p| p.recent_rtt.get()).min())
            .unwrap_or(Micros::MAX);
        for e in &ack.entries {
            let i = e.path as usize;
            if i >= self.paths.len() || self.paths[i].epoch != e.epoch {
                continue;
            }
            let p = &self.paths[i];
            let (ce_before, spurious_before, late_before) = (p.ce_echoed, p.spurious_rtos, p.spurious_late);
            let outcome = self.paths[i].on_ack(now, e, 0, common);
            let p = &self.paths[i];
            out.counters.ce_echoed += p.ce_echoed - ce_before;
            out.counters.spurious_rtos += p.spurious_rtos - spurious_before;
            out.counters.spurious_late_losses += p.spurious_late - late_before;
            if !outcome.acked.is_empty() {
                self.last_progress = now;
            }
            if let Some(o) = outcome.newest_order {
                self.newest_acked_order = self.newest_acked_order.max(o);
            }
            for f in outcome.acked {
                self.on_frame_acked(f, i, out);
            }
            if self.rnr_stalled {
                self.last_progress = now; // the receiver answers: it is not ready, not gone
            }
            for f in outcome.lost {
                out.counters.sack_holes += 1;
                self.requeue(f, i);
            }
        }
        self.take_late(now, out);
    }

    /// A frame given up on path `lost_on` is sent again (elsewhere, when it can),
    /// unless its message no longer needs it. A lost PING is not resent.
    fn requeue(&mut self, f: Frame, lost_on: usize) {
        if self.frame_needed(&f) && f != Frame::Ping {
            self.retx.push_back((f, lost_on as u8));
        }
    }

    /// Requeue the packets other paths' ACKs show overdue (see `Path::late_after`),
    /// and what a timeout held on a path that stays silent (see `Path::on_timeout`).
    fn take_late(&mut self, now: Micros, out: &mut Shared) {
        let evidence = self.newest_acked_order;
        for i in 0..self.paths.len() {
            for f in self.paths[i].take_held(evidence) {
                out.counters.held_released += 1;
                self.requeue(f, i);
            }
            let lost = self.paths[i].take_late(&self.params.timers, now, evidence);
            for f in lost {
                out.counters.late_losses += 1;
                self.requeue(f, i);
            }
        }
    }

    pub fn on_cts(&mut self, msg: u32, accepted: u32, out: &mut Shared) {
        let Some(m) = self.smsgs.get_mut(&msg) else {
            out.counters.dup_rcvd += 1;
            return;
        };
        if !matches!(m.phase, SendPhase::WaitCts) {
            out.counters.dup_rcvd += 1;
            return;
        }
        let accepted = accepted.min(m.len);
        m.phase = SendPhase::Cleared { accepted };
        m.segs = if accepted == 0 { 0 } else { accepted.div_ceil(self.mss) };
        m.acked = Bitmap::new(m.segs.max(1));
        m.acked_count = 0;
        m.next_seg = 0;
        if m.segs == 0 {
            self.complete_send(msg, None, out);
        } else {
            self.tx_queue.push_back(msg);
        }
    }

    // ----- receiving -------------------------------------------------------------------

    fn is_done(&self, msg: u32) -> bool {
        msg.wrapping_sub(self.done_floor) >= 1 << 31 || self.done_above.contains(&msg)
    }

    fn mark_done(&mut self, msg: u32) {
        if msg == self.done_floor {
            self.done_floor = self.done_floor.wrapping_add(1);
            while self.done_above.remove(&self.done_floor) {
                self.done_floor = self.done_floor.wrapping_add(1);
            }
        } else {
            self.done_above.insert(msg);
        }
    }

    /// Record a DATA packet's arrival on the peer's path; false: drop it.
    pub fn on_data_arrival(&mut self, now: Micros, h: &Header, psn: u32, floor_delta: u16, ce: bool, out: &mut Shared) -> bool {
        let i = h.path as usize;
        let win = self.rwin[i].get_or_insert_with(|| RecvWindow::new(h.epoch));
        if win.epoch != h.epoch {
            if h.epoch.wrapping_sub(win.epoch) < 1 << 15 {
                *win = RecvWindow::new(h.epoch); // the peer rotated this path
            } else {
                out.counters.drops_stale += 1;
                return false;
            }
        }
        self.last_activity = now;
        win.advance_floor(psn.wrapping_sub(floor_delta as u32));
        match win.on_packet(psn, ce) {
            Arrival::New { new_hole } => {
                if ce {
                    out.counters.ce_rcvd += 1;
                    self.ack_eager = true; // the sender's controller and steering wait on it
                }
                if h.flags & wire::FLAG_ACK_REQ != 0 {
                    self.ack_eager = true;
                }
                self.rwin_reports[i] = ACK_REPORTS;
                self.ack_pending = true;
                self.ack_unacked += 1;
                if new_hole {
                    out.counters.gaps_seen += 1;
                    self.ack_urgent = true;
                }
                if self.ack_deadline == Micros::MAX {
                    self.ack_deadline = now + self.params.ack_delay;
                }
                true
            }
            Arrival::Duplicate => {
                // Below the cumulative point or seen: re-acknowledge (our ACK may
                // have been lost) and let the frame's own state drop a duplicate.
                self.ack_pending = true;
                self.ack_eager = true;
                self.rwin_reports[i] = ACK_REPORTS;
                if self.ack_deadline == Micros::MAX {
                    self.ack_deadline = now + self.params.ack_delay;
                }
                true
            }
            Arrival::BeyondWindow => {
                out.counters.drops_stale += 1;
                false
            }
        }
    }

    /// A segment, announcement or CTS for this connection. Returns true when the
    /// message at `next_match` may have become matchable.
    pub fn on_data(&mut self, now: Micros, d: &DataHeader, payload: &[u8], out: &mut Shared) -> bool {
        self.last_data_rcvd_at = now;
        match d.kind {
            DataKind::Ping => {
                self.ack_eager = true; // a probe asks for an ACK
                false
            }
            DataKind::Cts => {
                self.on_cts(d.msg, d.msg_len, out);
                false
            }
            DataKind::Eager | DataKind::Rts | DataKind::Rndv => self.on_message_data(d, payload, out),
        }
    }

    fn on_message_data(&mut self, d: &DataHeader, payload: &[u8], out: &mut Shared) -> bool {
        if self.is_done(d.msg) {
            out.counters.dup_rcvd += 1;
            return false;
        }
        if d.msg.wrapping_sub(self.done_floor) >= MAX_MSGS_IN_FLIGHT {
            out.counters.drops_stale += 1;
            return false;
        }
        let mss = self.mss;
        let tagged = d.mflags & MFLAG_TAGGED != 0;
        let cq_data = (d.mflags & MFLAG_CQ_DATA != 0).then_some(d.cq_data);
        let mut fresh = false;
        if !self.rmsgs.contains_key(&d.msg) {
            let rndv = d.kind != DataKind::Eager;
            if d.kind == DataKind::Rndv {
                out.counters.drops_stale += 1; // data of a rendezvous we never announced
                return false;
            }
            let target = if rndv {
                Target::Announced
            } else {
                if self.pool_bytes + d.msg_len as u64 > 2 * self.params.credit_window as u64 {
                    out.counters.drops_no_credit += 1;
                    return false;
                }
                self.pool_bytes += d.msg_len as u64;
                Target::Pool(vec![0; d.msg_len as usize])
            };
            let segs = if rndv { 0 } else { seg_count(d.msg_len, mss) };
            self.rmsgs.insert(
                d.msg,
                RecvMsg {
                    tag: d.tag,
                    tagged,
                    cq_data,
                    len: d.msg_len,
                    rndv,
                    segs,
                    bits: Bitmap::new(segs.max(1)),
                    rcvd: 0,
                    target,
                    matched: false,
                },
            );
            fresh = true;
        }
        let m = self.rmsgs.get_mut(&d.msg).unwrap();
        if m.len != d.msg_len || m.tag != d.tag || m.tagged != tagged || m.rndv != (d.kind != DataKind::Eager) {
            out.counters.drops_malformed += 1;
            return false;
        }
        if d.kind == DataKind::Rts {
            if !fresh {
                out.counters.dup_rcvd += 1;
            }
            return fresh;
        }
        // Eager segments cover the message; rendezvous ones what the receiver accepted.
        let limit = match (&m.target, d.kind) {
            (Target::User { accepted, .. }, DataKind::Rndv) => *accepted,
            (_, DataKind::Rndv) => 0,
            _ => d.msg_len,
        };
        if !d.offset.is_multiple_of(mss) || payload.len() as u32 != limit.saturating_sub(d.offset).min(mss) && limit != 0 {
            out.counters.drops_malformed += 1;
            return false;
        }
        let seg = d.offset / mss;
        if d.kind == DataKind::Rndv && (!m.matched || seg >= m.segs) {
            out.counters.drops_stale += 1;
            return false;
        }
        if !m.bits.set(seg) {
            out.counters.dup_rcvd += 1;
            return false;
        }
        m.rcvd += 1;
        if m.rcvd >= m.segs {
            self.ack_eager = true; // the sender's completion waits for this ACK
        }
        out.counters.bytes_rcvd += payload.len() as u64;
        match &mut m.target {
            Target::Pool(v) => v[d.offset as usize..d.offset as usize + payload.len()].copy_from_slice(payload),
            Target::User { buf, .. } => buf.write(d.offset as usize, payload),
            Target::Announced | Target::Discard => {}
        }
        if m.matched && m.rcvd >= m.segs {
            self.complete_recv(d.msg, out);
        }
        fresh
    }

    /// The next message in send order whose header is known, if not matched yet.
    pub fn next_matchable(&self) -> Option<MsgInfo> {
        let m = self.rmsgs.get(&self.next_match)?;
        (!m.matched).then_some(MsgInfo { msg: self.next_match, tag: m.tag, tagged: m.tagged, len: m.len, cq_data: m.cq_data })
    }

    /// The message at `next_match` went to the unexpected queue.
    pub fn advance_match(&mut self) {
        self.next_match = self.next_match.wrapping_add(1);
    }

    /// Give a message its receive (None: discard it).
    pub fn bind(&mut self, msg: u32, recv: Option<PostedRecv>, out: &mut Shared) {
        let mss = self.mss;
        let Some(m) = self.rmsgs.get_mut(&msg) else { return };
        let old = std::mem::replace(&mut m.target, Target::Discard);
        let accepted = recv.as_ref().map_or(0, |r| (r.buf.len() as u64).min(m.len as u64) as u32);
        m.matched = true;
        if let Some(r) = recv {
            let mut buf = r.buf;
            if let Target::Pool(data) = &old {
                buf.write(0, &data[..accepted as usize]);
            }
            m.target = Target::User { buf, context: r.context, completion: r.completion, accepted };
        }
        if !m.rndv {
            self.pool_bytes -= m.len as u64;
            self.eager_consumed += m.len as u64;
            // Tell the sender its credit grew (it may be waiting for it).
            self.ack_pending = true;
            self.ack_deadline = self.ack_deadline.min(self.last_data_rcvd_at + self.params.ack_delay);
        } else {
            m.segs = if accepted == 0 { 0 } else { accepted.div_ceil(mss) };
            m.bits = Bitmap::new(m.segs.max(1));
            self.pending_cts.insert(msg, accepted);
            self.ctrl.push_back(Frame::Cts { msg, accepted });
        }
        if m.rcvd >= m.segs {
            self.complete_recv(msg, out);
        }
    }

    fn complete_recv(&mut self, msg: u32, out: &mut Shared) {
        let Some(m) = self.rmsgs.remove(&msg) else { return };
        self.mark_done(msg);
        out.counters.msgs_rcvd += 1;
        if let Target::User { buf, context, completion, accepted } = m.target {
            let trunc = m.len > accepted;
            if completion || trunc {
                out.completions.push_back(Completion {
                    context,
                    kind: OpKind::Recv,
                    tagged: m.tagged,
                    cq_data: m.cq_data,
                    err: trunc.then_some(Error::Truncated),
                    len: accepted as u64,
                    tag: m.tag,
                    peer: self.peer,
                    olen: (m.len - accepted) as u64,
                    buf: Some(buf),
                });
            }
        }
    }

    /// Fail everything outstanding (peer lost, restarted or timed out).
    pub fn fail(&mut self, err: Error, out: &mut Shared) {
        self.state = ConnState::Failed;
        let msgs: Vec<u32> = self.smsgs.keys().copied().collect();
        for msg in msgs {
            self.complete_send(msg, Some(err), out);
        }
        for (_, m) in self.rmsgs.drain() {
            if let Target::User { buf, context, .. } = m.target {
                out.completions.push_back(Completion {
                    context,
                    kind: OpKind::Recv,
                    tagged: m.tagged,
                    cq_data: None,
                    err: Some(err),
                    len: 0,
                    tag: m.tag,
                    peer: self.peer,
                    olen: 0,
                    buf: Some(buf),
                });
            }
        }
        self.pending_cts.clear();
        self.tx_queue.clear();
        self.retx.clear();
        self.ctrl.clear();
        self.probes.clear();
        for p in &mut self.paths {
            p.take_all_in_flight();
        }
    }

    // ----- timers -------------------------------------------------------------------

    pub fn handle_timeout(&mut self, now: Micros, out: &mut Shared) {
        if self.state == ConnState::Connecting {
            if now.saturating_sub(self.created_at) > self.params.abort_timeout {
                out.counters.conns_failed += 1;
                self.fail(Error::TimedOut, out);
            }
            return;
        }
        if self.state != ConnState::Established {
            return;
        }
        self.take_late(now, out);
        let timers = self.params.timers.clone();
        for i in 0..self.paths.len() {
            let p = &mut self.paths[i];
            if let Some(oldest) = p.oldest_sent_at() {
                let deadline = oldest.max(p.last_ack_at) + p.rto(&timers, now);
                if now >= deadline {
                    out.counters.rtos += 1;
                    let frames = p.on_timeout(now, self.sent_order + 1);
                    if p.backoff >= FAIL_AFTER_RTOS && p.state == PathState::Active {
                        p.state = PathState::Failed;
                        p.failed_since = now;
                        p.next_probe_at = now;
                        out.counters.path_failures += 1;
                    }
                    for f in frames {
                        self.requeue(f, i);
                    }
                    continue;
                }
                let p = &mut self.paths[i];
                if p.tlp_armed && p.state == PathState::Active && now >= p.last_send_at + p.pto(&timers, now) {
                    p.tlp_armed = false;
                    if let Some(last) = p.in_flight.back() {
                        out.counters.tlps += 1;
                        self.probes.push_back((last.frame, i as u8));
                    }
                }
            }
            let p = &mut self.paths[i];
            if p.state == PathState::Failed && now >= p.next_probe_at && p.in_flight.is_empty() {
                p.next_probe_at = now + self.params.probe_interval;
                self.probes.push_back((Frame::Ping, i as u8));
                // Path 0's socket is the endpoint's address (where peers send): never rotated.
                if i != 0 && now.saturating_sub(p.failed_since) >= self.params.rotate_after && !self.rotate_requests.contains(&(i as u8)) {
                    self.rotate_requests.push(i as u8);
                }
            }
        }
        self.probe_credit(now);
        if self.has_outstanding() && now.saturating_sub(self.last_progress) > self.params.abort_timeout {
            out.counters.conns_failed += 1;
            self.fail(Error::TimedOut, out);
        }
    }

    /// The local socket of path i got a new source port.
    pub fn rotate_path(&mut self, i: usize, epoch: u16) {
        if let Some(p) = self.paths.get_mut(i) {
            for f in p.rotate() {
                self.requeue(f, i);
            }
            let p = &mut self.paths[i];
            p.epoch = epoch;
            p.state = PathState::Active;
            p.failed_since = 0;
        }
        self.rotate_requests.retain(|r| *r as usize != i);
    }

    pub fn poll_timeout(&self, now: Micros) -> Option<Micros> {
        let mut t = Micros::MAX;
        match self.state {
            ConnState::Connecting => return Some(self.next_hello_at),
            ConnState::Failed => return None,
            ConnState::Established => {}
        }
        if self.ack_pending {
            t = t.min(if self.ack_urgent || self.ack_unacked >= ACK_EVERY { now } else { self.ack_deadline });
        }
        let timers = &self.params.timers;
        for p in &self.paths {
            if let Some(late) = p.late_deadline(timers, now, self.newest_acked_order) {
                t = t.min(late);
            }
            if let Some(oldest) = p.oldest_sent_at() {
                t = t.min(oldest.max(p.last_ack_at) + p.rto(timers, now));
                if p.tlp_armed && p.state == PathState::Active {
                    t = t.min(p.last_send_at + p.pto(timers, now));
                }
            }
            if p.state == PathState::Failed && p.in_flight.is_empty() {
                t = t.min(p.next_probe_at);
            }
        }
        if !self.probes.is_empty() || !self.ctrl.is_empty() || !self.retx.is_empty() || self.has_new_data() {
            // Blocked by window or pacer: the pacer's next refill.
            let want = self.mss as u64 + wire::DATA_OVERHEAD as u64;
            let next = self
                .paths
                .iter()
                .filter(|p| p.state == PathState::Active && p.window_room() && p.cwnd_room(want))
                .map(|p| p.pacer_ready_at(now, want, p.pacing_rate(now, f64::INFINITY)))
                .min();
            if let Some(next) = next {
                t = t.min(next.max(now + 1));
            }
        }
        if self.has_outstanding() {
            t = t.min(self.last_progress + self.params.abort_timeout + 1);
        }
        if self.rnr_stalled {
            t = t.min(self.rnr_probe_at.max(now + 1));
        }
        (t != Micros::MAX).then_some(t)
    }

    /// A sender waiting for credit with nothing in flight asks for an ACK now
    /// and then, in case the receiver's credit update was lost.
    fn probe_credit(&mut self, now: Micros) {
        if self.rnr_stalled && self.paths.iter().all(|p| p.in_flight.is_empty()) && now >= self.rnr_probe_at {
            self.rnr_probe_at = now + self.params.probe_interval;
            let i = self.rr % self.paths.len();
            self.probes.push_back((Frame::Ping, i as u8));
        }
    }

    fn has_new_data(&self) -> bool {
        !self.tx_queue.is_empty() && !self.rnr_stalled
    }

    // ----- transmitting -------------------------------------------------------------------

    /// Write the next packet this connection wants to send. Returns its length
    /// and the local path (socket) it must leave on, and whether it is ECT.
    pub fn poll_transmit(
        &mut self,
        now: Micros,
        buf: &mut [u8],
        incarnation: u64,
        local_credit_window: u32,
        rate_hint_mbps: u32,
        out: &mut Shared,
    ) -> Option<(usize, u8, bool)> {
        if self.state == ConnState::Connecting {
            if now < self.next_hello_at {
                return None;
            }
            self.hello_backoff = (self.hello_backoff + 1).min(8);
            self.next_hello_at = now + (self.params.hello_interval << self.hello_backoff.min(7));
            let (cookie, cookie_time) = self.cookie.unwrap_or(([0; 16], 0));
            let h = Header { ptype: PacketType::Hello, flags: 0, path: 0, epoch: self.paths[0].epoch, dst_token: 0 };
            let body = wire::Hello {
                src_token: self.local_token,
                incarnation,
                cookie,
                cookie_time,
                paths: self.params.paths,
                mss: self.params.mss as u16,
                credit_window: local_credit_window,
            };
            return Some((wire::write_hello(buf, &h, &body), 0, false));
        }
        if self.state != ConnState::Established {
            return None;
        }
        if self.ack_pending && (self.ack_urgent || self.ack_unacked >= ACK_EVERY || now >= self.ack_deadline) || self.ack_copies > 0 {
            return Some(self.write_ack(buf, rate_hint_mbps, out));
        }
        self.poll_data(now, buf, out)
    }

    /// Acknowledge everything received, once on every path (before a close:
    /// one copy could ride a dead link, and a peer that gets CLOSE before our
    /// ACK fails its own last sends).
    pub fn ack_on_every_path(&mut self) {
        if self.state == ConnState::Established && self.rwin.iter().any(|w| w.is_some()) {
            self.ack_pending = true;
            self.ack_deadline = 0;
            self.ack_copies = self.paths.len().saturating_sub(1).min(255) as u8;
            self.ack_final = true;
        }
    }

    /// The driver calls this after a receive batch: the pending ACK goes now if a
    /// sender may be waiting on it (`ack_eager`) or it covers `ACK_FLUSH_MIN`
    /// packets; otherwise `ACK_EVERY` or the ACK delay sends it.
    pub fn flush_ack(&mut self) {
        if self.ack_pending && (self.ack_eager || self.ack_unacked >= ACK_FLUSH_MIN) {
            self.ack_deadline = 0;
        }
    }

    fn write_ack(&mut self, buf: &mut [u8], rate_hint_mbps: u32, out: &mut Shared) -> (usize, u8, bool) {
        let first_copy = self.ack_copies == 0 || self.ack_final;
        self.ack_final = false;
        if first_copy && self.ack_urgent && self.ack_copies == 0 {
            self.ack_copies = 1; // a second copy on another path: an ACK can ride a dead link
        } else if !first_copy {
            self.ack_copies -= 1;
        }
        let max = self.params.max_ack_entries;
        let mut entries: Vec<AckEntry> = Vec::new();
        let mut extra = 0;
        for i in 0..self.rwin.len() {
            let Some(w) = &self.rwin[i] else { continue };
            if self.rwin_reports[i] > 0 || w.has_gap() {
                entries.push(w.entry(i as u8));
                if first_copy {
                    self.rwin_reports[i] = self.rwin_reports[i].saturating_sub(1);
                }
            } else if extra < EXTRA_ACK_ENTRIES {
                extra += 1;
                entries.push(w.entry(i as u8));
            }
            if entries.len() >= max {
                break;
            }
        }
        if first_copy {
            self.ack_pending = false;
            self.ack_urgent = false;
            self.ack_eager = false;
            self.ack_unacked = 0;
            self.ack_deadline = Micros::MAX;
        }
        let ack = Ack { rate_hint_mbps, credit: self.eager_consumed + self.params.credit_window as u64, entries };
        let path = self.ack_path() as u8;
        let h = Header { ptype: PacketType::Ack, flags: 0, path, epoch: self.paths[path as usize].epoch, dst_token: self.peer_token };
        out.counters.acks_sent += 1;
        (wire::write_ack(buf, &h, &ack), path, false)
    }

    /// The next path in the ACKs' round robin, past paths this endpoint's own data
    /// found dead: an ACK leaves by the same source port, so it would die on the same
    /// link (where this side sends no data it cannot know, and two ACKs per change
    /// cover it). With every path failed, the round robin as it stands.
    fn ack_path(&mut self) -> usize {
        let n = self.paths.len();
        let path = (0..n).map(|k| (self.ack_rr + k) % n).find(|&i| self.paths[i].state != PathState::Failed).unwrap_or(self.ack_rr % n);
        self.ack_rr = path + 1;
        path
    }

    /// Whether the receiver's rate hint leaves room for a datagram of `bytes`
    /// (the transport's bytes; the link's headers are added here).
    fn cap_allows(&mut self, now: Micros, bytes: u64) -> bool {
        if self.rate_cap <= 0.0 {
            return true;
        }
        let burst = (self.rate_cap * crate::path::PACING_SLICE as f64).max(2.0 * 9216.0);
        self.cap_tokens = (self.cap_tokens + now.saturating_sub(self.cap_tokens_at) as f64 * self.rate_cap).min(burst);
        self.cap_tokens_at = now;
        self.cap_tokens >= (bytes + LINK_OVERHEAD) as f64
    }

    /// A datagram sent under the cap. Resends and probes go without waiting for
    /// it (they are what the receiver waits on) but are charged all the same:
    /// left out, they came on top of the hint, and the losses they repaired
    /// bred more of them at the receiver's port.
    fn charge_cap(&mut self, bytes: u64) {
        if self.rate_cap > 0.0 {
            self.cap_tokens -= (bytes + LINK_OVERHEAD) as f64;
        }
    }

    /// A path that can carry `bytes` now, round robin. Suspect paths (recent loss
    /// or CE) stay in the rotation at a reduced pacing rate: a path that gets no
    /// packets cannot reveal its losses through later packets.
    fn choose_path(&mut self, now: Micros, bytes: u64, avoid: Option<u8>) -> Option<usize> {
        let n = self.paths.len();
        // A marked path is paced at its weight times the unmarked paths' mean
        // delivery rate: with next to no propagation delay a small window still
        // fills a link, so only a rate can move bytes off it.
        let unmarked: Vec<f64> = self
            .paths
            .iter()
            .filter(|p| p.state == PathState::Active && p.steer_weight() >= 1.0 && p.rate_est > 0.0)
            .map(|p| p.rate_est)
            .collect();
        let mean_rate = (!unmarked.is_empty()).then(|| unmarked.iter().sum::<f64>() / unmarked.len() as f64);
        let mut fallback = None;
        // The rotation gives each path a run of RUN_PACKETS (see there): start at
        // the current path while its run lasts, else at the next.
        let start = if self.run_left > 0 { self.rr + n - 1 } else { self.rr };
        for k in 0..n {
            let i = (start + k) % n;
            let p = &mut self.paths[i];
            if p.state != PathState::Active || !p.window_room() || !p.cwnd_room(bytes) {
                continue;
            }
            let w = p.steer_weight();
            let cap = match mean_rate {
                Some(r) if w < 1.0 => w * r,
                _ => f64::INFINITY,
            };
            let rate = p.pacing_rate(now, cap);
            if !p.pacer_allows(now, bytes, rate) {
                continue;
            }
            if Some(i as u8) == avoid {
                fallback.get_or_insert(i);
                continue;
            }
            self.take_turn(i, k == 0 && self.run_left > 0);
            return Some(i);
        }
        if let Some(i) = fallback {
            self.take_turn(i, false);
        }
        fallback
    }

    fn take_turn(&mut self, i: usize, same_run: bool) {
        self.run_left = if same_run { self.run_left - 1 } else { RUN_PACKETS - 1 };
        self.rr = i + 1;
    }

    fn frame_bytes(&self, f: &Frame) -> u64 {
        let payload = match *f {
            Frame::Seg { msg, seg } => self.smsgs.get(&msg).map_or(0, |m| {
                let limit = match m.phase {
                    SendPhase::Cleared { accepted } => accepted,
                    _ => m.len,
                };
                (limit - (seg * self.mss).min(limit)).min(self.mss)
            }),
            _ => 0,
        };
        (payload as usize + wire::DATA_OVERHEAD) as u64
    }

    fn poll_data(&mut self, now: Micros, buf: &mut [u8], out: &mut Shared) -> Option<(usize, u8, bool)> {
        // Path-bound probes first (they go on their own path, outside the window).
        while let Some(&(f, path)) = self.probes.front() {
            if f != Frame::Ping && !self.frame_needed(&f) {
                self.probes.pop_front();
                continue;
            }
            self.probes.pop_front();
            let is_retx = f != Frame::Ping;
            let bytes = self.frame_bytes(&f);
            self.charge_cap(bytes);
            if is_retx {
                // A tail-loss probe is a copy sent again like any resend: counted as one, so
                // the receiver's duplicates (`dup_rcvd`) are always a share of `retransmits`.
                out.counters.retransmits += 1;
            }
            return Some(self.write_frame(now, buf, f, path as usize, is_retx, out));
        }
        while let Some(&f) = self.ctrl.front() {
            if !self.frame_needed(&f) {
                self.ctrl.pop_front();
                continue;
            }
            let bytes = self.frame_bytes(&f);
            let path = self.choose_path(now, bytes, None)?;
            self.ctrl.pop_front();
            return Some(self.write_frame(now, buf, f, path, false, out));
        }
        while let Some(&(f, avoid)) = self.retx.front() {
            if !self.frame_needed(&f) {
                self.retx.pop_front();
                continue;
            }
            let bytes = self.frame_bytes(&f);
            let path = self.choose_path(now, bytes, Some(avoid))?;
            self.retx.pop_front();
            self.charge_cap(bytes);
            out.counters.retransmits += 1;
            return Some(self.write_frame(now, buf, f, path, true, out));
        }
        // New data, in message order.
        let qi = 0;
        while qi < self.tx_queue.len() {
            let msg = self.tx_queue[qi];
            let Some(m) = self.smsgs.get(&msg) else {
                self.tx_queue.remove(qi);
                continue;
            };
            let frame = match m.phase {
                SendPhase::Eager => {
                    if m.next_seg == 0 && self.eager_started + m.len as u64 > self.credit_limit {
                        if !self.rnr_stalled {
                            self.rnr_stalled = true;
                            out.counters.rnr_waits += 1;
                        }
                        return None; // receiver not ready: wait for credit, not loss
                    }
                    Frame::Seg { msg, seg: m.next_seg }
                }
                SendPhase::WaitCts if !m.rts_sent => Frame::Rts { msg },
                SendPhase::WaitCts => {
                    self.tx_queue.remove(qi);
                    continue;
                }
                SendPhase::Cleared { .. } => Frame::Seg { msg, seg: m.next_seg },
            };
            let bytes = self.frame_bytes(&frame);
            if !self.cap_allows(now, bytes) {
                return None;
            }
            let path = self.choose_path(now, bytes, None)?;
            let m = self.smsgs.get_mut(&msg).unwrap();
            match frame {
                Frame::Rts { .. } => {
                    m.rts_sent = true;
                    self.tx_queue.remove(qi);
                }
                Frame::Seg { .. } => {
                    if m.next_seg == 0 && matches!(m.phase, SendPhase::Eager) {
                        self.eager_started += m.len as u64;
                    }
                    m.next_seg += 1;
                    if m.next_seg >= m.segs {
                        self.tx_queue.remove(qi);
                    }
                }
                _ => {}
            }
            self.charge_cap(bytes);
            return Some(self.write_frame(now, buf, frame, path, false, out));
        }
        None
    }

    fn write_frame(&mut self, now: Micros, buf: &mut [u8], f: Frame, path: usize, is_retx: bool, out: &mut Shared) -> (usize, u8, bool) {
        let mss = self.mss;
        let mut last_seg = false;
        let (mut d, payload): (DataHeader, &[u8]) = match f {
            Frame::Seg { msg, seg } => {
                let m = &self.smsgs[&msg];
                let limit = match m.phase {
                    SendPhase::Cleared { accepted } => accepted,
                    _ => m.len,
                };
                let off = seg * mss;
                let n = (limit - off.min(limit)).min(mss);
                let kind = if matches!(m.phase, SendPhase::Eager) { DataKind::Eager } else { DataKind::Rndv };
                last_seg = off + n >= limit;
                (Self::msg_header(msg, m, off, kind), m.buf.slice(off as usize, n as usize))
            }
            Frame::Rts { msg } => (Self::msg_header(msg, &self.smsgs[&msg], 0, DataKind::Rts), &[][..]),
            Frame::Cts { msg, accepted } => (
                DataHeader {
                    psn: 0,
                    msg,
                    offset: 0,
                    msg_len: accepted,
                    tag: 0,
                    cq_data: 0,
                    kind: DataKind::Cts,
                    mflags: 0,
                    floor_delta: 0,
                },
                &[][..],
            ),
            Frame::Ping => (
                DataHeader { psn: 0, msg: 0, offset: 0, msg_len: 0, tag: 0, cq_data: 0, kind: DataKind::Ping, mflags: 0, floor_delta: 0 },
                &[][..],
            ),
        };
        let bytes = (payload.len() + wire::DATA_OVERHEAD) as u32;
        let p = &mut self.paths[path];
        self.sent_order += 1;
        (d.psn, d.floor_delta) = p.on_sent(now, f, bytes, is_retx, self.sent_order);
        // The sender waits on these ACKs: its completion (a message's last segment,
        // FI_TRANSMIT_COMPLETE) or a recovery (a resend). A PING needs no flag: the
        // receiver acknowledges a PING by its kind (`on_data`).
        let flags = if last_seg || is_retx { wire::FLAG_ACK_REQ } else { 0 };
        let h = Header { ptype: PacketType::Data, flags, path: path as u8, epoch: p.epoch, dst_token: self.peer_token };
        let n = wire::write_data(buf, &h, &d, payload.len(), |s| s.copy_from_slice(payload));
        out.counters.pkts_sent += 1;
        out.counters.bytes_sent += payload.len() as u64;
        self.last_activity = now;
        (n, path as u8, true)
    }

    fn msg_header(msg: u32, m: &SendMsg, offset: u32, kind: DataKind) -> DataHeader {
        let mut mflags = 0;
        if m.tagged {
            mflags |= MFLAG_TAGGED;
        }
        if m.cq_data.is_some() {
            mflags |= MFLAG_CQ_DATA;
        }
        DataHeader { psn: 0, msg, offset, msg_len: m.len, tag: m.tag, cq_data: m.cq_data.unwrap_or(0), kind, mflags, floor_delta: 0 }
    }

    /// Bytes this connection holds for the application (stated bounds).
    pub fn memory_bytes(&self) -> u64 {
        let pool = self.pool_bytes;
        let tracking =
            (self.smsgs.len() + self.rmsgs.len()) as u64 * 160 + self.paths.iter().map(|p| p.in_flight.len() as u64 * 32).sum::<u64>();
        pool + tracking
    }
}

/// What connections report into: the endpoint's completion queue and counters.
pub struct Shared {
    pub completions: VecDeque<Completion>,
    pub counters: Counters,
}
