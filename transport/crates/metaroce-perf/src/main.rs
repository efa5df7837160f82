//! metaroce-perf: bandwidth and latency between two hosts over the MetaRoCE
//! transport, printed like perftest's ib_write_bw (or as JSON).
//!
//!   metaroce-perf server [--config K=V,...] [--once | --sessions N] [--busy-poll]
//!                        (clients served at once)
//!   metaroce-perf client SERVER [--mode bw|lat] [--size BYTES] [--duration SECONDS]
//!                        [--iters N] [--window N] [--config K=V,...] [--json]
//!                        [--bins-ms MS]   (bw: goodput per MS-long bin, in the JSON:
//!                                         by message completion, by bytes first
//!                                         acknowledged, by bytes the server's
//!                                         endpoint placed, and those placed bytes
//!                                         by their datagrams' kernel arrival time)
//!                        [--busy-poll]   (spin on the endpoint, as ib_write_bw polls
//!                                         its CQ and MPI ranks spin: the tool's own
//!                                         thread progresses it; default: block)
//!
//! SERVER is the address the server prints (udp://IP:PORT or IP:PORT).

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use metaroce::{addr, Completion, OpKind, RecvBuf, SendBuf, Transport, ANY_PEER};

const TAG_HELLO: u64 = 0xC0DE_0001;
const TAG_READY: u64 = 0xC0DE_0002;
const TAG_END: u64 = 0xC0DE_0003;
const TAG_STATS: u64 = 0xC0DE_0004;
const TAG_DATA: u64 = 0xDA7A;
const TAG_PONG: u64 = 0xB0B0;
const CTRL_LEN: usize = 512;
/// The server's STATS reply carries its receive bins: room for 60 s of 10 ms bins.
const STATS_LEN: usize = 64 << 10;

#[derive(Debug)]
struct Args {
    role: String,
    server: Option<String>,
    mode: String,
    size: usize,
    duration: f64,
    iters: usize,
    window: usize,
    config: Option<String>,
    json: bool,
    /// Server: exit after this many sessions ended (0: serve forever).
    sessions: u64,
    bins_ms: u64,
    /// Spin on `progress` and `poll` instead of blocking in `wait`.
    busy_poll: bool,
}

fn usage() -> String {
    "usage: metaroce-perf server [--config K=V,...] [--once | --sessions N] [--busy-poll]\n       metaroce-perf client SERVER [--mode bw|lat] [--size BYTES] [--duration SECONDS] [--iters N] [--window N] [--config K=V,...] [--json] [--bins-ms MS] [--busy-poll]".into()
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let role = it.next().ok_or_else(usage)?;
    if role != "server" && role != "client" {
        return Err(format!("unknown role {role:?}: server or client\n{}", usage()));
    }
    let mut a = Args {
        role,
        server: None,
        mode: "bw".into(),
        size: 1 << 20,
        duration: 5.0,
        iters: 1000,
        window: 16,
        config: None,
        json: false,
        sessions: 0,
        bins_ms: 0,
        busy_poll: false,
    };
    while let Some(k) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match k.as_str() {
            "--mode" => {
                a.mode = val("--mode")?;
                if a.mode != "bw" && a.mode != "lat" {
                    return Err(format!("--mode {}: must be bw or lat", a.mode));
                }
            }
            "--size" => a.size = val("--size")?.parse().map_err(|_| "--size: bytes, e.g. 1048576".to_string())?,
            "--duration" => a.duration = val("--duration")?.parse().map_err(|_| "--duration: seconds, e.g. 5".to_string())?,
            "--iters" => a.iters = val("--iters")?.parse().map_err(|_| "--iters: a count".to_string())?,
            "--window" => {
                a.window = val("--window")?.parse().map_err(|_| "--window: a count".to_string())?;
                if a.window == 0 || a.window > 1024 {
                    return Err("--window: 1..1024 messages in flight".into());
                }
            }
            "--config" => a.config = Some(val("--config")?),
            "--json" => a.json = true,
            "--bins-ms" => {
                a.bins_ms = val("--bins-ms")?.parse().map_err(|_| "--bins-ms: milliseconds, e.g. 10".to_string())?;
                if a.bins_ms == 0 || a.bins_ms > 60_000 {
                    return Err("--bins-ms: 1..60000 milliseconds per bin".into());
                }
            }
            "--once" => a.sessions = 1,
            "--busy-poll" => a.busy_poll = true,
            "--sessions" => {
                a.sessions = val("--sessions")?.parse().map_err(|_| "--sessions: a count of client sessions".to_string())?;
                if a.sessions == 0 {
                    return Err("--sessions: at least 1 (leave it out to serve forever)".into());
                }
            }
            s if !s.starts_with('-') && a.role == "client" && a.server.is_none() => a.server = Some(s.to_string()),
            s => return Err(format!("unknown argument {s:?}\n{}", usage())),
        }
    }
    if a.size > 1 << 30 {
        return Err(format!("--size {}: at most 1 GiB", a.size));
    }
    if a.role == "client" && a.server.is_none() {
        return Err(format!("client needs the SERVER address\n{}", usage()));
    }
    Ok(a)
}

/// Until a completion may be pending: spinning on `progress` (`busy`), else
/// blocking in `wait` for at most `block`.
fn await_completions(t: &Transport, busy: bool, block: Duration) -> Result<(), metaroce::Error> {
    if busy {
        t.progress().map(|_| ())
    } else {
        t.wait(Some(block)).map(|_| ())
    }
}

/// A callback run at least every `SAMPLE_EVERY` while waiting (see `CounterBins`).
type Tick<'a> = Option<&'a mut dyn FnMut() -> Result<(), String>>;

fn wait_one(
    t: &Transport,
    busy: bool,
    pending: &mut Vec<Completion>,
    pred: impl Fn(&Completion) -> bool,
    timeout: Duration,
    mut tick: Tick<'_>,
) -> Result<Completion, String> {
    let deadline = Instant::now() + timeout;
    let block = if tick.is_some() { SAMPLE_EVERY } else { Duration::from_millis(20) };
    loop {
        if let Some(i) = pending.iter().position(&pred) {
            return Ok(pending.remove(i));
        }
        if Instant::now() > deadline {
            return Err(format!("timed out after {timeout:?} (counters: {:?})", t.counters().map(|c| c.0)));
        }
        await_completions(t, busy, block).map_err(|e| format!("{e:?}"))?;
        pending.extend(t.poll(256).map_err(|e| format!("{e:?}"))?);
        if let Some(f) = tick.as_mut() {
            f()?;
        }
    }
}

/// How often a bw client reads the acknowledged-bytes counter for its bins (and the
/// server the placed-bytes one).
const SAMPLE_EVERY: Duration = Duration::from_micros(250);

/// A growing endpoint counter (the client's payload bytes first acknowledged, the
/// server's unique payload bytes placed), binned by when it grew: read every
/// `SAMPLE_EVERY` or so, each reading's increase spread evenly over the time since
/// the one before. Read only at message completions (every ~3 ms for 256 KiB
/// messages here), a 10 ms bin got three or four readings' worth and swung by a
/// third of a reading.
struct CounterBins {
    bin_us: u64,
    last_us: u64,
    last_bytes: u64,
    bins: Vec<f64>,
}

impl CounterBins {
    fn new(bin_ms: u64, bytes0: u64) -> Self {
        CounterBins { bin_us: bin_ms * 1000, last_us: 0, last_bytes: bytes0, bins: Vec::new() }
    }

    fn due(&self, at_us: u64) -> bool {
        at_us >= self.last_us + SAMPLE_EVERY.as_micros() as u64
    }

    /// The counter read `bytes` at `at_us` after the start.
    fn add(&mut self, at_us: u64, bytes: u64) {
        let delta = bytes.saturating_sub(self.last_bytes) as f64;
        let (t0, t1) = (self.last_us, at_us.max(self.last_us));
        let mut put = |i: usize, b: f64| {
            if self.bins.len() <= i {
                self.bins.resize(i + 1, 0.0);
            }
            self.bins[i] += b;
        };
        if t1 == t0 {
            put((t1 / self.bin_us) as usize, delta);
        } else {
            let mut t = t0;
            while t < t1 {
                let i = t / self.bin_us;
                let end = ((i + 1) * self.bin_us).min(t1);
                put(i as usize, delta * (end - t) as f64 / (t1 - t0) as f64);
                t = end;
            }
        }
        self.last_us = t1;
        self.last_bytes = bytes;
    }

    fn bytes(&self) -> Vec<u64> {
        self.bins.iter().map(|b| b.round() as u64).collect()
    }
}

fn ctrl(t: &Transport, peer: u64, tag: u64, text: &str) -> Result<(), String> {
    t.send(peer, SendBuf::owned(text.as_bytes().to_vec()), tag, true, None, 0, false).map_err(|e| format!("send: {e:?}"))
}

fn text(c: Completion) -> String {
    let n = c.len as usize;
    String::from_utf8_lossy(&c.buf.and_then(|b| b.into_vec()).unwrap_or_default()[..n]).into_owned()
}

fn kv(s: &str) -> HashMap<String, String> {
    s.split_whitespace().filter_map(|p| p.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// One client's test on the server: its receives in flight and what it moved.
struct Session {
    id: u64,
    size: usize,
    lat: bool,
    posted: u64,
    bytes: u64,
    last_seen: Instant,
    c0: metaroce::Counters,
    /// `bytes_rcvd` binned from the READY on (the client starts its clock when the
    /// READY arrives), when the client asked for bins.
    rcvd_bins: Option<(Instant, CounterBins)>,
    /// Whether the endpoint's arrival-time bins started with this session. They are
    /// the endpoint's, so a session that began while another was binning gets none.
    arrival_bins: bool,
}

/// Receive contexts: the session in the high half, a running count in the low.
fn ctx(session: u64, n: u64) -> u64 {
    (session << 32) | (n & 0xffff_ffff)
}
const CTX_HELLO: u64 = 1;
const CTX_END: u64 = 2;
const CTX_DATA0: u64 = 100;
/// A session whose client sent nothing for this long is dropped (the client died).
const SESSION_IDLE: Duration = Duration::from_secs(60);

/// Serves clients concurrently (each HELLO opens a session for its peer), so several
/// clients can send into one server at once (incast). With --once (--sessions 1) or
/// --sessions N it exits after N sessions have ended. The STATS reply's dup/ce/gaps
/// figures are the endpoint's over the session: shared when sessions overlap.
fn server(a: &Args) -> Result<(), String> {
    let t = Transport::open(a.config.as_deref())?;
    println!("metaroce-perf server listening on {}", addr::format(&t.local_addr()));
    let e = |e: metaroce::Error| format!("{e:?}");
    let mut sessions: HashMap<u64, Session> = HashMap::new();
    let mut next_id = 1u64;
    let mut ended = 0u64;
    t.recv(ANY_PEER, RecvBuf::owned(CTRL_LEN), TAG_HELLO, 0, true, CTX_HELLO, true).map_err(e)?;
    loop {
        // Spin only while a client is being served: an idle server blocks.
        let binning = sessions.values().any(|s| s.rcvd_bins.is_some());
        let block = if binning { SAMPLE_EVERY } else { Duration::from_millis(100) };
        await_completions(&t, a.busy_poll && !sessions.is_empty(), block).map_err(e)?;
        if binning {
            sample_rcvd(&t, sessions.values_mut(), false).map_err(e)?;
        }
        for c in t.poll(256).map_err(e)? {
            if c.kind != OpKind::Recv {
                continue;
            }
            let peer = c.peer;
            if c.tag == TAG_HELLO {
                t.recv(ANY_PEER, RecvBuf::owned(CTRL_LEN), TAG_HELLO, 0, true, CTX_HELLO, true).map_err(e)?;
                let p = kv(&text(c));
                let size: usize = p.get("size").and_then(|s| s.parse().ok()).unwrap_or(0);
                if size > 1 << 30 || sessions.contains_key(&peer) {
                    eprintln!("metaroce-perf server: HELLO from {peer} refused (size {size}, at most 1 GiB; one session per peer)");
                    continue;
                }
                let window: u64 = p.get("window").and_then(|s| s.parse().ok()).unwrap_or(16).clamp(1, 1024);
                let lat = p.get("mode").is_some_and(|m| m == "lat");
                let bins_ms: u64 = p.get("bins").and_then(|s| s.parse().ok()).unwrap_or(0).min(60_000);
                let (c0, _) = t.counters().map_err(e)?;
                let arrival_bins = bins_ms > 0 && !sessions.values().any(|s| s.rcvd_bins.is_some());
                if arrival_bins {
                    t.start_arrival_bins(bins_ms).map_err(e)?;
                }
                let rcvd_bins = (bins_ms > 0).then(|| (Instant::now(), CounterBins::new(bins_ms, c0.bytes_rcvd)));
                let mut s = Session { id: next_id, size, lat, posted: 0, bytes: 0, last_seen: Instant::now(), c0, rcvd_bins, arrival_bins };
                next_id += 1;
                for _ in 0..if lat { 1 } else { window } {
                    t.recv(peer, RecvBuf::owned(size), TAG_DATA, 0, true, ctx(s.id, CTX_DATA0 + s.posted), true).map_err(e)?;
                    s.posted += 1;
                }
                t.recv(peer, RecvBuf::owned(CTRL_LEN), TAG_END, 0, true, ctx(s.id, CTX_END), true).map_err(e)?;
                ctrl(&t, peer, TAG_READY, "ready")?;
                sessions.insert(peer, s);
                continue;
            }
            let Some(s) = sessions.get_mut(&peer) else { continue };
            if c.context >> 32 != s.id {
                continue; // a canceled receive of an earlier session of this peer
            }
            s.last_seen = Instant::now();
            if c.tag == TAG_END {
                let mut s = sessions.remove(&peer).expect("present");
                sample_rcvd(&t, [&mut s], true).map_err(e)?;
                end_session(&t, peer, &s)?;
                ended += 1;
                continue;
            }
            if let Some(err) = c.err {
                eprintln!("metaroce-perf server: a receive from {peer} failed ({err:?}): session dropped");
                let s = sessions.remove(&peer).expect("present");
                cancel_session(&t, &s);
                continue;
            }
            s.bytes += c.len;
            if s.lat {
                t.send(peer, SendBuf::owned(vec![0x5a; s.size]), TAG_PONG, true, None, 0, false).map_err(e)?;
            }
            let n = ctx(s.id, CTX_DATA0 + s.posted);
            s.posted += 1;
            t.recv(peer, RecvBuf::owned(s.size), TAG_DATA, 0, true, n, true).map_err(e)?;
        }
        sessions.retain(|peer, s| {
            let alive = s.last_seen.elapsed() < SESSION_IDLE;
            if !alive {
                eprintln!("metaroce-perf server: client {peer} silent for {SESSION_IDLE:?}: session dropped");
                cancel_session(&t, s);
            }
            alive
        });
        if a.sessions > 0 && ended >= a.sessions && sessions.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
            t.close();
            return Ok(());
        }
    }
}

/// Reads `bytes_rcvd` once for the sessions whose bins are due (all, with `force`).
/// The counter is the endpoint's: overlapping sessions (incast) share it.
fn sample_rcvd<'a>(t: &Transport, sessions: impl IntoIterator<Item = &'a mut Session>, force: bool) -> Result<(), metaroce::Error> {
    let mut bytes = None;
    for s in sessions {
        let Some((start, bins)) = s.rcvd_bins.as_mut() else { continue };
        let at = start.elapsed().as_micros() as u64;
        if force || bins.due(at) {
            let now = match bytes {
                Some(b) => b,
                None => *bytes.insert(t.counters()?.0.bytes_rcvd),
            };
            bins.add(at, now);
        }
    }
    Ok(())
}

/// CLOCK_MONOTONIC in seconds, the clock `Instant` reads: a harness that times an
/// impairment with the same clock (Python's `time.monotonic`) places it in the bins.
fn monotonic_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn cancel_session(t: &Transport, s: &Session) {
    for i in 0..s.posted {
        let _ = t.cancel(ctx(s.id, CTX_DATA0 + i));
    }
    let _ = t.cancel(ctx(s.id, CTX_END));
}

fn end_session(t: &Transport, peer: u64, s: &Session) -> Result<(), String> {
    cancel_session(t, s);
    let (c1, _) = t.counters().map_err(|e| format!("{e:?}"))?;
    let c0 = &s.c0;
    let mut stats = format!(
        "bytes={} dup={} ce={} gaps={} drops={}",
        s.bytes,
        c1.dup_rcvd - c0.dup_rcvd,
        c1.ce_rcvd - c0.ce_rcvd,
        c1.gaps_seen - c0.gaps_seen,
        (c1.drops_crc + c1.drops_malformed + c1.drops_unknown_conn) - (c0.drops_crc + c0.drops_malformed + c0.drops_unknown_conn)
    );
    let mut lists: Vec<(&str, Vec<u64>)> = Vec::new();
    if let Some((_, bins)) = &s.rcvd_bins {
        lists.push(("rcvd_bins", bins.bytes()));
    }
    if s.arrival_bins {
        if let Some(arrived) = t.arrival_bins().map_err(|e| format!("{e:?}"))? {
            lists.push(("arrival_bins", arrived.bins().to_vec()));
        }
    }
    for (name, bins) in lists {
        let list: Vec<String> = bins.iter().map(u64::to_string).collect();
        let field = format!(" {name}={}", list.join(","));
        if stats.len() + field.len() <= STATS_LEN {
            stats += &field;
        } else {
            eprintln!("metaroce-perf server: {} {name} do not fit the STATS reply: left out", list.len());
        }
    }
    ctrl(t, peer, TAG_STATS, &stats)
}

/// `size` bytes completed (or were acknowledged) now: add them to their bin.
fn count_bin(bins: &mut Vec<u64>, bin_ms: u64, start: Instant, size: usize) {
    if bin_ms == 0 {
        return;
    }
    let i = (start.elapsed().as_millis() as u64 / bin_ms) as usize;
    if bins.len() <= i {
        bins.resize(i + 1, 0);
    }
    bins[i] += size as u64;
}

/// Bins of bytes as Mbit/s, comma-separated.
fn mbps_of(bins: &[u64], bin_ms: u64) -> String {
    bins.iter().map(|b| format!("{:.1}", *b as f64 * 8.0 / (bin_ms as f64 * 1000.0))).collect::<Vec<_>>().join(",")
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn client(a: &Args) -> Result<bool, String> {
    let server = addr::parse(a.server.as_deref().unwrap()).ok_or_else(|| format!("SERVER {:?}: expected udp://IP:PORT", a.server))?;
    let cfg = match &a.config {
        Some(c) => c.clone(),
        None => String::new(),
    };
    let t = Transport::open(Some(&cfg))?;
    let peer = t.peer(server).map_err(|e| format!("{e:?}"))?;
    let mut pending = Vec::new();
    t.recv(peer, RecvBuf::owned(CTRL_LEN), TAG_READY, 0, true, 1, true).map_err(|e| format!("{e:?}"))?;
    ctrl(&t, peer, TAG_HELLO, &format!("mode={} size={} window={} bins={}", a.mode, a.size, a.window, a.bins_ms))?;
    wait_one(&t, a.busy_poll, &mut pending, |c| c.kind == OpKind::Recv && c.tag == TAG_READY, Duration::from_secs(10), None)
        .map_err(|e| format!("no answer from the server at {server}: {e}"))?;
    let (c0, _) = t.counters().map_err(|e| format!("{e:?}"))?;
    let payload = vec![0xa5u8; a.size];
    let start = Instant::now();
    let start_monotonic = monotonic_seconds();
    let deadline = start + Duration::from_secs_f64(a.duration);
    let mut msgs = 0u64;
    let mut lat_us: Vec<f64> = Vec::new();
    let mut bins: Vec<u64> = Vec::new();
    // The same bins by payload bytes first acknowledged (packet-sized steps): a
    // message-completion bin moves in whole messages and dips while one waits.
    let mut acked = CounterBins::new(a.bins_ms.max(1), c0.bytes_acked);
    let mut sample_acked = |force: bool| -> Result<(), String> {
        let at = start.elapsed().as_micros() as u64;
        if a.bins_ms > 0 && (force || acked.due(at)) {
            let now = t.counters().map_err(|e| format!("{e:?}"))?.0.bytes_acked;
            acked.add(at, now);
        }
        Ok(())
    };
    if a.mode == "bw" {
        let mut inflight = 0usize;
        while Instant::now() < deadline {
            while inflight < a.window {
                t.send(peer, SendBuf::owned(payload.clone()), TAG_DATA, true, None, 10, true).map_err(|e| format!("{e:?}"))?;
                inflight += 1;
            }
            let mut tick = || sample_acked(false);
            let tick: Tick<'_> = if a.bins_ms > 0 { Some(&mut tick) } else { None };
            let c = wait_one(&t, a.busy_poll, &mut pending, |c| c.kind == OpKind::Send && c.context == 10, Duration::from_secs(30), tick)?;
            if let Some(e) = c.err {
                return Err(format!("send failed: {e:?}"));
            }
            inflight -= 1;
            msgs += 1;
            count_bin(&mut bins, a.bins_ms, start, a.size);
        }
        while inflight > 0 {
            let mut tick = || sample_acked(false);
            let tick: Tick<'_> = if a.bins_ms > 0 { Some(&mut tick) } else { None };
            wait_one(&t, a.busy_poll, &mut pending, |c| c.kind == OpKind::Send && c.context == 10, Duration::from_secs(30), tick)?;
            inflight -= 1;
            msgs += 1;
            count_bin(&mut bins, a.bins_ms, start, a.size);
        }
        sample_acked(true)?;
    } else {
        for _ in 0..a.iters {
            if Instant::now() > deadline + Duration::from_secs(60) {
                break;
            }
            t.recv(peer, RecvBuf::owned(a.size), TAG_PONG, 0, true, 20, true).map_err(|e| format!("{e:?}"))?;
            let t0 = Instant::now();
            t.send(peer, SendBuf::owned(payload.clone()), TAG_DATA, true, None, 0, false).map_err(|e| format!("{e:?}"))?;
            wait_one(&t, a.busy_poll, &mut pending, |c| c.kind == OpKind::Recv && c.tag == TAG_PONG, Duration::from_secs(30), None)?;
            lat_us.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
            msgs += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let paths = t.path_stats(peer).map_err(|e| format!("{e:?}"))?;
    t.recv(peer, RecvBuf::owned(STATS_LEN), TAG_STATS, 0, true, 3, true).map_err(|e| format!("{e:?}"))?;
    ctrl(&t, peer, TAG_END, "end")?;
    let stats = kv(&text(wait_one(
        &t,
        a.busy_poll,
        &mut pending,
        |c| c.kind == OpKind::Recv && c.tag == TAG_STATS,
        Duration::from_secs(10),
        None,
    )?));
    // Counted up to the server's stats, as the server counts its duplicates up to our
    // END: a resend after the last completion is still a resend (else "spurious"
    // could exceed the retransmits).
    let (c1, io) = t.counters().map_err(|e| format!("{e:?}"))?;
    let bytes = msgs * a.size as u64;
    let gbps = bytes as f64 * 8.0 / secs / 1e9;
    let sent = c1.pkts_sent - c0.pkts_sent;
    let retx = c1.retransmits - c0.retransmits;
    let spurious: u64 = stats.get("dup").and_then(|s| s.parse().ok()).unwrap_or(0);
    let ce: u64 = stats.get("ce").and_then(|s| s.parse().ok()).unwrap_or(0);
    // The server's bins of placed bytes: empty from an older server or without --bins-ms.
    let list = |k: &str| -> Vec<u64> { stats.get(k).map(|l| l.split(',').filter_map(|b| b.parse().ok()).collect()).unwrap_or_default() };
    let delivered = list("rcvd_bins");
    // The same bytes by when their datagrams reached the server's host.
    let arrived = list("arrival_bins");
    lat_us.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if a.json {
        let path_json: Vec<String> = paths
            .iter()
            .map(|(port, p)| {
                format!(
                    "{{\"src_port\":{port},\"srtt_us\":{},\"min_rtt_us\":{},\"recent_rtt_us\":{},\"cwnd\":{},\"pkts_sent\":{},\"retransmits\":{},\"failed\":{}}}",
                    p.srtt_us, p.min_rtt_us, p.recent_rtt_us, p.cwnd, p.pkts_sent, p.retransmits, p.failed
                )
            })
            .collect();
        println!(
            "{{\"mode\":\"{}\",\"size\":{},\"messages\":{msgs},\"bytes\":{bytes},\"seconds\":{secs:.6},\"goodput_gbps\":{gbps:.6},\"goodput_mbit\":{:.3},\"packets_sent\":{sent},\"retransmits\":{retx},\"spurious_retransmits\":{spurious},\"ce_marks\":{ce},\"rtos\":{},\"spurious_rtos\":{},\"tlps\":{},\"late_losses\":{},\"spurious_late_losses\":{},\"sack_holes\":{},\"held_released\":{},\"acks_rcvd\":{},\"lat_p50_us\":{:.2},\"lat_p99_us\":{:.2},\"tx_dropped_local\":{},\"sock_rcvbuf\":{},\"sock_sndbuf\":{},\"paths\":[{}],\"bins_mbps\":[{}],\"acked_bins_mbps\":[{}],\"delivered_bins_mbps\":[{}],\"arrival_bins_mbps\":[{}],\"start_monotonic_s\":{start_monotonic:.6}}}",
            a.mode,
            a.size,
            gbps * 1000.0,
            c1.rtos - c0.rtos,
            c1.spurious_rtos - c0.spurious_rtos,
            c1.tlps - c0.tlps,
            c1.late_losses - c0.late_losses,
            c1.spurious_late_losses - c0.spurious_late_losses,
            c1.sack_holes - c0.sack_holes,
            c1.held_released - c0.held_released,
            c1.acks_rcvd - c0.acks_rcvd,
            percentile(&lat_us, 0.5),
            percentile(&lat_us, 0.99),
            io.tx_dropped_local,
            io.rcvbuf,
            io.sndbuf,
            path_json.join(","),
            mbps_of(&bins, a.bins_ms),
            mbps_of(&acked.bytes(), a.bins_ms),
            mbps_of(&delivered, a.bins_ms),
            mbps_of(&arrived, a.bins_ms)
        );
    } else {
        println!("---------------------------------------------------------------------------------------");
        println!("                    MetaRoCE {} test (metaroce-perf)", if a.mode == "bw" { "bandwidth" } else { "latency" });
        println!(
            " Paths: {}   Server: {}   Socket buffers: rcv {} / snd {} bytes",
            paths.len(),
            addr::format(&server),
            io.rcvbuf,
            io.sndbuf
        );
        println!("---------------------------------------------------------------------------------------");
        if a.mode == "bw" {
            println!(" #bytes     #iterations    BW average[Gb/sec]   MsgRate[Mpps]   retransmits   spurious   CE");
            println!(" {:<10} {:<14} {:<20.3} {:<15.6} {:<13} {:<10} {}", a.size, msgs, gbps, msgs as f64 / secs / 1e6, retx, spurious, ce);
        } else {
            println!(" #bytes     #iterations    t_p50[usec]    t_p99[usec]    retransmits");
            println!(" {:<10} {:<14} {:<14.2} {:<14.2} {}", a.size, msgs, percentile(&lat_us, 0.5), percentile(&lat_us, 0.99), retx);
        }
        println!(" per path: src_port srtt_us cwnd pkts_sent retransmits");
        for (port, p) in &paths {
            println!(
                "   {port:>6} {:>7} {:>8} {:>9} {:>5}{}",
                p.srtt_us,
                p.cwnd,
                p.pkts_sent,
                p.retransmits,
                if p.failed { " failed" } else { "" }
            );
        }
        println!("---------------------------------------------------------------------------------------");
    }
    t.close();
    Ok(msgs > 0)
}

fn main() -> ExitCode {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("metaroce-perf: {e}");
            return ExitCode::from(2);
        }
    };
    let r = if a.role == "server" { server(&a).map(|_| true) } else { client(&a) };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("metaroce-perf: no message completed");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("metaroce-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CounterBins;

    #[test]
    fn a_reading_is_spread_over_the_time_since_the_last_one() {
        let mut b = CounterBins::new(10, 1000);
        b.add(5_000, 1000 + 500); // 0-5 ms: all in bin 0
        b.add(15_000, 1500 + 1000); // 5-15 ms: half in bin 0, half in bin 1
        b.add(15_000, 2500 + 7); // no time passed: where the reading falls
        b.add(40_000, 2507 + 2500); // 15-40 ms: 500 | 1000 | 1000 over bins 1, 2, 3
        assert_eq!(b.bytes(), vec![1000, 1007, 1000, 1000]);
        assert_eq!(b.bytes().iter().sum::<u64>(), 5007 - 1000 + 1000 - 1000);
    }

    #[test]
    fn readings_are_due_every_sample_period() {
        let mut b = CounterBins::new(10, 0);
        assert!(!b.due(100));
        assert!(b.due(250));
        b.add(250, 10);
        assert!(!b.due(400));
        assert!(b.due(500));
    }
}
