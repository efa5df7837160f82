//! Congestion controllers, one file each, behind one trait. A controller owns a
//! path's window; pacing turns window and RTT into a rate.

pub mod aimd;

use crate::time::Micros;

pub trait Controller: Send + std::fmt::Debug {
    /// Bytes the path may have in flight.
    fn window(&self) -> u64;
    /// `rtt` is this ACK's sample, `min_rtt` the path's lowest seen.
    fn on_ack(&mut self, now: Micros, acked_bytes: u64, rtt: Micros, min_rtt: Micros, srtt: Micros);
    /// `marked` of the last `total` packets the receiver saw carried CE.
    fn on_ce(&mut self, now: Micros, marked: u32, total: u32, srtt: Micros);
    /// A packet sent at `sent_at` was lost.
    fn on_loss(&mut self, now: Micros, sent_at: Micros, srtt: Micros);
    fn on_timeout(&mut self, now: Micros);
    /// Reset to the initial window (a re-admitted or rotated path).
    fn reset(&mut self);
}
