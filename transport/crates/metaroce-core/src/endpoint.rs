//! An endpoint: the demultiplexer of its connections, the stateless side of
//! the handshake, tag matching, completions and the application's operations.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;

use crate::buf::{RecvBuf, SendBuf};
use crate::connection::{ConnParams, ConnState, Connection, Shared};
use crate::cookie::CookieKey;
use crate::counters::Counters;
use crate::event::{Completion, Error, OpKind, PeekInfo, PeerId};
use crate::matching::{Matcher, PostedRecv, Unexpected};
use crate::path::{PathState, PathTimers};
use crate::time::{Micros, MS, SEC};
use crate::wire::{self, Body, DecodeError, Header, PacketType};

pub const MAX_PATHS: u8 = 16;
/// Largest message (offsets are 32-bit on the wire).
pub const MAX_MSG_SIZE: u64 = u32::MAX as u64;
/// Stateless replies (challenges, resets) queued at most; beyond it they are dropped.
const MAX_STATELESS_QUEUE: usize = 256;

#[derive(Clone, Debug)]
pub struct Config {
    pub paths: u8,
    pub mtu: u16,
    pub ipv6: bool,
    /// Eager bytes a peer may have buffered here unmatched.
    pub credit_window: u32,
    /// Messages above this go by rendezvous.
    pub eager_max: u32,
    pub max_conns: usize,
    pub abort_timeout: Micros,
    pub idle_timeout: Micros,
    /// This receiver's capacity, shared among its active senders (0: no hint).
    pub rate_mbps: u32,
    pub min_rto: Micros,
    pub max_rto: Micros,
    pub initial_rtt: Micros,
    pub probe_interval: Micros,
    pub rotate_after: Micros,
    pub ack_delay: Micros,
    pub hello_interval: Micros,
    /// Per path, bytes.
    pub max_window: u64,
    /// Queueing delay over the path's minimum RTT before its window comes down.
    pub queue_target: Micros,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            // 16 source ports leave a link of 4 unused with probability (3/4)^16 = 1%.
            paths: 16,
            mtu: 1500,
            ipv6: false,
            credit_window: 4 << 20,
            eager_max: 64 << 10,
            max_conns: 1024,
            abort_timeout: 30 * SEC,
            idle_timeout: 300 * SEC,
            rate_mbps: 0,
            min_rto: 5 * MS,
            max_rto: SEC,
            initial_rtt: MS,
            probe_interval: 50 * MS,
            rotate_after: 3 * SEC,
            ack_delay: 100,
            hello_interval: 5 * MS,
            max_window: 4 << 20,
            queue_target: crate::congestion::aimd::QUEUE_TARGET_US,
        }
    }
}

impl Config {
    /// Payload bytes per DATA packet so a datagram never exceeds the path MTU.
    pub fn mss(&self) -> u32 {
        let ip_udp = if self.ipv6 { wire::IPV6_UDP_OVERHEAD } else { wire::IPV4_UDP_OVERHEAD };
        (self.mtu as usize - ip_udp - wire::DATA_OVERHEAD) as u32
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.paths == 0 || self.paths > MAX_PATHS {
            return Err(format!("paths={}: must be 1..{MAX_PATHS}", self.paths));
        }
        if !(576..=9216).contains(&self.mtu) {
            return Err(format!("mtu={}: must be 576..9216", self.mtu));
        }
        if self.eager_max > self.credit_window {
            return Err(format!("eager_max={} exceeds credit_window={}", self.eager_max, self.credit_window));
        }
        if self.min_rto == 0 || self.min_rto > self.max_rto {
            return Err(format!("min_rto={} must be in 1..=max_rto ({})", self.min_rto, self.max_rto));
        }
        Ok(())
    }

    fn conn_params(&self) -> ConnParams {
        ConnParams {
            mss: self.mss(),
            paths: self.paths,
            credit_window: self.credit_window,
            eager_max: self.eager_max,
            timers: PathTimers { min_rto: self.min_rto, max_rto: self.max_rto },
            max_window: self.max_window,
            initial_rtt: self.initial_rtt,
            abort_timeout: self.abort_timeout,
            probe_interval: self.probe_interval,
            rotate_after: self.rotate_after,
            ack_delay: self.ack_delay,
            hello_interval: self.hello_interval,
            max_ack_entries: wire::max_ack_entries(self.mtu as usize),
            queue_target: self.queue_target,
        }
    }
}

/// A datagram to send: on local path (socket) `path`, to `dest`, ECT if `ect`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub dest: SocketAddr,
    pub path: u8,
    pub len: usize,
    pub ect: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PathStats {
    pub path: u8,
    pub failed: bool,
    pub cwnd: u64,
    pub srtt_us: u64,
    pub rttvar_us: u64,
    /// Lowest RTT sample ever, and of the last millisecond or two (0: none yet).
    pub min_rtt_us: u64,
    pub recent_rtt_us: u64,
    pub inflight: u64,
    pub pkts_sent: u64,
    pub retransmits: u64,
    pub losses: u64,
    pub ce_echoed: u64,
}

/// splitmix64: tokens, incarnation and keys from one seed (the driver seeds it
/// from the OS; tests from a constant).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

pub struct Endpoint {
    cfg: Config,
    pub incarnation: u64,
    rng: Rng,
    cookies: CookieKey,
    conns: HashMap<u64, Connection>,
    by_addr: HashMap<SocketAddr, u64>,
    order: Vec<u64>,
    rr: usize,
    peer_by_addr: HashMap<SocketAddr, PeerId>,
    peer_addr: HashMap<PeerId, SocketAddr>,
    next_peer: PeerId,
    matcher: Matcher,
    shared: Shared,
    stateless: VecDeque<(SocketAddr, Vec<u8>)>,
    epochs: Vec<u16>,
    rotations: Vec<u8>,
    closing: bool,
}

impl Endpoint {
    pub fn new(cfg: Config, seed: u64) -> Result<Self, String> {
        cfg.validate()?;
        let mut rng = Rng(seed);
        let incarnation = rng.next() | 1;
        let cookies = CookieKey::new(rng.next(), rng.next());
        let epochs = vec![0; cfg.paths as usize];
        Ok(Self {
            cfg,
            incarnation,
            rng,
            cookies,
            conns: HashMap::new(),
            by_addr: HashMap::new(),
            order: Vec::new(),
            rr: 0,
            peer_by_addr: HashMap::new(),
            peer_addr: HashMap::new(),
            next_peer: 0,
            matcher: Matcher::default(),
            shared: Shared { completions: VecDeque::new(), counters: Counters::default() },
            stateless: VecDeque::new(),
            epochs,
            rotations: Vec::new(),
            closing: false,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn counters(&self) -> Counters {
        self.shared.counters
    }

    /// Unique payload bytes placed so far: read per datagram while arrival bins
    /// are on, where copying every counter twice per datagram was wasted work.
    pub fn bytes_rcvd(&self) -> u64 {
        self.shared.counters.bytes_rcvd
    }

    pub fn conns_active(&self) -> usize {
        self.conns.len()
    }

    // ----- peers (the address vector) -------------------------------------------------------

    pub fn peer(&mut self, addr: SocketAddr) -> PeerId {
        if let Some(p) = self.peer_by_addr.get(&addr) {
            return *p;
        }
        let id = self.next_peer;
        self.next_peer += 1;
        self.peer_by_addr.insert(addr, id);
        self.peer_addr.insert(id, addr);
        id
    }

    pub fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        self.peer_addr.get(&peer).copied()
    }

    pub fn remove_peer(&mut self, peer: PeerId) -> Result<(), Error> {
        let addr = self.peer_addr.remove(&peer).ok_or(Error::NoEntry)?;
        self.peer_by_addr.remove(&addr);
        Ok(())
    }

    fn conn_for(&mut self, now: Micros, peer: PeerId) -> Result<u64, Error> {
        let addr = self.peer_addr(peer).ok_or(Error::Invalid)?;
        if let Some(t) = self.by_addr.get(&addr) {
            return Ok(*t);
        }
        if self.conns.len() >= self.cfg.max_conns {
            self.shared.counters.drops_conn_limit += 1;
            return Err(Error::Again);
        }
        Ok(self.insert_conn(now, addr, peer))
    }

    fn insert_conn(&mut self, now: Micros, addr: SocketAddr, peer: PeerId) -> u64 {
        let mut token = self.rng.next();
        while token == 0 || self.conns.contains_key(&token) {
            token = self.rng.next();
        }
        let conn = Connection::new(now, token, addr, peer, self.cfg.conn_params(), &self.epochs);
        self.conns.insert(token, conn);
        self.by_addr.insert(addr, token);
        self.order.push(token);
        self.shared.counters.conns_opened += 1;
        token
    }

    fn remove_conn(&mut self, token: u64) {
        if let Some(c) = self.conns.remove(&token) {
            if self.by_addr.get(&c.addr) == Some(&token) {
                self.by_addr.remove(&c.addr);
            }
            self.order.retain(|t| *t != token);
            self.matcher.drop_conn(token);
        }
    }

    // ----- the application's operations -------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &mut self,
        now: Micros,
        peer: PeerId,
        buf: SendBuf,
        tag: u64,
        tagged: bool,
        cq_data: Option<u64>,
        context: u64,
        completion: bool,
    ) -> Result<(), Error> {
        if buf.len() as u64 > MAX_MSG_SIZE {
            return Err(Error::Invalid);
        }
        if self.closing {
            return Err(Error::Io);
        }
        let token = self.conn_for(now, peer)?;
        self.conns.get_mut(&token).unwrap().queue_send(buf, tag, tagged, cq_data, context, completion)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn recv(
        &mut self,
        peer: PeerId,
        buf: RecvBuf,
        tag: u64,
        ignore: u64,
        tagged: bool,
        context: u64,
        completion: bool,
    ) -> Result<(), Error> {
        match self.matcher.take_unexpected(peer, tag, ignore, tagged) {
            Some(u) => self.bind(u, Some(PostedRecv { context, peer, tag, ignore, tagged, buf, completion })),
            None => self.matcher.post(PostedRecv { context, peer, tag, ignore, tagged, buf, completion }),
        }
        Ok(())
    }

    /// Receive the message an earlier peek claimed for `context` (None: discard it).
    pub fn recv_claimed(&mut self, context: u64, buf: Option<RecvBuf>, completion: bool) -> Result<(), Error> {
        let u = self.matcher.take_claimed(context).ok_or(Error::NoMsg)?;
        match buf {
            Some(buf) => self.bind(u, Some(PostedRecv { context, peer: u.peer, tag: u.tag, ignore: 0, tagged: u.tagged, buf, completion })),
            None => {
                self.bind(u, None);
                if completion {
                    self.shared.completions.push_back(Completion {
                        context,
                        kind: OpKind::Recv,
                        tagged: u.tagged,
                        cq_data: u.cq_data,
                        err: None,
                        len: 0,
                        tag: u.tag,
                        peer: u.peer,
                        olen: 0,
                        buf: None,
                    });
                }
            }
        }
        Ok(())
    }

    /// Find an unmatched message; `claim` holds it for that context, `discard` drops it.
    pub fn peek(
        &mut self,
        peer: PeerId,
        tag: u64,
        ignore: u64,
        tagged: bool,
        claim: Option<u64>,
        discard: bool,
    ) -> Result<PeekInfo, Error> {
        let u = self.matcher.peek(peer, tag, ignore, tagged).ok_or(Error::NoMsg)?;
        let info = PeekInfo { peer: u.peer, len: u.len, tag: u.tag, tagged: u.tagged, cq_data: u.cq_data };
        if discard {
            let u = *u;
            self.matcher.take_unexpected(u.peer, u.tag, 0, u.tagged);
            self.bind(u, None);
        } else if let Some(ctx) = claim {
            u.claimed_by = Some(ctx);
        }
        Ok(info)
    }

    pub fn cancel(&mut self, context: u64) -> Result<(), Error> {
        let r = self.matcher.cancel(context).ok_or(Error::NoEntry)?;
        self.shared.completions.push_back(Completion {
            context,
            kind: OpKind::Recv,
            tagged: r.tagged,
            cq_data: None,
            err: Some(Error::Canceled),
            len: 0,
            tag: r.tag,
            peer: r.peer,
            olen: 0,
            buf: Some(r.buf),
        });
        Ok(())
    }

    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.shared.completions.pop_front()
    }

    pub fn completions_pending(&self) -> usize {
        self.shared.completions.len()
    }

    fn bind(&mut self, u: Unexpected, recv: Option<PostedRecv>) {
        if let Some(c) = self.conns.get_mut(&u.conn) {
            c.bind(u.msg, recv, &mut self.shared);
        }
    }

    /// Match the messages of a connection in send order, as their headers arrive.
    fn match_ready(&mut self, token: u64) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        while let Some(info) = c.next_matchable() {
            match self.matcher.take_posted(c.peer, info.tag, info.tagged) {
                Some(r) => c.bind(info.msg, Some(r), &mut self.shared),
                None => self.matcher.push_unexpected(Unexpected {
                    conn: token,
                    msg: info.msg,
                    peer: c.peer,
                    tag: info.tag,
                    tagged: info.tagged,
                    len: info.len as u64,
                    cq_data: info.cq_data,
                    claimed_by: None,
                }),
            }
            c.advance_match();
        }
    }

    // ----- the network -------------------------------------------------------------------

    /// One datagram that arrived on local path `path` from `from`; `ce`: its IP ECN was CE.
    pub fn handle_datagram(&mut self, now: Micros, from: SocketAddr, ce: bool, datagram: &[u8]) {
        self.shared.counters.pkts_rcvd += 1;
        let p = match wire::decode(datagram) {
            Ok(p) => p,
            Err(e) => {
                let c = &mut self.shared.counters;
                match e {
                    DecodeError::BadCrc => c.drops_crc += 1,
                    DecodeError::BadVersion(_) => c.drops_version += 1,
                    _ => c.drops_malformed += 1,
                }
                return;
            }
        };
        let h = p.header;
        match p.body {
            Body::Hello(hello) => self.on_hello(now, from, &hello),
            Body::Challenge(ch) => {
                if let Some(c) = self.conns.get_mut(&h.dst_token) {
                    if c.state == ConnState::Connecting && c.addr == from && ch.echo_token == c.local_token {
                        c.cookie = Some((ch.cookie, ch.cookie_time));
                        c.next_hello_at = now;
                        self.shared.counters.handshakes_challenged += 1;
                        return;
                    }
                }
                self.shared.counters.drops_stale += 1;
            }
            Body::Accept(a) => {
                let Some(c) = self.conns.get_mut(&h.dst_token) else {
                    self.shared.counters.drops_unknown_conn += 1;
                    return;
                };
                if c.addr != from {
                    self.shared.counters.drops_stale += 1;
                } else if c.state == ConnState::Connecting {
                    c.establish(now, a.src_token, a.incarnation, a.mss, a.credit_window);
                } else if c.peer_token != a.src_token {
                    self.shared.counters.drops_stale += 1;
                }
            }
            Body::Data(d, payload) => {
                let token = h.dst_token;
                let Some(c) = self.conns.get_mut(&token) else {
                    self.unknown_conn(from, &h, datagram.len());
                    return;
                };
                if c.addr.ip() != from.ip() || c.state != ConnState::Established {
                    self.shared.counters.drops_stale += 1;
                    return;
                }
                if c.on_data_arrival(now, &h, d.psn, d.floor_delta, ce, &mut self.shared) && c.on_data(now, &d, payload, &mut self.shared) {
                    self.match_ready(token);
                }
            }
            Body::Ack(a) => {
                let Some(c) = self.conns.get_mut(&h.dst_token) else {
                    self.unknown_conn(from, &h, datagram.len());
                    return;
                };
                if c.addr.ip() != from.ip() || c.state != ConnState::Established {
                    self.shared.counters.drops_stale += 1;
                    return;
                }
                self.shared.counters.acks_rcvd += 1;
                c.on_ack(now, &a, &mut self.shared);
            }
            Body::Close => {
                if let Some(c) = self.conns.get_mut(&h.dst_token) {
                    if c.addr.ip() == from.ip() {
                        c.fail(Error::ConnReset, &mut self.shared);
                        self.remove_conn(h.dst_token);
                    }
                }
            }
            Body::Reset { token } => {
                let hit = self.conns.iter().find(|(_, c)| c.addr.ip() == from.ip() && c.peer_token == token && token != 0).map(|(t, _)| *t);
                if let Some(t) = hit {
                    let c = self.conns.get_mut(&t).unwrap();
                    c.fail(Error::ConnReset, &mut self.shared);
                    self.shared.counters.conns_failed += 1;
                    self.remove_conn(t);
                } else {
                    self.shared.counters.drops_stale += 1;
                }
            }
        }
    }

    fn unknown_conn(&mut self, from: SocketAddr, h: &Header, len: usize) {
        self.shared.counters.drops_unknown_conn += 1;
        // A RESET tells a peer whose state we lost; it is never larger than what it answers.
        let mut buf = vec![0u8; 64];
        let rh = Header { ptype: PacketType::Reset, flags: 0, path: 0, epoch: 0, dst_token: 0 };
        let n = wire::write_reset(&mut buf, &rh, h.dst_token);
        if n <= len && self.stateless.len() < MAX_STATELESS_QUEUE && h.ptype == PacketType::Data {
            buf.truncate(n);
            self.shared.counters.resets_sent += 1;
            let dest = self.peer_base_addr(from);
            self.stateless.push_back((dest, buf));
        }
    }

    /// Where a peer receives: the connection's address if one matches the IP, else `from`.
    fn peer_base_addr(&self, from: SocketAddr) -> SocketAddr {
        self.conns.values().find(|c| c.addr.ip() == from.ip()).map_or(from, |c| c.addr)
    }

    fn cookie_time(now: Micros) -> u32 {
        (now / SEC) as u32
    }

    fn on_hello(&mut self, now: Micros, from: SocketAddr, hello: &wire::Hello) {
        let now_s = Self::cookie_time(now);
        if hello.src_token == 0 || !self.cookies.verify(&from, hello.src_token, hello.incarnation, hello.cookie_time, now_s, &hello.cookie)
        {
            if self.stateless.len() >= MAX_STATELESS_QUEUE {
                return;
            }
            let cookie = self.cookies.make(&from, hello.src_token, hello.incarnation, now_s);
            let mut buf = vec![0u8; wire::MIN_HELLO_LEN];
            let h = Header { ptype: PacketType::Challenge, flags: 0, path: 0, epoch: 0, dst_token: hello.src_token };
            let n = wire::write_challenge(&mut buf, &h, &wire::Challenge { echo_token: hello.src_token, cookie, cookie_time: now_s });
            buf.truncate(n);
            self.stateless.push_back((from, buf));
            return;
        }
        // The client proved its address: now we keep state.
        if let Some(&t) = self.by_addr.get(&from) {
            let c = self.conns.get_mut(&t).unwrap();
            match c.state {
                ConnState::Established if c.peer_incarnation == hello.incarnation && c.peer_token == hello.src_token => {
                    self.queue_accept(t, hello.src_token); // our ACCEPT was lost
                    return;
                }
                ConnState::Connecting => {
                    // Both sides opened at once: one connection, both tokens.
                    c.establish(now, hello.src_token, hello.incarnation, hello.mss, hello.credit_window);
                    self.queue_accept(t, hello.src_token);
                    return;
                }
                _ => {
                    // A new incarnation (the peer restarted) or a new connection of it.
                    c.fail(Error::ConnReset, &mut self.shared);
                    self.remove_conn(t);
                }
            }
        }
        if self.conns.len() >= self.cfg.max_conns {
            self.shared.counters.drops_conn_limit += 1;
            return;
        }
        let peer = self.peer(from);
        let t = self.insert_conn(now, from, peer);
        self.conns.get_mut(&t).unwrap().establish(now, hello.src_token, hello.incarnation, hello.mss, hello.credit_window);
        self.queue_accept(t, hello.src_token);
    }

    fn queue_accept(&mut self, token: u64, peer_token: u64) {
        let c = &self.conns[&token];
        let mut buf = vec![0u8; 128];
        let h = Header { ptype: PacketType::Accept, flags: 0, path: 0, epoch: self.epochs[0], dst_token: peer_token };
        let body = wire::Accept {
            src_token: c.local_token,
            incarnation: self.incarnation,
            paths: self.cfg.paths,
            mss: self.cfg.mss() as u16,
            credit_window: self.cfg.credit_window,
        };
        let n = wire::write_accept(&mut buf, &h, &body);
        buf.truncate(n);
        self.stateless.push_back((c.addr, buf));
    }

    fn rate_hint(&self, now: Micros) -> u32 {
        if self.cfg.rate_mbps == 0 {
            return 0;
        }
        let active = self.conns.values().filter(|c| c.last_data_rcvd_at + 10 * MS > now && c.last_data_rcvd_at > 0).count();
        (self.cfg.rate_mbps / active.max(1) as u32).max(1)
    }

    /// The next datagram to send, written into `buf` (at least the path MTU).
    pub fn poll_transmit(&mut self, now: Micros, buf: &mut [u8]) -> Option<Transmit> {
        if let Some((dest, data)) = self.stateless.pop_front() {
            buf[..data.len()].copy_from_slice(&data);
            return Some(Transmit { dest, path: 0, len: data.len(), ect: false });
        }
        let n = self.order.len();
        let hint = self.rate_hint(now);
        for k in 0..n {
            let token = self.order[(self.rr + k) % n];
            let c = self.conns.get_mut(&token).unwrap();
            if let Some((len, path, ect)) = c.poll_transmit(now, buf, self.incarnation, self.cfg.credit_window, hint, &mut self.shared) {
                self.rr = (self.rr + k + 1) % n;
                return Some(Transmit { dest: c.addr, path, len, ect });
            }
        }
        None
    }

    /// The end of a receive batch (the driver calls it): see `Connection::flush_ack`.
    pub fn flush_acks(&mut self) {
        for c in self.conns.values_mut() {
            c.flush_ack();
        }
    }

    pub fn poll_timeout(&self, now: Micros) -> Option<Micros> {
        if !self.stateless.is_empty() {
            return Some(now);
        }
        self.conns.values().filter_map(|c| c.poll_timeout(now)).min()
    }

    pub fn handle_timeout(&mut self, now: Micros) {
        let mut dead = Vec::new();
        for (t, c) in self.conns.iter_mut() {
            c.handle_timeout(now, &mut self.shared);
            if c.state == ConnState::Failed {
                dead.push(*t);
            } else if c.state == ConnState::Established && c.is_idle() && now.saturating_sub(c.last_activity) > self.cfg.idle_timeout {
                self.shared.counters.conns_reaped += 1;
                dead.push(*t);
                let mut buf = vec![0u8; 64];
                let h = Header { ptype: PacketType::Close, flags: 0, path: 0, epoch: 0, dst_token: c.peer_token };
                let n = wire::write_close(&mut buf, &h);
                buf.truncate(n);
                self.stateless.push_back((c.addr, buf));
            }
            for r in c.rotate_requests.drain(..) {
                if !self.rotations.contains(&r) {
                    self.rotations.push(r);
                }
            }
        }
        for t in dead {
            self.remove_conn(t);
        }
    }

    /// A path whose source port the driver should change (then call `path_rotated`).
    pub fn take_rotation(&mut self) -> Option<u8> {
        self.rotations.pop()
    }

    pub fn path_rotated(&mut self, path: u8) {
        let i = path as usize;
        if i >= self.epochs.len() {
            return;
        }
        self.epochs[i] = self.epochs[i].wrapping_add(1);
        self.shared.counters.path_rotations += 1;
        for c in self.conns.values_mut() {
            c.rotate_path(i, self.epochs[i]);
        }
    }

    pub fn has_outstanding(&self) -> bool {
        self.conns.values().any(|c| c.has_outstanding() && c.state == ConnState::Established)
    }

    /// Before closing: acknowledge everything received, on every path.
    pub fn final_acks(&mut self) {
        for c in self.conns.values_mut() {
            c.ack_on_every_path();
        }
    }

    /// Stop taking sends; tell every peer we are going (after the linger).
    pub fn close(&mut self) {
        self.closing = true;
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for t in tokens {
            let c = &self.conns[&t];
            if c.state == ConnState::Established {
                let mut buf = vec![0u8; 64];
                let h = Header { ptype: PacketType::Close, flags: 0, path: 0, epoch: 0, dst_token: c.peer_token };
                let n = wire::write_close(&mut buf, &h);
                buf.truncate(n);
                self.stateless.push_back((c.addr, buf));
            }
            let c = self.conns.get_mut(&t).unwrap();
            c.fail(Error::Canceled, &mut self.shared);
        }
        self.conns.clear();
        self.by_addr.clear();
        self.order.clear();
    }

    pub fn path_stats(&self, peer: PeerId) -> Vec<PathStats> {
        let Some(addr) = self.peer_addr(peer) else { return Vec::new() };
        let Some(c) = self.by_addr.get(&addr).and_then(|t| self.conns.get(t)) else { return Vec::new() };
        Self::stats_of(c)
    }

    /// Per-path figures of up to `max` live connections, by peer address (lowest
    /// first, so repeated snapshots list the same peers).
    pub fn conn_path_stats(&self, max: usize) -> Vec<(SocketAddr, Vec<PathStats>)> {
        let mut addrs: Vec<&SocketAddr> = self.by_addr.keys().collect();
        addrs.sort();
        addrs.into_iter().filter_map(|a| Some((*a, Self::stats_of(self.conns.get(self.by_addr.get(a)?)?)))).take(max).collect()
    }

    fn stats_of(c: &Connection) -> Vec<PathStats> {
        c.paths
            .iter()
            .map(|p| PathStats {
                path: p.index,
                failed: p.state == PathState::Failed,
                cwnd: crate::congestion::Controller::window(&p.cc),
                srtt_us: p.rtt.srtt,
                rttvar_us: p.rtt.rttvar,
                min_rtt_us: if p.rtt.has_sample() { p.rtt.min } else { 0 },
                recent_rtt_us: match p.recent_rtt.get() {
                    Micros::MAX => 0,
                    r => r,
                },
                inflight: p.inflight_bytes,
                pkts_sent: p.pkts_sent,
                retransmits: p.retransmits,
                losses: p.losses,
                ce_echoed: p.ce_echoed,
            })
            .collect()
    }

    /// Memory held for connections: pools, tracking (the bound is stated in PROTOCOL.md).
    pub fn memory_bytes(&self) -> u64 {
        self.conns.values().map(|c| c.memory_bytes()).sum()
    }
}
