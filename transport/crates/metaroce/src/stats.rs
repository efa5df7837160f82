//! The stats file: with `stats_dir=DIR`, an endpoint publishes its counters and
//! per-path figures as one JSON file, `ep-<pid>-<port>.json`, every second and at
//! close. The node agent reads these files from a pod's allocation directory and
//! exports them; a job needs no exporter of its own.
//!
//! Each write goes to a hidden temporary name and is renamed over the file, so a
//! reader never sees half a file. The size is bounded (at most `MAX_PEERS` peers'
//! paths are listed; the counters are endpoint totals over every peer).

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use metaroce_core::{Counters, PathStats};

use crate::addr;
use crate::transport::IoCounters;

pub const SCHEMA: &str = "metaroce.io/stats/v1";
/// Peers whose paths a snapshot lists: 32 peers × 16 paths stays under 100 KiB.
pub const MAX_PEERS: usize = 32;
pub const PERIOD_US: u64 = 1_000_000;

/// One snapshot of an endpoint, rendered by `render`.
pub struct Snapshot<'a> {
    pub pid: u32,
    pub local: SocketAddr,
    pub unix_ms: u128,
    pub uptime_us: u64,
    pub closed: bool,
    pub counters: &'a Counters,
    pub io: &'a IoCounters,
    pub peers: &'a [(SocketAddr, Vec<PathStats>)],
}

fn path_json(p: &PathStats) -> String {
    format!(
        "{{\"path\":{},\"failed\":{},\"cwnd\":{},\"srtt_us\":{},\"min_rtt_us\":{},\"recent_rtt_us\":{},\"inflight\":{},\"pkts_sent\":{},\"retransmits\":{},\"losses\":{},\"ce_echoed\":{}}}",
        p.path, p.failed, p.cwnd, p.srtt_us, p.min_rtt_us, p.recent_rtt_us, p.inflight, p.pkts_sent, p.retransmits, p.losses, p.ce_echoed
    )
}

/// The file's JSON (one line). Addresses are formatted by `addr::format`, whose
/// output has no characters JSON would need to escape.
pub fn render(s: &Snapshot<'_>) -> String {
    let counters: Vec<String> = s.counters.fields().iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    let io = s.io;
    let peers: Vec<String> = s
        .peers
        .iter()
        .take(MAX_PEERS)
        .map(|(a, paths)| {
            let paths: Vec<String> = paths.iter().map(path_json).collect();
            format!("{{\"addr\":\"{}\",\"paths\":[{}]}}", addr::format(a), paths.join(","))
        })
        .collect();
    format!(
        "{{\"schema\":\"{SCHEMA}\",\"pid\":{},\"local\":\"{}\",\"unix_ms\":{},\"uptime_us\":{},\"closed\":{},\"counters\":{{{}}},\"io\":{{\"tx_dropped_local\":{},\"tx_errors\":{},\"rx_errors\":{},\"wakeups\":{},\"rcvbuf\":{},\"sndbuf\":{},\"conns_active\":{}}},\"peers\":[{}]}}\n",
        s.pid,
        addr::format(&s.local),
        s.unix_ms,
        s.uptime_us,
        s.closed,
        counters.join(","),
        io.tx_dropped_local,
        io.tx_errors,
        io.rx_errors,
        io.wakeups,
        io.rcvbuf,
        io.sndbuf,
        io.conns_active,
        peers.join(",")
    )
}

/// Where one endpoint's snapshots go.
#[derive(Clone, Debug)]
pub struct StatsFile {
    path: PathBuf,
    tmp: PathBuf,
}

impl StatsFile {
    /// Refuses a directory that does not exist or is not one (named in the error).
    pub fn new(dir: &Path, pid: u32, port: u16) -> Result<Self, String> {
        match fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(format!("config stats_dir={}: not a directory", dir.display())),
            Err(e) => return Err(format!("config stats_dir={}: {e} (create it first)", dir.display())),
        }
        let name = format!("ep-{pid}-{port}.json");
        Ok(Self { path: dir.join(&name), tmp: dir.join(format!(".{name}.tmp")) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Write and rename; a symlink planted at the temporary name is not followed.
    pub fn publish(&self, json: &str) -> io::Result<()> {
        let _ = fs::remove_file(&self.tmp);
        let mut f =
            OpenOptions::new().write(true).create_new(true).mode(0o644).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(&self.tmp)?;
        f.write_all(json.as_bytes())?;
        drop(f);
        fs::rename(&self.tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot_json(peers: &[(SocketAddr, Vec<PathStats>)]) -> String {
        let c = Counters { retransmits: 7, drops_crc: 3, ..Default::default() };
        let io = IoCounters { rcvbuf: 1 << 20, ..Default::default() };
        render(&Snapshot {
            pid: 42,
            local: "10.0.0.1:30000".parse().unwrap(),
            unix_ms: 1,
            uptime_us: 2,
            closed: false,
            counters: &c,
            io: &io,
            peers,
        })
    }

    #[test]
    fn every_counter_is_in_the_file_by_name() {
        let j = snapshot_json(&[]);
        for (name, _) in Counters::default().fields() {
            assert!(j.contains(&format!("\"{name}\":")), "{name} missing");
        }
        assert!(j.contains("\"retransmits\":7") && j.contains("\"drops_crc\":3"));
        assert!(j.starts_with(&format!("{{\"schema\":\"{SCHEMA}\"")) && j.ends_with("}\n"));
    }

    #[test]
    fn the_peer_list_is_bounded() {
        let paths = vec![
            PathStats {
                path: 0,
                failed: false,
                cwnd: 1,
                srtt_us: 2,
                rttvar_us: 0,
                min_rtt_us: 1,
                recent_rtt_us: 2,
                inflight: 0,
                pkts_sent: 9,
                retransmits: 0,
                losses: 0,
                ce_echoed: 0
            };
            16
        ];
        let peers: Vec<_> = (0..100u16).map(|i| (SocketAddr::from(([10, 0, 0, 2], 30000 + i)), paths.clone())).collect();
        let j = snapshot_json(&peers);
        assert_eq!(j.matches("\"addr\":").count(), MAX_PEERS);
        assert!(j.len() < 100 << 10, "{} bytes", j.len());
    }

    #[test]
    fn publish_replaces_the_file_whole_and_refuses_a_missing_dir() {
        let dir = std::env::temp_dir().join(format!("mr-stats-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let f = StatsFile::new(&dir, 1, 2).unwrap();
        f.publish("{\"a\":1}\n").unwrap();
        f.publish("{\"b\":2}\n").unwrap();
        assert_eq!(fs::read_to_string(f.path()).unwrap(), "{\"b\":2}\n");
        assert!(!dir.join(".ep-1-2.json.tmp").exists());
        fs::remove_dir_all(&dir).unwrap();
        let e = StatsFile::new(&dir, 1, 2).unwrap_err();
        assert!(e.contains("stats_dir=") && e.contains("create it first"), "{e}");
    }
}
