//! The C ABI (include/metaroce.h). Every entry point catches panics: a panic
//! becomes -MR_EIO and a failed endpoint, never an abort of the job.

#![allow(clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use metaroce_core::endpoint::MAX_MSG_SIZE;
use metaroce_core::{Completion, Error, OpKind, RecvBuf, SendBuf, ANY_PEER};

use crate::addr;
use crate::transport::Transport;

pub const MR_TAGGED: u32 = 1;
pub const MR_REMOTE_CQ_DATA: u32 = 2;
pub const MR_INJECT: u32 = 4;
pub const MR_NO_COMPLETION: u32 = 8;
pub const MR_CLAIM: u32 = 16;
pub const MR_DISCARD: u32 = 32;
pub const MR_SEND: u32 = 256;
pub const MR_RECV: u32 = 512;
const MAX_INJECT: usize = 4096;
const EIO: c_int = 5;
const EINVAL: c_int = 22;

#[repr(C)]
pub struct MrCompletion {
    pub context: *mut c_void,
    pub flags: u32,
    pub err: i32,
    pub len: u64,
    pub buf: *mut c_void,
    pub data: u64,
    pub tag: u64,
    pub peer: u64,
    pub olen: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct MrCounters {
    pub pkts_sent: u64,
    pub pkts_rcvd: u64,
    pub bytes_sent: u64,
    pub bytes_rcvd: u64,
    pub msgs_sent: u64,
    pub msgs_rcvd: u64,
    pub retransmits: u64,
    pub dup_rcvd: u64,
    pub sack_holes: u64,
    pub ce_rcvd: u64,
    pub ce_echoed: u64,
    pub rtos: u64,
    pub tlps: u64,
    pub path_rotations: u64,
    pub drops_crc: u64,
    pub drops_malformed: u64,
    pub drops_unknown_conn: u64,
    pub drops_stale: u64,
    pub rnr_waits: u64,
    pub conns_active: u64,
    pub conns_opened: u64,
    pub conns_failed: u64,
}

#[repr(C)]
pub struct MrPathStats {
    pub src_port: u16,
    pub state: u16,
    pub cwnd_bytes: u32,
    pub srtt_us: u32,
    pub rttvar_us: u32,
    pub inflight_bytes: u32,
    pub pkts_sent: u64,
    pub retransmits: u64,
    pub losses: u64,
    pub ce_echoed: u64,
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_error(msg: impl Into<String>) {
    LAST_ERROR.with(|e| *e.borrow_mut() = msg.into());
}

fn neg(e: Error) -> c_int {
    -e.errno()
}

/// Run an entry point: a panic is an I/O error with its message kept.
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
            set_error(format!("internal error (panic): {msg}"));
            -EIO
        }
    }
}

unsafe fn ep_ref<'a>(ep: *mut c_void) -> Option<&'a Transport> {
    (ep as *const Transport).as_ref()
}

macro_rules! ep_or_einval {
    ($ep:expr) => {
        match ep_ref($ep as *mut c_void) {
            Some(t) => t,
            None => {
                set_error("NULL endpoint");
                return -EINVAL;
            }
        }
    };
}

fn status(r: Result<(), Error>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => neg(e),
    }
}

#[no_mangle]
pub extern "C" fn mr_abi_version() -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn mr_max_inject() -> usize {
    MAX_INJECT
}

#[no_mangle]
pub extern "C" fn mr_max_msg_size() -> u64 {
    MAX_MSG_SIZE
}

#[no_mangle]
pub unsafe extern "C" fn mr_ep_open(config: *const c_char, out: *mut *mut c_void) -> c_int {
    guard(|| {
        if out.is_null() {
            set_error("mr_ep_open: out is NULL");
            return -EINVAL;
        }
        let cfg = if config.is_null() {
            None
        } else {
            match CStr::from_ptr(config).to_str() {
                Ok(s) => Some(s.to_owned()),
                Err(_) => {
                    set_error("config is not UTF-8");
                    return -EINVAL;
                }
            }
        };
        match Transport::open(cfg.as_deref()) {
            Ok(t) => {
                *out = Box::into_raw(Box::new(t)) as *mut c_void;
                0
            }
            Err(e) => {
                let code = if e.starts_with("config") || e.starts_with("MR_CONFIG") { -EINVAL } else { -EIO };
                set_error(e);
                code
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_ep_close(ep: *mut c_void) -> c_int {
    guard(|| {
        if ep.is_null() {
            return -EINVAL;
        }
        let t = Box::from_raw(ep as *mut Transport);
        t.close();
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_ep_name(ep: *mut c_void, out: *mut c_void, len: *mut usize) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if len.is_null() {
            return -EINVAL;
        }
        let have = *len;
        *len = addr::ADDR_LEN;
        if out.is_null() || have < addr::ADDR_LEN {
            set_error(format!("address buffer of {have} bytes, {} needed", addr::ADDR_LEN));
            return -(Error::Truncated.errno());
        }
        let b = addr::encode(&t.local_addr());
        std::ptr::copy_nonoverlapping(b.as_ptr(), out as *mut u8, b.len());
        0
    })
}

unsafe fn write_cstr(s: &str, buf: *mut c_char, buflen: usize) -> c_int {
    if buf.is_null() || buflen == 0 {
        return -EINVAL;
    }
    let n = s.len().min(buflen - 1);
    std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
    *buf.add(n) = 0;
    if n < s.len() {
        -(Error::Truncated.errno())
    } else {
        0
    }
}

#[no_mangle]
pub unsafe extern "C" fn mr_addr_format(a: *const c_void, len: usize, buf: *mut c_char, buflen: usize) -> c_int {
    guard(|| {
        if a.is_null() {
            return -EINVAL;
        }
        match addr::decode(std::slice::from_raw_parts(a as *const u8, len)) {
            Some(sa) => write_cstr(&addr::format(&sa), buf, buflen),
            None => {
                set_error("not a MetaRoCE address");
                -EINVAL
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_addr_parse(s: *const c_char, out: *mut c_void, len: *mut usize) -> c_int {
    guard(|| {
        if s.is_null() || len.is_null() {
            return -EINVAL;
        }
        let Some(sa) = CStr::from_ptr(s).to_str().ok().and_then(addr::parse) else {
            set_error("expected udp://IP:PORT");
            return -EINVAL;
        };
        let have = *len;
        *len = addr::ADDR_LEN;
        if out.is_null() || have < addr::ADDR_LEN {
            return -(Error::Truncated.errno());
        }
        std::ptr::copy_nonoverlapping(addr::encode(&sa).as_ptr(), out as *mut u8, addr::ADDR_LEN);
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_av_insert(ep: *mut c_void, a: *const c_void, len: usize, out: *mut u64) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if a.is_null() || out.is_null() {
            return -EINVAL;
        }
        let Some(sa) = addr::decode(std::slice::from_raw_parts(a as *const u8, len)) else {
            set_error(format!("av_insert: not a MetaRoCE address ({len} bytes)"));
            return -EINVAL;
        };
        match t.peer(sa) {
            Ok(p) => {
                *out = p;
                0
            }
            Err(e) => neg(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_av_remove(ep: *mut c_void, peer: u64) -> c_int {
    guard(|| status(ep_or_einval!(ep).remove_peer(peer)))
}

#[no_mangle]
pub unsafe extern "C" fn mr_av_lookup(ep: *mut c_void, peer: u64, out: *mut c_void, len: *mut usize) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if len.is_null() {
            return -EINVAL;
        }
        let Ok(Some(sa)) = t.peer_addr(peer) else { return -(Error::NoEntry.errno()) };
        let have = *len;
        *len = addr::ADDR_LEN;
        if out.is_null() || have < addr::ADDR_LEN {
            return -(Error::Truncated.errno());
        }
        std::ptr::copy_nonoverlapping(addr::encode(&sa).as_ptr(), out as *mut u8, addr::ADDR_LEN);
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_send(
    ep: *mut c_void,
    peer: u64,
    buf: *const c_void,
    len: usize,
    tag: u64,
    cq_data: u64,
    flags: u32,
    context: *mut c_void,
) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if buf.is_null() && len > 0 {
            return -EINVAL;
        }
        let inject = flags & MR_INJECT != 0;
        let sbuf = if inject {
            if len > MAX_INJECT {
                set_error(format!("inject of {len} bytes > mr_max_inject() = {MAX_INJECT}"));
                return -EINVAL;
            }
            SendBuf::owned(if len == 0 { Vec::new() } else { std::slice::from_raw_parts(buf as *const u8, len).to_vec() })
        } else {
            SendBuf::borrowed(buf as *const u8, len)
        };
        let cq = (flags & MR_REMOTE_CQ_DATA != 0).then_some(cq_data);
        let completion = !inject && flags & MR_NO_COMPLETION == 0;
        status(t.send(peer, sbuf, tag, flags & MR_TAGGED != 0, cq, context as u64, completion))
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_recv(
    ep: *mut c_void,
    peer: u64,
    buf: *mut c_void,
    len: usize,
    tag: u64,
    ignore: u64,
    flags: u32,
    context: *mut c_void,
) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if buf.is_null() && len > 0 {
            return -EINVAL;
        }
        let completion = flags & MR_NO_COMPLETION == 0;
        if flags & MR_CLAIM != 0 {
            let rbuf = (flags & MR_DISCARD == 0).then(|| RecvBuf::borrowed(buf as *mut u8, len));
            return status(t.recv_claimed(context as u64, rbuf, completion));
        }
        let rbuf = RecvBuf::borrowed(buf as *mut u8, len);
        status(t.recv(peer, rbuf, tag, ignore, flags & MR_TAGGED != 0, context as u64, completion))
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_peek(
    ep: *mut c_void,
    peer: u64,
    tag: u64,
    ignore: u64,
    flags: u32,
    context: *mut c_void,
    out: *mut MrCompletion,
) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        let claim = (flags & MR_CLAIM != 0).then_some(context as u64);
        match t.peek(peer, tag, ignore, flags & MR_TAGGED != 0, claim, flags & MR_DISCARD != 0 && flags & MR_CLAIM == 0) {
            Ok(info) => {
                if !out.is_null() {
                    let mut f = MR_RECV;
                    if info.tagged {
                        f |= MR_TAGGED;
                    }
                    if info.cq_data.is_some() {
                        f |= MR_REMOTE_CQ_DATA;
                    }
                    *out = MrCompletion {
                        context,
                        flags: f,
                        err: 0,
                        len: info.len,
                        buf: std::ptr::null_mut(),
                        data: info.cq_data.unwrap_or(0),
                        tag: info.tag,
                        peer: info.peer,
                        olen: 0,
                    };
                }
                0
            }
            Err(e) => neg(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_cancel(ep: *mut c_void, context: *mut c_void) -> c_int {
    guard(|| status(ep_or_einval!(ep).cancel(context as u64)))
}

fn to_c(c: Completion) -> MrCompletion {
    let mut flags = match c.kind {
        OpKind::Send => MR_SEND,
        OpKind::Recv => MR_RECV,
    };
    if c.tagged {
        flags |= MR_TAGGED;
    }
    if c.cq_data.is_some() {
        flags |= MR_REMOTE_CQ_DATA;
    }
    MrCompletion {
        context: c.context as *mut c_void,
        flags,
        err: c.err.map_or(0, neg),
        len: c.len,
        buf: c.buf.as_ref().map_or(std::ptr::null_mut(), |b| b.as_ptr() as *mut c_void),
        data: c.cq_data.unwrap_or(0),
        tag: c.tag,
        peer: if c.peer == ANY_PEER { u64::MAX } else { c.peer },
        olen: c.olen,
    }
}

#[no_mangle]
pub unsafe extern "C" fn mr_poll(ep: *mut c_void, out: *mut MrCompletion, max: usize) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if out.is_null() || max == 0 {
            return -EINVAL;
        }
        match t.poll(max.min(c_int::MAX as usize)) {
            Ok(v) => {
                let n = v.len();
                for (i, c) in v.into_iter().enumerate() {
                    *out.add(i) = to_c(c);
                }
                n as c_int
            }
            Err(e) => neg(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_wait(ep: *mut c_void, timeout_ms: c_int) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        let timeout = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
        match t.wait(timeout) {
            Ok(true) => 0,
            Ok(false) => -(Error::Again.errno()),
            Err(e) => neg(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_ep_fd(ep: *mut c_void) -> c_int {
    guard(|| ep_or_einval!(ep).cq_fd())
}

#[no_mangle]
pub unsafe extern "C" fn mr_progress(ep: *mut c_void) -> c_int {
    guard(|| match ep_or_einval!(ep).progress() {
        Ok(pending) => pending.min(c_int::MAX as usize) as c_int,
        Err(e) => neg(e),
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_progress_release(ep: *mut c_void) -> c_int {
    guard(|| {
        ep_or_einval!(ep).release_progress();
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_get_counters(ep: *mut c_void, out: *mut MrCounters) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if out.is_null() {
            return -EINVAL;
        }
        let Ok((c, io)) = t.counters() else { return -EIO };
        *out = MrCounters {
            pkts_sent: c.pkts_sent,
            pkts_rcvd: c.pkts_rcvd,
            bytes_sent: c.bytes_sent,
            bytes_rcvd: c.bytes_rcvd,
            msgs_sent: c.msgs_sent,
            msgs_rcvd: c.msgs_rcvd,
            retransmits: c.retransmits,
            dup_rcvd: c.dup_rcvd,
            sack_holes: c.sack_holes,
            ce_rcvd: c.ce_rcvd,
            ce_echoed: c.ce_echoed,
            rtos: c.rtos,
            tlps: c.tlps,
            path_rotations: c.path_rotations,
            drops_crc: c.drops_crc,
            drops_malformed: c.drops_malformed + c.drops_version,
            drops_unknown_conn: c.drops_unknown_conn,
            drops_stale: c.drops_stale,
            rnr_waits: c.rnr_waits,
            conns_active: io.conns_active,
            conns_opened: c.conns_opened,
            conns_failed: c.conns_failed,
        };
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_get_path_stats(ep: *mut c_void, peer: u64, out: *mut MrPathStats, max: usize) -> c_int {
    guard(|| {
        let t = ep_or_einval!(ep);
        if out.is_null() {
            return -EINVAL;
        }
        let Ok(v) = t.path_stats(peer) else { return -EIO };
        let n = v.len().min(max);
        for (i, (port, p)) in v.into_iter().take(n).enumerate() {
            *out.add(i) = MrPathStats {
                src_port: port,
                state: u16::from(p.failed) * 2,
                cwnd_bytes: p.cwnd.min(u32::MAX as u64) as u32,
                srtt_us: p.srtt_us.min(u32::MAX as u64) as u32,
                rttvar_us: p.rttvar_us.min(u32::MAX as u64) as u32,
                inflight_bytes: p.inflight.min(u32::MAX as u64) as u32,
                pkts_sent: p.pkts_sent,
                retransmits: p.retransmits,
                losses: p.losses,
                ce_echoed: p.ce_echoed,
            };
        }
        n as c_int
    })
}

#[no_mangle]
pub unsafe extern "C" fn mr_last_error(buf: *mut c_char, len: usize) -> usize {
    let s = LAST_ERROR.with(|e| e.borrow().clone());
    if !buf.is_null() && len > 0 {
        let _ = write_cstr(&s, buf, len);
    }
    s.len()
}

#[no_mangle]
pub extern "C" fn mr_strerror(err: c_int) -> *const c_char {
    let s: &'static [u8] = match err.unsigned_abs() {
        0 => b"success\0",
        11 => b"no resources now: retry after progress\0",
        22 => b"invalid argument or configuration (see mr_last_error)\0",
        12 => b"out of memory\0",
        2 => b"no such entry\0",
        42 => b"no matching message\0",
        5 => b"endpoint failed (I/O error or internal error)\0",
        110 => b"peer unreachable: no acknowledgement within abort_timeout\0",
        104 => b"peer restarted or closed the connection\0",
        125 => b"canceled\0",
        265 => b"message truncated: longer than the receive buffer\0",
        _ => b"unknown error\0",
    };
    s.as_ptr() as *const c_char
}
