//! Per-path receive window: the cumulative point and a 256-bit bitmap above it,
//! which is exactly what one ACK entry carries.

use crate::wire::{AckEntry, SACK_BITS};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// First time this PSN is seen. `new_hole`: it is above a PSN never seen that
    /// no earlier arrival was above, so the sender learns of a loss it does not
    /// know yet. Packets that arrive above a hole already reported are not news:
    /// acknowledging each of them at once multiplied the ACKs under loss.
    New { new_hole: bool },
    /// Seen before (the network duplicated it) or below the cumulative point.
    Duplicate,
    /// More than 256 ahead of the cumulative point: the sender broke its window.
    BeyondWindow,
}

#[derive(Clone, Debug, Default)]
pub struct RecvWindow {
    pub epoch: u16,
    /// Next expected PSN.
    pub cum: u32,
    /// Bit i: PSN cum + 1 + i received.
    bits: [u64; 4],
    pub ce: u32,
    pub rcvd: u32,
    /// One past the highest PSN seen (at least `cum`).
    top: u32,
}

impl RecvWindow {
    pub fn new(epoch: u16) -> Self {
        Self { epoch, ..Self::default() }
    }

    pub fn on_packet(&mut self, psn: u32, ce: bool) -> Arrival {
        let d = psn.wrapping_sub(self.cum);
        if d >= 1 << 31 {
            return Arrival::Duplicate;
        }
        if d > SACK_BITS {
            return Arrival::BeyondWindow;
        }
        let top = if self.top.wrapping_sub(self.cum) < 1 << 31 { self.top } else { self.cum };
        let ahead_of_top = psn.wrapping_sub(top);
        let new_hole = ahead_of_top != 0 && ahead_of_top < 1 << 31;
        if ahead_of_top < 1 << 31 {
            self.top = psn.wrapping_add(1);
        }
        if d == 0 {
            self.cum = self.cum.wrapping_add(1);
            while self.bits[0] & 1 == 1 {
                self.shift_one();
                self.cum = self.cum.wrapping_add(1);
            }
            // The bit for the new cum itself is the one we just shifted out.
            self.shift_one();
        } else {
            let i = (d - 1) as usize;
            let (w, b) = (i / 64, i % 64);
            if self.bits[w] >> b & 1 == 1 {
                return Arrival::Duplicate;
            }
            self.bits[w] |= 1 << b;
        }
        self.rcvd = self.rcvd.wrapping_add(1);
        if ce {
            self.ce = self.ce.wrapping_add(1);
        }
        Arrival::New { new_hole }
    }

    /// The sender gave up the PSNs below `floor`: move the cumulative point there.
    pub fn advance_floor(&mut self, floor: u32) {
        let d = floor.wrapping_sub(self.cum);
        if d == 0 || d >= 1 << 31 {
            return;
        }
        if d > SACK_BITS {
            self.bits = [0; 4];
            self.cum = floor;
            return;
        }
        // Each step: bit 0 (PSN cum + 1) becomes the new cum.
        let mut floor_received = false;
        for _ in 0..d {
            floor_received = self.bits[0] & 1 == 1;
            self.shift_one();
            self.cum = self.cum.wrapping_add(1);
        }
        if floor_received {
            // As after an in-order arrival of `floor`.
            self.cum = self.cum.wrapping_add(1);
            while self.bits[0] & 1 == 1 {
                self.shift_one();
                self.cum = self.cum.wrapping_add(1);
            }
            self.shift_one();
        }
    }

    /// Shift the bitmap down by one PSN (bit 0 leaves).
    fn shift_one(&mut self) {
        for w in 0..4 {
            self.bits[w] >>= 1;
            if w < 3 {
                self.bits[w] |= (self.bits[w + 1] & 1) << 63;
            }
        }
    }

    pub fn has_gap(&self) -> bool {
        self.bits.iter().any(|w| *w != 0)
    }

    pub fn entry(&self, path: u8) -> AckEntry {
        let mut sack = [0u8; 32];
        for (w, word) in self.bits.iter().enumerate() {
            sack[w * 8..w * 8 + 8].copy_from_slice(&word.to_le_bytes());
        }
        AckEntry { path, epoch: self.epoch, cum: self.cum, ce: self.ce, rcvd: self.rcvd, sack }
    }
}

/// The PSNs an ACK entry says were received, above its cumulative point.
/// Whether `entry`'s bitmap shows `psn` received (false at or below the
/// cumulative point and beyond the bitmap).
pub fn sack_bit(entry: &AckEntry, psn: u32) -> bool {
    let d = psn.wrapping_sub(entry.cum);
    if d == 0 || d > SACK_BITS {
        return false;
    }
    let i = d - 1;
    entry.sack[(i / 8) as usize] >> (i % 8) & 1 == 1
}

pub fn sacked(entry: &AckEntry) -> impl Iterator<Item = u32> + '_ {
    (0..SACK_BITS).filter_map(move |i| {
        let byte = entry.sack[(i / 8) as usize];
        (byte >> (i % 8) & 1 == 1).then(|| entry.cum.wrapping_add(1 + i))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_advances_cum() {
        let mut w = RecvWindow::new(0);
        for psn in 0..10 {
            assert_eq!(w.on_packet(psn, false), Arrival::New { new_hole: false });
        }
        assert_eq!(w.cum, 10);
        assert_eq!(w.on_packet(3, false), Arrival::Duplicate);
    }

    #[test]
    fn gap_is_reported_and_filled() {
        let mut w = RecvWindow::new(0);
        w.on_packet(0, false);
        assert_eq!(w.on_packet(2, false), Arrival::New { new_hole: true });
        // Above the same hole: not news to the sender.
        assert_eq!(w.on_packet(3, true), Arrival::New { new_hole: false });
        let e = w.entry(1);
        assert_eq!(e.cum, 1);
        assert_eq!(sacked(&e).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(w.on_packet(2, false), Arrival::Duplicate);
        assert_eq!(w.on_packet(1, false), Arrival::New { new_hole: false });
        assert_eq!(w.cum, 4);
        assert_eq!(w.ce, 1);
        assert_eq!(sacked(&w.entry(1)).count(), 0);
    }

    #[test]
    fn a_second_hole_above_the_first_is_news() {
        let mut w = RecvWindow::new(0);
        w.on_packet(0, false);
        assert_eq!(w.on_packet(2, false), Arrival::New { new_hole: true });
        assert_eq!(w.on_packet(3, false), Arrival::New { new_hole: false });
        assert_eq!(w.on_packet(5, false), Arrival::New { new_hole: true });
        // Filling below the top (a late original or a floor) is not a hole.
        assert_eq!(w.on_packet(4, false), Arrival::New { new_hole: false });
        w.advance_floor(10);
        assert_eq!(w.on_packet(11, false), Arrival::New { new_hole: true });
    }

    #[test]
    fn floor_skips_given_up_psns() {
        let mut w = RecvWindow::new(0);
        w.on_packet(0, false);
        w.on_packet(3, false);
        w.on_packet(5, false);
        // 1 and 2 were given up: cum moves past 3 (received) to 4.
        w.advance_floor(3);
        assert_eq!(w.cum, 4);
        assert_eq!(sacked(&w.entry(0)).collect::<Vec<_>>(), vec![5]);
        w.advance_floor(2); // older floor: no effect
        assert_eq!(w.cum, 4);
        w.advance_floor(1000);
        assert_eq!((w.cum, w.has_gap()), (1000, false));
    }

    #[test]
    fn window_edges_and_wrap() {
        let mut w = RecvWindow::new(0);
        w.cum = u32::MAX - 1;
        assert_eq!(w.on_packet((u32::MAX - 1).wrapping_add(257), false), Arrival::BeyondWindow);
        assert_eq!(w.on_packet((u32::MAX - 1).wrapping_add(256), false), Arrival::New { new_hole: true });
        assert_eq!(sacked(&w.entry(0)).collect::<Vec<_>>(), vec![(u32::MAX - 1).wrapping_add(256)]);
        assert_eq!(w.on_packet(u32::MAX - 1, false), Arrival::New { new_hole: false });
        assert_eq!(w.cum, u32::MAX);
    }
}
