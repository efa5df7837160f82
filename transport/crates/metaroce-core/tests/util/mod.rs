//! Two (or more) endpoints over a simulated fabric: links chosen by a hash of
//! the source port (ECMP), each with a delay, a rate and a FIFO queue with a
//! limit (like tbf), and impairments drawn from one seeded generator, so every
//! loss, reorder, duplicate and timer case replays exactly.
#![allow(dead_code)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;

use metaroce_core::time::Micros;
use metaroce_core::{Config, Endpoint, Transmit};

pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

#[derive(Clone, Debug)]
pub struct Link {
    pub delay: Micros,
    /// Bytes per microsecond (125 = 1 Gbit/s); 0 = infinite.
    pub rate: f64,
    pub queue_limit: usize,
    pub loss: f64,
    /// Gilbert-Elliott: chance to enter / leave the bad state per packet, loss in it.
    pub burst_enter: f64,
    pub burst_leave: f64,
    pub burst_loss: f64,
    pub ce: f64,
    pub dup: f64,
    pub down: bool,
    /// Down for what endpoint k sends only (a one-way failure: the other way works).
    pub down_from: Option<usize>,
    // State per direction (index by sender).
    free_at: [Micros; 2],
    bad: [bool; 2],
    pub delivered: [u64; 2],
    pub dropped: [u64; 2],
    pub bytes: [u64; 2],
}

impl Link {
    pub fn new(delay: Micros, rate: f64) -> Self {
        Link {
            delay,
            rate,
            queue_limit: 256 << 10,
            loss: 0.0,
            burst_enter: 0.0,
            burst_leave: 0.0,
            burst_loss: 0.0,
            ce: 0.0,
            dup: 0.0,
            down: false,
            down_from: None,
            free_at: [0; 2],
            bad: [false; 2],
            delivered: [0; 2],
            dropped: [0; 2],
            bytes: [0; 2],
        }
    }
}

struct Delivery {
    at: Micros,
    seq: u64,
    to: usize,
    from: SocketAddr,
    ce: bool,
    data: Vec<u8>,
}

impl PartialEq for Delivery {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Delivery {}
impl PartialOrd for Delivery {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Delivery {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

pub struct Sim {
    pub now: Micros,
    pub eps: Vec<Endpoint>,
    pub addrs: Vec<SocketAddr>,
    /// Per endpoint, the source-port epoch of each path (bumped by rotation).
    pub epochs: Vec<Vec<u16>>,
    pub links: Vec<Link>,
    /// Endpoint i is unreachable (its packets and those to it vanish).
    pub silent: Vec<bool>,
    pub rng: Rng,
    queue: BinaryHeap<Reverse<Delivery>>,
    seq: u64,
    buf: Vec<u8>,
    /// Extra datagrams injected by a test (fuzzing): (to, from, bytes).
    pub injected: u64,
    /// A busy host: in the second half of every `period`, each datagram reaches its
    /// endpoint `delay` late (a descheduled progress thread, full socket buffers);
    /// every path shares it and each link's order is kept.
    pub host_busy: Option<(Micros, Micros)>,
    /// Per (endpoint, link): the latest delivery time so far.
    last_at: Vec<Vec<Micros>>,
}

impl Sim {
    pub fn new(n: usize, cfg: Config, links: Vec<Link>, seed: u64) -> Self {
        let eps: Vec<Endpoint> =
            (0..n).map(|i| Endpoint::new(cfg.clone(), seed.wrapping_mul(31).wrapping_add(i as u64 + 1)).unwrap()).collect();
        let addrs = (0..n).map(|i| format!("10.0.0.{}:4000", i + 1).parse().unwrap()).collect();
        let epochs = vec![vec![0; cfg.paths as usize]; n];
        Sim {
            now: 1_000_000,
            eps,
            addrs,
            epochs,
            links,
            silent: vec![false; n],
            rng: Rng(seed | 1),
            queue: BinaryHeap::new(),
            seq: 0,
            buf: vec![0; 65536],
            injected: 0,
            host_busy: None,
            last_at: vec![vec![0; 64]; n],
        }
    }

    pub fn two(cfg: Config, links: Vec<Link>, seed: u64) -> Self {
        Self::new(2, cfg, links, seed)
    }

    /// The source address of endpoint i's path p (ports differ per path and epoch).
    pub fn src_addr(&self, i: usize, path: u8) -> SocketAddr {
        let mut a = self.addrs[i];
        if path != 0 || self.epochs[i][0] != 0 {
            a.set_port(5000 + path as u16 * 100 + self.epochs[i][path as usize]);
        }
        a
    }

    /// ECMP: the link is a hash of the 4-tuple (source port picks it).
    pub fn link_of(&self, from: SocketAddr, to: SocketAddr) -> usize {
        let h = (from.port() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (to.port() as u64) ^ ((from.ip().to_string().len() as u64) << 7);
        ((h >> 29) % self.links.len() as u64) as usize
    }

    fn index_of(&self, a: SocketAddr) -> Option<usize> {
        self.addrs.iter().position(|x| x.ip() == a.ip())
    }

    fn route(&mut self, from_ep: usize, t: Transmit, data: Vec<u8>) {
        let Some(to) = self.index_of(t.dest) else { return };
        if self.silent[from_ep] || self.silent[to] {
            return;
        }
        let from = self.src_addr(from_ep, t.path);
        let li = self.link_of(from, t.dest);
        let dir = usize::from(from_ep > to);
        let now = self.now;
        let (ce_p, dup_p, loss_p, enter, leave, bl, was_bad) = {
            let l = &self.links[li];
            (l.ce, l.dup, l.loss, l.burst_enter, l.burst_leave, l.burst_loss, l.bad[dir])
        };
        let ce_roll = self.rng.chance(ce_p);
        let dup_roll = self.rng.chance(dup_p);
        if self.links[li].down || self.links[li].down_from == Some(from_ep) {
            self.links[li].dropped[dir] += 1;
            return;
        }
        // Loss: random, or Gilbert-Elliott bursts.
        let mut bad = was_bad;
        if bad {
            if self.rng.chance(leave) {
                bad = false;
            }
        } else if self.rng.chance(enter) {
            bad = true;
        }
        let lost = self.rng.chance(loss_p) || (bad && self.rng.chance(bl));
        self.links[li].bad[dir] = bad;
        let link = &mut self.links[li];
        let ser = if link.rate > 0.0 { (data.len() as f64 / link.rate).ceil() as Micros } else { 0 };
        let start = link.free_at[dir].max(now);
        let backlog = ((start - now) as f64 * link.rate) as usize;
        if link.rate > 0.0 && backlog > link.queue_limit {
            link.dropped[dir] += 1;
            return;
        }
        if lost {
            link.dropped[dir] += 1;
            link.free_at[dir] = start + ser;
            return;
        }
        link.free_at[dir] = start + ser;
        link.delivered[dir] += 1;
        link.bytes[dir] += data.len() as u64;
        let mut at = start + ser + link.delay;
        if let Some((period, delay)) = self.host_busy {
            if at % period >= period / 2 {
                at += delay;
            }
            at = at.max(self.last_at[to][li]);
            self.last_at[to][li] = at;
        }
        let ce = t.ect && ce_roll;
        if dup_roll {
            self.seq += 1;
            self.queue.push(Reverse(Delivery { at: at + 1, seq: self.seq, to, from, ce, data: data.clone() }));
        }
        self.seq += 1;
        self.queue.push(Reverse(Delivery { at, seq: self.seq, to, from, ce, data }));
    }

    pub fn inject(&mut self, to: usize, from: SocketAddr, data: Vec<u8>) {
        self.seq += 1;
        self.injected += 1;
        self.queue.push(Reverse(Delivery { at: self.now, seq: self.seq, to, from, ce: false, data }));
    }

    fn flush(&mut self) {
        for i in 0..self.eps.len() {
            for _ in 0..100_000 {
                let mut buf = std::mem::take(&mut self.buf);
                let t = self.eps[i].poll_transmit(self.now, &mut buf);
                let Some(t) = t else {
                    self.buf = buf;
                    break;
                };
                let data = buf[..t.len].to_vec();
                self.buf = buf;
                self.route(i, t, data);
            }
            while let Some(p) = self.eps[i].take_rotation() {
                self.epochs[i][p as usize] += 1;
                self.eps[i].path_rotated(p);
            }
        }
    }

    /// Advance to the next event and process it. False when nothing is left to do.
    pub fn step(&mut self, limit: Micros) -> bool {
        self.flush();
        let next_delivery = self.queue.peek().map(|d| d.0.at);
        let next_timer = self.eps.iter().filter_map(|e| e.poll_timeout(self.now)).min();
        let next = match (next_delivery, next_timer) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => match a.or(b) {
                Some(t) => t,
                None => {
                    self.now = limit;
                    return false;
                }
            },
        };
        if next > limit {
            self.now = limit;
            return false;
        }
        self.now = self.now.max(next);
        let mut touched = vec![false; self.eps.len()];
        while self.queue.peek().is_some_and(|d| d.0.at <= self.now) {
            let d = self.queue.pop().unwrap().0;
            if self.silent[d.to] {
                continue;
            }
            self.eps[d.to].handle_datagram(self.now, d.from, d.ce, &d.data);
            touched[d.to] = true;
        }
        for (i, e) in self.eps.iter_mut().enumerate() {
            if touched[i] {
                e.flush_acks();
            }
            e.handle_timeout(self.now);
        }
        true
    }

    /// Run until `done` holds or `duration` passes; returns whether `done` held.
    pub fn run_until(&mut self, duration: Micros, mut done: impl FnMut(&mut Sim) -> bool) -> bool {
        let limit = self.now + duration;
        let mut steps = 0u64;
        loop {
            steps += 1;
            if steps.is_multiple_of(200_000) && std::env::var_os("SIM_TRACE").is_some() {
                eprintln!("t={} next={:?} {:?}", self.now, self.eps[0].poll_timeout(self.now), self.eps[0].counters());
            }
            if done(self) {
                return true;
            }
            if !self.step(limit) && self.now >= limit {
                return done(self);
            }
        }
    }
}

/// The byte at offset `i` of message `msg`: data checks catch misplaced bytes.
pub fn pattern(msg: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (msg.wrapping_mul(131).wrapping_add(i as u64 * 7) ^ (i as u64 >> 8)) as u8).collect()
}

pub fn four_links(delay: Micros, rate: f64) -> Vec<Link> {
    (0..4).map(|_| Link::new(delay, rate)).collect()
}
