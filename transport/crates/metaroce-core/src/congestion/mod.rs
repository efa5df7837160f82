//! Congestion controllers, one file each, behind one trait. A controller owns a
//! path's window; pacing turns window and RTT into a rate.

pub mod aimd;

use crate::time::Micros;

/// What one ACK says about a path's delay.
#[derive(Clone, Copy, Debug, Default)]
pub struct Delay {
    /// This ACK's sample.
    pub rtt: Micros,
    /// The path's lowest sample ever.
    pub min_rtt: Micros,
    pub srtt: Micros,
    /// The path's lowest sample of the last millisecond or two: a queue on a link
    /// persists and lifts it, a scheduling hiccup of the hosts mostly does not.
    pub recent: Micros,
    /// The lowest `recent` among the connection's live paths. Every path shares
    /// the two hosts' own delay (socket buffers, batching, a descheduled progress
    /// thread: hundreds of microseconds on a loaded host), so `recent - common`
    /// is the queue on this path's own links, the part a window on it can change.
    pub common: Micros,
    /// The path's lowest sample of the last one to two srtt: what the whole RTT
    /// is held to. A queue on the way persists that long; a stall of the hosts
    /// (a descheduled thread, an emulated CPU) mostly does not, and read as a
    /// queue it held windows under what the stalls leave in flight.
    pub standing: Micros,
}

pub trait Controller: Send + std::fmt::Debug {
    /// Bytes the path may have in flight.
    fn window(&self) -> u64;
    fn on_ack(&mut self, now: Micros, acked_bytes: u64, delay: Delay);
    /// `marked` of the last `total` packets the receiver saw carried CE.
    fn on_ce(&mut self, now: Micros, marked: u32, total: u32, srtt: Micros);
    /// A packet sent at `sent_at` was lost.
    fn on_loss(&mut self, now: Micros, sent_at: Micros, srtt: Micros);
    /// `packets` losses reported by `on_loss` proved spurious (they arrived after all).
    fn on_loss_disproven(&mut self, packets: u32);
    /// The path's retransmission timer fired; `consecutive` earlier timeouts
    /// without an ACK in between (0 for the first).
    fn on_timeout(&mut self, now: Micros, consecutive: u32);
    /// Reset to the initial window (a re-admitted or rotated path).
    fn reset(&mut self);
}
