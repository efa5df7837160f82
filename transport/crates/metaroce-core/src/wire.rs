//! The wire format: every packet is a 16-byte common header, a body of its type
//! and a CRC32C of everything before it. Big-endian. `transport/PROTOCOL.md` is
//! the reference; this file and that page change together.

use std::fmt;

pub const MAGIC: u16 = 0x4D52; // "MR"
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 16;
pub const CRC_LEN: usize = 4;
pub const DATA_HEADER_LEN: usize = 36;
pub const ACK_FIXED_LEN: usize = 16;
pub const ACK_ENTRY_LEN: usize = 48;
/// A HELLO is padded to this size, and nothing sent before a cookie is echoed
/// is larger than the HELLO it answers (no amplification).
pub const MIN_HELLO_LEN: usize = 128;
pub const SACK_BITS: u32 = 256;
/// IPv4 + UDP headers, what a datagram costs beyond its payload on the path MTU.
pub const IPV4_UDP_OVERHEAD: usize = 28;
pub const IPV6_UDP_OVERHEAD: usize = 48;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketType {
    Hello = 1,
    Challenge = 2,
    Accept = 3,
    Data = 4,
    Ack = 5,
    Close = 6,
    Reset = 7,
}

impl PacketType {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Hello,
            2 => Self::Challenge,
            3 => Self::Accept,
            4 => Self::Data,
            5 => Self::Ack,
            6 => Self::Close,
            7 => Self::Reset,
            _ => return None,
        })
    }
}

/// Why a datagram was dropped before reaching a connection; each is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    TooShort,
    BadMagic,
    BadVersion(u8),
    BadCrc,
    BadType(u8),
    Malformed(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort => write!(f, "datagram shorter than a header"),
            Self::BadMagic => write!(f, "not a MetaRoCE packet (magic)"),
            Self::BadVersion(v) => write!(f, "protocol version {v} not supported (1)"),
            Self::BadCrc => write!(f, "CRC32C mismatch"),
            Self::BadType(t) => write!(f, "unknown packet type {t}"),
            Self::Malformed(what) => write!(f, "malformed packet: {what}"),
        }
    }
}

/// Header flag of a DATA packet whose sender waits on its ACK (a message's last
/// segment, a resend), as RoCE's AckReq bit: the receiver acknowledges it
/// at the end of its receive batch instead of holding the ACK for more packets.
/// Other bits are reserved: sent as 0, ignored on receipt.
pub const FLAG_ACK_REQ: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub ptype: PacketType,
    /// `FLAG_ACK_REQ` on DATA; reserved bits are 0.
    pub flags: u8,
    /// The sender's path (socket) index.
    pub path: u8,
    /// Incremented each time the sender rotates that path's source port.
    pub epoch: u16,
    /// The receiver's connection token (0 before the handshake gives one).
    pub dst_token: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub src_token: u64,
    pub incarnation: u64,
    pub cookie: [u8; 16],
    pub cookie_time: u32,
    pub paths: u8,
    pub mss: u16,
    pub credit_window: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub echo_token: u64,
    pub cookie: [u8; 16],
    pub cookie_time: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accept {
    pub src_token: u64,
    pub incarnation: u64,
    pub paths: u8,
    pub mss: u16,
    pub credit_window: u32,
}

/// What a DATA packet carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataKind {
    /// A segment of an eager message (sent without waiting for the receiver).
    Eager = 0,
    /// Request to send a rendezvous message: its header, no payload.
    Rts = 1,
    /// A segment of a rendezvous message, after the receiver cleared it.
    Rndv = 2,
    /// Clear to send: the receiver matched message `msg`, takes `msg_len` bytes.
    Cts = 3,
    /// A path probe: carries nothing, is acknowledged like any packet.
    Ping = 4,
}

impl DataKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Eager,
            1 => Self::Rts,
            2 => Self::Rndv,
            3 => Self::Cts,
            4 => Self::Ping,
            _ => return None,
        })
    }
}

pub const MFLAG_TAGGED: u8 = 1;
pub const MFLAG_CQ_DATA: u8 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHeader {
    pub psn: u32,
    pub msg: u32,
    pub offset: u32,
    pub msg_len: u32,
    pub tag: u64,
    pub cq_data: u64,
    pub kind: DataKind,
    pub mflags: u8,
    /// psn - floor_delta is the oldest PSN the sender still waits for on this
    /// path: the receiver moves its cumulative point up to it (PSNs given up as
    /// lost are never sent again: their frames go out under new PSNs).
    pub floor_delta: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AckEntry {
    pub path: u8,
    pub epoch: u16,
    /// Next expected PSN: every PSN below it was received.
    pub cum: u32,
    /// CE-marked packets received on this path (cumulative, wraps).
    pub ce: u32,
    /// Packets received on this path (cumulative, wraps).
    pub rcvd: u32,
    /// Bit i set: PSN cum + 1 + i was received.
    pub sack: [u8; 32],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    /// The receiver's fair share for this sender, Mbit/s (0 = no limit).
    pub rate_hint_mbps: u32,
    /// Cumulative eager bytes the sender may have started.
    pub credit: u64,
    pub entries: Vec<AckEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body<'a> {
    Hello(Hello),
    Challenge(Challenge),
    Accept(Accept),
    Data(DataHeader, &'a [u8]),
    Ack(Ack),
    Close,
    Reset { token: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    pub header: Header,
    pub body: Body<'a>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() - self.pos < n {
            return Err(DecodeError::Malformed(what));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
}

/// Decode one datagram. Never panics, whatever the bytes.
pub fn decode(datagram: &[u8]) -> Result<Packet<'_>, DecodeError> {
    if datagram.len() < HEADER_LEN + CRC_LEN {
        return Err(DecodeError::TooShort);
    }
    let (content, crc) = datagram.split_at(datagram.len() - CRC_LEN);
    if u16::from_be_bytes([content[0], content[1]]) != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    if u32::from_be_bytes(crc.try_into().unwrap()) != crc32c::crc32c(content) {
        return Err(DecodeError::BadCrc);
    }
    if content[2] != VERSION {
        return Err(DecodeError::BadVersion(content[2]));
    }
    let ptype = PacketType::from_u8(content[3]).ok_or(DecodeError::BadType(content[3]))?;
    let mut r = Reader { buf: content, pos: 4 };
    let flags = r.u8("flags")?;
    let path = r.u8("path")?;
    let epoch = r.u16("epoch")?;
    let dst_token = r.u64("token")?;
    let header = Header { ptype, flags, path, epoch, dst_token };
    let body = match ptype {
        PacketType::Hello => {
            if datagram.len() < MIN_HELLO_LEN {
                return Err(DecodeError::Malformed("HELLO shorter than its padded size"));
            }
            let src_token = r.u64("hello token")?;
            let incarnation = r.u64("hello incarnation")?;
            let cookie: [u8; 16] = r.take(16, "hello cookie")?.try_into().unwrap();
            let cookie_time = r.u32("hello cookie time")?;
            let paths = r.u8("hello paths")?;
            r.u8("hello pad")?;
            let mss = r.u16("hello mss")?;
            let credit_window = r.u32("hello credit")?;
            Body::Hello(Hello { src_token, incarnation, cookie, cookie_time, paths, mss, credit_window })
        }
        PacketType::Challenge => Body::Challenge(Challenge {
            echo_token: r.u64("challenge token")?,
            cookie: r.take(16, "challenge cookie")?.try_into().unwrap(),
            cookie_time: r.u32("challenge time")?,
        }),
        PacketType::Accept => {
            let src_token = r.u64("accept token")?;
            let incarnation = r.u64("accept incarnation")?;
            let paths = r.u8("accept paths")?;
            r.u8("accept pad")?;
            let mss = r.u16("accept mss")?;
            let credit_window = r.u32("accept credit")?;
            Body::Accept(Accept { src_token, incarnation, paths, mss, credit_window })
        }
        PacketType::Data => {
            let psn = r.u32("psn")?;
            let msg = r.u32("msg")?;
            let offset = r.u32("offset")?;
            let msg_len = r.u32("msg_len")?;
            let tag = r.u64("tag")?;
            let cq_data = r.u64("cq_data")?;
            let kind_raw = r.u8("kind")?;
            let kind = DataKind::from_u8(kind_raw).ok_or(DecodeError::Malformed("data kind"))?;
            let mflags = r.u8("mflags")?;
            let floor_delta = r.u16("floor delta")?;
            let payload = r.rest();
            if (offset as u64) + (payload.len() as u64) > msg_len as u64 && matches!(kind, DataKind::Eager | DataKind::Rndv) {
                return Err(DecodeError::Malformed("segment beyond its message length"));
            }
            Body::Data(DataHeader { psn, msg, offset, msg_len, tag, cq_data, kind, mflags, floor_delta }, payload)
        }
        PacketType::Ack => {
            let rate_hint_mbps = r.u32("ack rate")?;
            let credit = r.u64("ack credit")?;
            let n = r.u8("ack entries")? as usize;
            r.take(3, "ack pad")?;
            let mut entries = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                let path = r.u8("entry path")?;
                r.u8("entry pad")?;
                let epoch = r.u16("entry epoch")?;
                let cum = r.u32("entry cum")?;
                let ce = r.u32("entry ce")?;
                let rcvd = r.u32("entry rcvd")?;
                let sack: [u8; 32] = r.take(32, "entry sack")?.try_into().unwrap();
                entries.push(AckEntry { path, epoch, cum, ce, rcvd, sack });
            }
            Body::Ack(Ack { rate_hint_mbps, credit, entries })
        }
        PacketType::Close => Body::Close,
        PacketType::Reset => Body::Reset { token: r.u64("reset token")? },
    };
    Ok(Packet { header, body })
}

/// Writes one packet into a caller's buffer; `finish` appends the CRC.
pub struct Writer<'b> {
    buf: &'b mut [u8],
    len: usize,
}

impl<'b> Writer<'b> {
    pub fn new(buf: &'b mut [u8], header: &Header) -> Self {
        let mut w = Writer { buf, len: 0 };
        w.u16(MAGIC);
        w.u8(VERSION);
        w.u8(header.ptype as u8);
        w.u8(header.flags);
        w.u8(header.path);
        w.u16(header.epoch);
        w.u64(header.dst_token);
        w
    }
    pub fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }
    pub fn u16(&mut self, v: u16) {
        self.bytes(&v.to_be_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.bytes(&v.to_be_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.bytes(&v.to_be_bytes());
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.buf[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
    }
    pub fn pad_to(&mut self, total_with_crc: usize) {
        while self.len + CRC_LEN < total_with_crc {
            self.u8(0);
        }
    }
    /// Mutable access to the next `n` bytes (payload copied in place).
    pub fn space(&mut self, n: usize) -> &mut [u8] {
        let s = &mut self.buf[self.len..self.len + n];
        self.len += n;
        s
    }
    pub fn finish(mut self) -> usize {
        let crc = crc32c::crc32c(&self.buf[..self.len]);
        self.u32(crc);
        self.len
    }
}

pub fn write_hello(buf: &mut [u8], h: &Header, b: &Hello) -> usize {
    let mut w = Writer::new(buf, h);
    w.u64(b.src_token);
    w.u64(b.incarnation);
    w.bytes(&b.cookie);
    w.u32(b.cookie_time);
    w.u8(b.paths);
    w.u8(0);
    w.u16(b.mss);
    w.u32(b.credit_window);
    w.pad_to(MIN_HELLO_LEN);
    w.finish()
}

pub fn write_challenge(buf: &mut [u8], h: &Header, b: &Challenge) -> usize {
    let mut w = Writer::new(buf, h);
    w.u64(b.echo_token);
    w.bytes(&b.cookie);
    w.u32(b.cookie_time);
    w.finish()
}

pub fn write_accept(buf: &mut [u8], h: &Header, b: &Accept) -> usize {
    let mut w = Writer::new(buf, h);
    w.u64(b.src_token);
    w.u64(b.incarnation);
    w.u8(b.paths);
    w.u8(0);
    w.u16(b.mss);
    w.u32(b.credit_window);
    w.finish()
}

/// Writes a DATA packet; `fill` copies the payload into the space given.
pub fn write_data(buf: &mut [u8], h: &Header, d: &DataHeader, payload_len: usize, fill: impl FnOnce(&mut [u8])) -> usize {
    let mut w = Writer::new(buf, h);
    w.u32(d.psn);
    w.u32(d.msg);
    w.u32(d.offset);
    w.u32(d.msg_len);
    w.u64(d.tag);
    w.u64(d.cq_data);
    w.u8(d.kind as u8);
    w.u8(d.mflags);
    w.u16(d.floor_delta);
    fill(w.space(payload_len));
    w.finish()
}

pub fn write_ack(buf: &mut [u8], h: &Header, a: &Ack) -> usize {
    let mut w = Writer::new(buf, h);
    w.u32(a.rate_hint_mbps);
    w.u64(a.credit);
    w.u8(a.entries.len() as u8);
    w.bytes(&[0; 3]);
    for e in &a.entries {
        w.u8(e.path);
        w.u8(0);
        w.u16(e.epoch);
        w.u32(e.cum);
        w.u32(e.ce);
        w.u32(e.rcvd);
        w.bytes(&e.sack);
    }
    w.finish()
}

pub fn write_close(buf: &mut [u8], h: &Header) -> usize {
    Writer::new(buf, h).finish()
}

pub fn write_reset(buf: &mut [u8], h: &Header, token: u64) -> usize {
    let mut w = Writer::new(buf, h);
    w.u64(token);
    w.finish()
}

/// Bytes of a DATA packet beyond its payload.
pub const DATA_OVERHEAD: usize = HEADER_LEN + DATA_HEADER_LEN + CRC_LEN;

/// Largest ACK entries that fit one datagram of `mtu` (IPv6 worst case).
pub fn max_ack_entries(mtu: usize) -> usize {
    ((mtu - IPV6_UDP_OVERHEAD - HEADER_LEN - ACK_FIXED_LEN - CRC_LEN) / ACK_ENTRY_LEN).min(255)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(t: PacketType) -> Header {
        Header { ptype: t, flags: 0, path: 3, epoch: 7, dst_token: 0xfeed }
    }

    #[test]
    fn data_round_trip_and_crc() {
        let mut buf = [0u8; 2048];
        let d = DataHeader {
            psn: 9,
            msg: 4,
            offset: 100,
            msg_len: 200,
            tag: 0xabc,
            cq_data: 5,
            kind: DataKind::Eager,
            mflags: MFLAG_TAGGED,
            floor_delta: 3,
        };
        let n = write_data(&mut buf, &hdr(PacketType::Data), &d, 10, |s| s.copy_from_slice(b"0123456789"));
        assert_eq!(n, DATA_OVERHEAD + 10);
        let p = decode(&buf[..n]).unwrap();
        assert_eq!(p.header, hdr(PacketType::Data));
        assert_eq!(p.body, Body::Data(d, b"0123456789"));
        for i in 0..n {
            let mut bad = buf;
            bad[i] ^= 0x10;
            assert!(decode(&bad[..n]).is_err(), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn hello_is_padded_and_challenge_is_not_larger() {
        let mut buf = [0u8; 256];
        let h = Hello { src_token: 1, incarnation: 2, cookie: [3; 16], cookie_time: 4, paths: 8, mss: 1400, credit_window: 1 << 20 };
        let n = write_hello(&mut buf, &hdr(PacketType::Hello), &h);
        assert_eq!(n, MIN_HELLO_LEN);
        assert_eq!(decode(&buf[..n]).unwrap().body, Body::Hello(h));
        let mut buf2 = [0u8; 256];
        let c = write_challenge(&mut buf2, &hdr(PacketType::Challenge), &Challenge { echo_token: 1, cookie: [0; 16], cookie_time: 0 });
        assert!(c <= MIN_HELLO_LEN);
    }

    #[test]
    fn ack_round_trip_and_fits_mtu() {
        let entries: Vec<AckEntry> =
            (0..max_ack_entries(1500)).map(|i| AckEntry { path: i as u8, epoch: 1, cum: 10, ce: 2, rcvd: 30, sack: [0xa5; 32] }).collect();
        assert!(entries.len() >= 16);
        let a = Ack { rate_hint_mbps: 100, credit: 1 << 40, entries };
        let mut buf = [0u8; 1500];
        let n = write_ack(&mut buf, &hdr(PacketType::Ack), &a);
        assert!(n + IPV6_UDP_OVERHEAD <= 1500);
        assert_eq!(decode(&buf[..n]).unwrap().body, Body::Ack(a));
    }

    #[test]
    fn segment_beyond_message_is_refused() {
        let mut buf = [0u8; 256];
        let d =
            DataHeader { psn: 0, msg: 0, offset: 95, msg_len: 100, tag: 0, cq_data: 0, kind: DataKind::Eager, mflags: 0, floor_delta: 0 };
        let n = write_data(&mut buf, &hdr(PacketType::Data), &d, 10, |_| {});
        assert_eq!(decode(&buf[..n]), Err(DecodeError::Malformed("segment beyond its message length")));
    }
}
