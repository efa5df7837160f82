//! The endpoint's configuration: `key=value,key=value`, from MR_CONFIG and then
//! the caller's string. Every bad key or value is refused with a message that
//! names it, the value, and what is allowed.

use std::net::IpAddr;

use metaroce_core::time::MS;
use metaroce_core::Config;

#[derive(Clone, Debug)]
pub struct EpConfig {
    pub addr: Option<IpAddr>,
    pub ports: Option<(u16, u16)>,
    pub progress_thread: bool,
    pub dscp: u8,
    pub sock_buf: usize,
    /// Where the stats file goes (`stats`), if anywhere.
    pub stats_dir: Option<std::path::PathBuf>,
    /// `stats_dir` came from MR_STATS_DIR, not from the configuration: a missing
    /// directory there means no stats, not a failed endpoint.
    pub stats_dir_optional: bool,
    pub core: Config,
}

impl Default for EpConfig {
    fn default() -> Self {
        Self {
            addr: None,
            ports: None,
            progress_thread: true,
            dscp: 0,
            sock_buf: 8 << 20,
            stats_dir: None,
            stats_dir_optional: false,
            core: Config::default(),
        }
    }
}

pub const KEYS: &str =
    "addr, ports, paths, mtu, dscp, abort_timeout_ms, progress, rate_mbps, max_conns, eager_max, credit_window, sock_buf, min_rto_us, queue_target_us, stats_dir";

fn num<T: std::str::FromStr>(key: &str, v: &str, allowed: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("config {key}={v:?}: not a number ({allowed})"))
}

impl EpConfig {
    /// Parse MR_CONFIG (if set) and then `s`; later keys win. Without `stats_dir`
    /// there, MR_STATS_DIR (the per-allocation directory the node agent's device
    /// plugin mounts into a pod) is used when it is an absolute path: a pod spec's
    /// own MR_CONFIG replaces the device plugin's, which named it.
    pub fn from_env_and(s: Option<&str>) -> Result<Self, String> {
        let stats_env = std::env::var_os("MR_STATS_DIR");
        Self::parse(std::env::var("MR_CONFIG").ok().as_deref(), s, stats_env.as_deref().map(std::path::Path::new))
    }

    fn parse(env: Option<&str>, s: Option<&str>, stats_env: Option<&std::path::Path>) -> Result<Self, String> {
        let mut c = EpConfig::default();
        if let Some(env) = env {
            c.apply(env).map_err(|e| format!("MR_CONFIG: {e}"))?;
        }
        if let Some(s) = s {
            c.apply(s)?;
        }
        if c.stats_dir.is_none() {
            if let Some(dir) = stats_env.filter(|d| d.is_absolute()) {
                c.stats_dir = Some(dir.to_path_buf());
                c.stats_dir_optional = true;
            }
        }
        c.core.validate().map_err(|e| format!("config {e}"))?;
        Ok(c)
    }

    pub fn apply(&mut self, s: &str) -> Result<(), String> {
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| format!("config {item:?}: expected key=value (keys: {KEYS})"))?;
            let (k, v) = (k.trim(), v.trim());
            match k {
                "addr" => {
                    let ip: IpAddr = v.parse().map_err(|_| format!("config addr={v:?}: not an IPv4 or IPv6 address"))?;
                    if ip.is_unspecified() {
                        return Err(format!(
                            "config addr={v}: a wildcard address cannot be a peer's destination; give the data interface's address"
                        ));
                    }
                    self.addr = Some(ip);
                }
                "ports" => {
                    let (lo, hi) = v.split_once('-').ok_or_else(|| format!("config ports={v:?}: expected LO-HI, e.g. 20000-20999"))?;
                    let lo: u16 = num(k, lo, "LO-HI, 1..65535")?;
                    let hi: u16 = num(k, hi, "LO-HI, 1..65535")?;
                    if lo == 0 || lo > hi {
                        return Err(format!("config ports={v}: need 1 <= LO <= HI"));
                    }
                    self.ports = Some((lo, hi));
                }
                "paths" => self.core.paths = num(k, v, "1..16")?,
                "mtu" => self.core.mtu = num(k, v, "576..9216")?,
                "dscp" => {
                    self.dscp = num(k, v, "0..63")?;
                    if self.dscp > 63 {
                        return Err(format!("config dscp={v}: must be 0..63"));
                    }
                }
                "abort_timeout_ms" => self.core.abort_timeout = num::<u64>(k, v, "milliseconds")? * MS,
                "min_rto_us" => self.core.min_rto = num(k, v, "microseconds")?,
                "queue_target_us" => self.core.queue_target = num(k, v, "microseconds")?,
                "rate_mbps" => self.core.rate_mbps = num(k, v, "Mbit/s, 0 = no hint")?,
                "max_conns" => self.core.max_conns = num(k, v, "connections")?,
                "eager_max" => self.core.eager_max = num(k, v, "bytes")?,
                "credit_window" => self.core.credit_window = num(k, v, "bytes")?,
                "sock_buf" => self.sock_buf = num(k, v, "bytes")?,
                "stats_dir" => {
                    if !v.starts_with('/') {
                        return Err(format!("config stats_dir={v:?}: must be an absolute directory path"));
                    }
                    self.stats_dir = Some(v.into());
                }
                "progress" => {
                    self.progress_thread = match v {
                        "thread" => true,
                        "manual" => false,
                        _ => return Err(format!("config progress={v}: must be thread or manual")),
                    }
                }
                _ => return Err(format!("config key {k:?} unknown (keys: {KEYS})")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_key_and_the_value() {
        let mut c = EpConfig::default();
        assert!(c.apply("paths=4,mtu=9000,ports=20000-20010,dscp=26").is_ok());
        assert_eq!((c.core.paths, c.core.mtu, c.ports, c.dscp), (4, 9000, Some((20000, 20010)), 26));
        let e = c.apply("pathz=4").unwrap_err();
        assert!(e.contains("pathz") && e.contains("keys:"), "{e}");
        let e = c.apply("mtu=big").unwrap_err();
        assert!(e.contains("mtu=\"big\""), "{e}");
        assert!(c.apply("addr=0.0.0.0").unwrap_err().contains("wildcard"));
        assert!(c.apply("ports=9-3").is_err());
        assert!(c.apply("dscp=64").is_err());
        assert!(c.apply("stats_dir=run/x").unwrap_err().contains("absolute"));
        assert!(c.apply("stats_dir=/run/x").is_ok() && c.stats_dir.as_deref() == Some("/run/x".as_ref()));
        c.core.paths = 40;
        assert!(c.core.validate().unwrap_err().contains("paths=40"));
    }

    #[test]
    fn mr_stats_dir_is_the_fallback_for_stats_dir() {
        let p = |env: Option<&str>, dir: &str| EpConfig::parse(env, None, Some(std::path::Path::new(dir))).unwrap();
        let c = p(Some("paths=4"), "/run/metaroce-stats");
        assert_eq!(c.stats_dir.as_deref(), Some("/run/metaroce-stats".as_ref()));
        assert!(c.stats_dir_optional);
        // The configuration's own stats_dir wins, and stays required.
        let c = p(Some("stats_dir=/tmp/s"), "/run/metaroce-stats");
        assert_eq!(c.stats_dir.as_deref(), Some("/tmp/s".as_ref()));
        assert!(!c.stats_dir_optional);
        // A relative MR_STATS_DIR is ignored.
        assert_eq!(p(None, "run/x").stats_dir, None);
    }
}
