//! Per-endpoint counters: everything a drop, a retransmit or a timer did.

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub pkts_sent: u64,
    pub pkts_rcvd: u64,
    /// Payload bytes.
    pub bytes_sent: u64,
    pub bytes_rcvd: u64,
    /// Payload bytes the peers acknowledged for the first time: the sender's goodput.
    pub bytes_acked: u64,
    pub msgs_sent: u64,
    pub msgs_rcvd: u64,
    pub acks_sent: u64,
    pub acks_rcvd: u64,
    /// Data copies sent again: loss resends and tail-loss probes (`tlps` counts the latter).
    pub retransmits: u64,
    /// Duplicates this receiver saw: the peer's spurious retransmits.
    pub dup_rcvd: u64,
    /// Packets the peers' SACKs showed lost.
    pub sack_holes: u64,
    /// Gaps this receiver saw in a path's sequence.
    pub gaps_seen: u64,
    pub ce_rcvd: u64,
    /// Packets declared lost because a later one was acknowledged on another path
    /// while they were overdue on theirs (tail losses no SACK gap shows).
    pub late_losses: u64,
    /// ACKs that showed a late declaration premature (the path then waits longer).
    pub spurious_late_losses: u64,
    /// Packets a timeout held on a silent path, resent once a packet sent after the
    /// timeout was acknowledged on another path (see `Path::on_timeout`).
    pub held_released: u64,
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

impl Counters {
    /// Every counter by name, in declaration order: what exporters and the stats
    /// file print, so a new counter shows up there without another edit.
    pub fn fields(&self) -> [(&'static str, u64); 37] {
        [
            ("pkts_sent", self.pkts_sent),
            ("pkts_rcvd", self.pkts_rcvd),
            ("bytes_sent", self.bytes_sent),
            ("bytes_rcvd", self.bytes_rcvd),
            ("bytes_acked", self.bytes_acked),
            ("msgs_sent", self.msgs_sent),
            ("msgs_rcvd", self.msgs_rcvd),
            ("acks_sent", self.acks_sent),
            ("acks_rcvd", self.acks_rcvd),
            ("retransmits", self.retransmits),
            ("dup_rcvd", self.dup_rcvd),
            ("sack_holes", self.sack_holes),
            ("gaps_seen", self.gaps_seen),
            ("late_losses", self.late_losses),
            ("spurious_late_losses", self.spurious_late_losses),
            ("held_released", self.held_released),
            ("ce_rcvd", self.ce_rcvd),
            ("ce_echoed", self.ce_echoed),
            ("rtos", self.rtos),
            ("spurious_rtos", self.spurious_rtos),
            ("tlps", self.tlps),
            ("path_failures", self.path_failures),
            ("path_readmissions", self.path_readmissions),
            ("path_rotations", self.path_rotations),
            ("rnr_waits", self.rnr_waits),
            ("drops_crc", self.drops_crc),
            ("drops_malformed", self.drops_malformed),
            ("drops_version", self.drops_version),
            ("drops_unknown_conn", self.drops_unknown_conn),
            ("drops_stale", self.drops_stale),
            ("drops_no_credit", self.drops_no_credit),
            ("drops_conn_limit", self.drops_conn_limit),
            ("handshakes_challenged", self.handshakes_challenged),
            ("conns_opened", self.conns_opened),
            ("conns_failed", self.conns_failed),
            ("conns_reaped", self.conns_reaped),
            ("resets_sent", self.resets_sent),
        ]
    }
}
