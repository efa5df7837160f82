//! Goodput binned by when its packets reached the host: the unique payload bytes
//! each datagram placed, added to the bin of the kernel's receive timestamp
//! (`SO_TIMESTAMPNS`). Bins by when the endpoint processed a datagram (or when an
//! application read a counter) move bytes from one bin to the next whenever the
//! receiving thread waits for a core: on a busy 2-core host a 10 ms bin then dips
//! by a third while its neighbour rises as much, though the link never slowed.
//! Only metaroce-perf asks for these (a diagnostic: timestamps cost a cmsg per
//! datagram).

/// The most bins kept (100 s of 10 ms bins); bytes after the last are counted
/// in `late`.
pub const MAX_BINS: usize = 10_000;

#[derive(Debug, Clone)]
pub struct ArrivalBins {
    /// CLOCK_REALTIME, the clock of `SO_TIMESTAMPNS`, at bin 0's start.
    start_ns: u64,
    bin_ns: u64,
    bins: Vec<u64>,
    /// Bytes that arrived before the start (queued in the socket when binning began).
    pub early: u64,
    /// Bytes past `MAX_BINS`.
    pub late: u64,
}

impl ArrivalBins {
    pub fn new(start_ns: u64, bin_ms: u64) -> Self {
        Self { start_ns, bin_ns: bin_ms.max(1) * 1_000_000, bins: Vec::new(), early: 0, late: 0 }
    }

    /// `bytes` placed by a datagram the kernel received at `at_ns`.
    pub fn add(&mut self, at_ns: u64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let Some(since) = at_ns.checked_sub(self.start_ns) else {
            self.early += bytes;
            return;
        };
        let i = (since / self.bin_ns) as usize;
        if i >= MAX_BINS {
            self.late += bytes;
            return;
        }
        if self.bins.len() <= i {
            self.bins.resize(i + 1, 0);
        }
        self.bins[i] += bytes;
    }

    pub fn bins(&self) -> &[u64] {
        &self.bins
    }
}

/// CLOCK_REALTIME now, in nanoseconds since the epoch.
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_go_to_the_bin_of_their_arrival() {
        let mut b = ArrivalBins::new(1_000_000_000, 10);
        b.add(1_000_000_000, 100); // the first nanosecond of bin 0
        b.add(1_009_999_999, 50); // its last
        b.add(1_010_000_000, 7); // bin 1
        b.add(1_035_000_000, 3); // bin 3; bin 2 stays empty
        assert_eq!(b.bins(), &[150, 7, 0, 3]);
    }

    #[test]
    fn arrivals_before_the_start_and_past_the_last_bin_are_counted_apart() {
        let mut b = ArrivalBins::new(1_000_000_000, 10);
        b.add(999_999_999, 11);
        b.add(1_000_000_000 + MAX_BINS as u64 * 10_000_000, 13);
        b.add(1_000_000_000, 0); // a datagram that placed nothing (an ACK, a duplicate)
        assert!(b.bins().is_empty());
        assert_eq!((b.early, b.late), (11, 13));
    }
}
