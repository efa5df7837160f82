//! Per-endpoint counters: everything a drop, a retransmit or a timer did.

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub pkts_sent: u64,
    pub pkts_rcvd: u64,
    /// Payload bytes.
    pub bytes_sent: u64,
    pub bytes_rcvd: u64,
    pub msgs_sent: u64,
    pub msgs_rcvd: u64,
    pub acks_sent: u64,
    pub acks_rcvd: u64,
    pub retransmits: u64,
    /// Duplicates this receiver saw: the peer's spurious retransmits.
    pub dup_rcvd: u64,
    /// Packets the peers' SACKs showed lost.
    pub sack_holes: u64,
    /// Gaps this receiver saw in a path's sequence.
    pub gaps_seen: u64,
    pub ce_rcvd: u64,
    /// CE marks the peers echoed back to this sender.
    pub ce_echoed: u64,
    pub rtos: u64,
    /// Timeouts an ACK later showed premature (the window cut is undone).
    pub spurious_rtos: u64,
    pub tlps: u64,
    pub path_failures: u64,
    pub path_readmissions: u64,
    pub path_rotations: u64,
    pub rnr_waits: u64,
    pub drops_crc: u64,
    pub drops_malformed: u64,
    pub drops_version: u64,
    pub drops_unknown_conn: u64,
    pub drops_stale: u64,
    pub drops_no_credit: u64,
    pub drops_conn_limit: u64,
    pub handshakes_challenged: u64,
    pub conns_opened: u64,
    pub conns_failed: u64,
    pub conns_reaped: u64,
    pub resets_sent: u64,
}
