// The fuzz harness, shared by the cargo-fuzz target (transport/fuzz) and the
// corpus replay on stable (tests/fuzz_corpus.rs). Input: a sequence of records
// `[mode u8][len u16 LE][len bytes]`:
//   mode 0: the bytes as a raw datagram to endpoint B, from A's address;
//   mode 1: a DATA packet with the real token and a correct CRC, its data header
//           and payload taken from the bytes (a replay inside the window with
//           altered fields, or a forged segment);
//   mode 2: an ACK with the real token and a correct CRC, its entries from the bytes;
//   mode 3: the bytes as a HELLO-sized datagram from a new address (handshake).
// Invariants: nothing panics, B's memory stays within its stated bound, and
// after raw garbage (mode 0 and 3 only) a real transfer still arrives intact.

use metaroce_core::time::{Micros, MS};
use metaroce_core::wire::{self, DataHeader, DataKind, Header, PacketType};
use metaroce_core::{Config, Endpoint, RecvBuf, SendBuf};
use std::net::SocketAddr;

pub struct Pair {
    pub a: Endpoint,
    pub b: Endpoint,
    pub a_addr: SocketAddr,
    pub b_addr: SocketAddr,
    pub now: Micros,
}

impl Pair {
    pub fn new() -> Self {
        let cfg = Config { paths: 2, ..Config::default() };
        let mut p = Pair {
            a: Endpoint::new(cfg.clone(), 1).unwrap(),
            b: Endpoint::new(cfg, 2).unwrap(),
            a_addr: "10.0.0.1:4000".parse().unwrap(),
            b_addr: "10.0.0.2:4000".parse().unwrap(),
            now: 10_000_000,
        };
        // Establish the connection with one small message.
        let peer = p.a.peer(p.b_addr);
        let src = p.b.peer(p.a_addr);
        p.b.recv(src, RecvBuf::owned(8), 0, 0, true, 0, true).unwrap();
        p.a.send(p.now, peer, SendBuf::owned(vec![1; 8]), 0, true, None, 0, true).unwrap();
        p.pump(50);
        p
    }

    /// Exchange packets for `rounds` steps of 1 ms (lossless, instant links).
    pub fn pump(&mut self, rounds: usize) {
        let mut buf = vec![0u8; 65536];
        for _ in 0..rounds {
            for _ in 0..10_000 {
                let mut moved = false;
                if let Some(t) = self.a.poll_transmit(self.now, &mut buf) {
                    let from = if t.path == 0 { self.a_addr } else { SocketAddr::new(self.a_addr.ip(), 5000 + t.path as u16) };
                    self.b.handle_datagram(self.now, from, false, &buf[..t.len]);
                    moved = true;
                }
                if let Some(t) = self.b.poll_transmit(self.now, &mut buf) {
                    let from = if t.path == 0 { self.b_addr } else { SocketAddr::new(self.b_addr.ip(), 5000 + t.path as u16) };
                    self.a.handle_datagram(self.now, from, false, &buf[..t.len]);
                    moved = true;
                }
                if !moved {
                    break;
                }
            }
            self.a.flush_acks();
            self.b.flush_acks();
            self.now += MS;
            self.a.handle_timeout(self.now);
            self.b.handle_timeout(self.now);
        }
    }

    /// The token B knows its connection by, learnt from what A sends.
    fn b_token(&mut self) -> u64 {
        let peer = self.a.peer(self.b_addr);
        let mut buf = vec![0u8; 65536];
        self.a.send(self.now, peer, SendBuf::owned(vec![0; 1]), 99, true, None, 0, false).unwrap();
        let mut tok = 0;
        while let Some(t) = self.a.poll_transmit(self.now, &mut buf) {
            if let Ok(p) = wire::decode(&buf[..t.len]) {
                tok = p.header.dst_token;
            }
            self.b.handle_datagram(self.now, self.a_addr, false, &buf[..t.len]);
        }
        tok
    }
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> &'a [u8] {
    let n = n.min(b.len());
    let (h, t) = b.split_at(n);
    *b = t;
    h
}

fn u32_of(b: &[u8], i: usize) -> u32 {
    let mut x = [0u8; 4];
    for (k, v) in b.iter().skip(i).take(4).enumerate() {
        x[k] = *v;
    }
    u32::from_le_bytes(x)
}

/// Returns B's counters (drops, duplicates) for the caller's checks.
pub fn run(data: &[u8]) -> metaroce_core::Counters {
    let mut p = Pair::new();
    let token = p.b_token();
    let mut input = data;
    let mut only_garbage = true;
    let mut buf = vec![0u8; 65536];
    let mut records = 0;
    while input.len() >= 3 && records < 256 {
        records += 1;
        let mode = input[0] % 4;
        let len = u16::from_le_bytes([input[1], input[2]]) as usize % 4096;
        input = &input[3..];
        let bytes = take(&mut input, len);
        match mode {
            0 => p.b.handle_datagram(p.now, p.a_addr, bytes.first().is_some_and(|b| b & 1 == 1), bytes),
            1 => {
                only_garbage = false;
                let kinds = [DataKind::Eager, DataKind::Rts, DataKind::Rndv, DataKind::Cts, DataKind::Ping];
                let d = DataHeader {
                    psn: u32_of(bytes, 0) % 600,
                    msg: u32_of(bytes, 4) % 8,
                    offset: u32_of(bytes, 8) % 200_000,
                    msg_len: u32_of(bytes, 12) % 300_000,
                    tag: u32_of(bytes, 16) as u64,
                    cq_data: 0,
                    kind: kinds[bytes.get(20).copied().unwrap_or(0) as usize % kinds.len()],
                    mflags: bytes.get(21).copied().unwrap_or(0) & 3,
                    floor_delta: (u32_of(bytes, 22) % 300) as u16,
                };
                let payload = if bytes.len() > 26 { &bytes[26..] } else { &[][..] };
                let path = bytes.get(26).copied().unwrap_or(0) % 3;
                let h = Header { ptype: PacketType::Data, flags: 0, path, epoch: 0, dst_token: token };
                let n = wire::write_data(&mut buf, &h, &d, payload.len().min(1400), |s| s.copy_from_slice(&payload[..s.len()]));
                p.b.handle_datagram(p.now, p.a_addr, false, &buf[..n]);
            }
            2 => {
                only_garbage = false;
                let entries = bytes
                    .chunks(12)
                    .take(20)
                    .map(|c| wire::AckEntry {
                        path: c.first().copied().unwrap_or(0) % 3,
                        epoch: 0,
                        cum: u32_of(c, 1) % 1000,
                        ce: u32_of(c, 5),
                        rcvd: u32_of(c, 8),
                        sack: [c.get(11).copied().unwrap_or(0); 32],
                    })
                    .collect();
                let a = wire::Ack { rate_hint_mbps: u32_of(bytes, 0), credit: u32_of(bytes, 4) as u64, entries };
                let h = Header { ptype: PacketType::Ack, flags: 0, path: 0, epoch: 0, dst_token: token };
                let n = wire::write_ack(&mut buf, &h, &a);
                p.b.handle_datagram(p.now, p.a_addr, false, &buf[..n]);
            }
            _ => {
                let from: SocketAddr = format!("10.0.9.{}:{}", bytes.first().copied().unwrap_or(1), 1000 + len).parse().unwrap();
                p.b.handle_datagram(p.now, from, false, bytes);
            }
        }
        // Answer whatever B wants to send (challenges, resets, ACKs) into nowhere.
        while p.b.poll_transmit(p.now, &mut buf).is_some() {}
        p.b.handle_timeout(p.now);
    }
    assert!(p.b.memory_bytes() <= 16 << 20, "memory {}", p.b.memory_bytes());
    if only_garbage {
        // A real transfer still works, intact.
        let peer = p.a.peer(p.b_addr);
        let src = p.b.peer(p.a_addr);
        let msg: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        while p.b.poll_completion().is_some() {}
        p.b.recv(src, RecvBuf::owned(msg.len()), 7, 0, true, 42, true).unwrap();
        p.a.send(p.now, peer, SendBuf::owned(msg.clone()), 7, true, None, 43, true).unwrap();
        p.pump(200);
        let mut ok = false;
        while let Some(c) = p.b.poll_completion() {
            if c.context == 42 {
                assert_eq!(c.err, None);
                assert!(c.buf.unwrap().into_vec().unwrap() == msg, "corrupted after garbage");
                ok = true;
            }
        }
        assert!(ok, "transfer did not complete after garbage: {:?}", p.b.counters());
    }
    p.b.counters()
}
