//! UDP sockets, one per path: DF set (a fragment hashes on addresses only and
//! would defeat spraying), ECT set per packet and the TOS read back, buffers
//! sized and what the host allowed reported, batched sendmmsg/recvmmsg.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

pub const BATCH: usize = 32;
pub const MAX_DATAGRAM: usize = 9216;
const ECT0: u8 = 0b10;
const CE: u8 = 0b11;

pub struct PathSocket {
    fd: OwnedFd,
    pub local: SocketAddr,
    pub v6: bool,
    /// What the kernel granted for SO_RCVBUF / SO_SNDBUF (it may cap them).
    pub rcvbuf: usize,
    pub sndbuf: usize,
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setopt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, v: T) -> io::Result<()> {
    // SAFETY: v is a plain value of the size we pass.
    cvt(unsafe { libc::setsockopt(fd, level, name, &v as *const T as *const libc::c_void, size_of::<T>() as libc::socklen_t) })?;
    Ok(())
}

fn getopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: v and len are valid for writing.
    cvt(unsafe { libc::getsockopt(fd, level, name, &mut v as *mut _ as *mut libc::c_void, &mut len) })?;
    Ok(v)
}

pub fn to_sockaddr(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match a {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

pub fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match ss.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in.
            let sin = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a sockaddr_in6.
            let sin6 = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(ip, u16::from_be(sin6.sin6_port), 0, sin6.sin6_scope_id)))
        }
        _ => None,
    }
}

impl PathSocket {
    /// Bind a UDP socket at `ip:port` (0 = ephemeral) with DF, TOS reporting and buffers.
    pub fn bind(ip: IpAddr, port: u16, buf_bytes: usize) -> io::Result<Self> {
        let v6 = ip.is_ipv6();
        let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
        // SAFETY: plain syscall; the fd is owned right after.
        let raw = cvt(unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) })?;
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let r = fd.as_raw_fd();
        if v6 {
            setopt(r, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DO)?;
            setopt(r, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1 as libc::c_int)?;
            setopt(r, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1 as libc::c_int)?;
        } else {
            setopt(r, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)?;
            setopt(r, libc::IPPROTO_IP, libc::IP_RECVTOS, 1 as libc::c_int)?;
        }
        let want = buf_bytes.min(i32::MAX as usize) as libc::c_int;
        // SO_*BUFFORCE needs CAP_NET_ADMIN; fall back to what rmem_max allows.
        if setopt(r, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, want).is_err() {
            setopt(r, libc::SOL_SOCKET, libc::SO_RCVBUF, want)?;
        }
        if setopt(r, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, want).is_err() {
            setopt(r, libc::SOL_SOCKET, libc::SO_SNDBUF, want)?;
        }
        let (ss, len) = to_sockaddr(&SocketAddr::new(ip, port));
        // SAFETY: ss/len describe a valid address.
        cvt(unsafe { libc::bind(r, &ss as *const _ as *const libc::sockaddr, len) })?;
        // SAFETY: all-zero storage, len valid.
        let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
        let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        cvt(unsafe { libc::getsockname(r, &mut ss as *mut _ as *mut libc::sockaddr, &mut len) })?;
        let local = from_sockaddr(&ss).ok_or_else(|| io::Error::other("getsockname: unknown family"))?;
        // The kernel reports twice what it grants (bookkeeping): halve it.
        let rcvbuf = getopt_int(r, libc::SOL_SOCKET, libc::SO_RCVBUF)? as usize / 2;
        let sndbuf = getopt_int(r, libc::SOL_SOCKET, libc::SO_SNDBUF)? as usize / 2;
        Ok(Self { fd, local, v6, rcvbuf, sndbuf })
    }

    /// Have the kernel stamp each received datagram with its arrival time
    /// (CLOCK_REALTIME), handed to `recv_batch`'s callback.
    pub fn set_rx_timestamps(&self, on: bool) -> io::Result<()> {
        setopt(self.raw(), libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, on as libc::c_int)
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Send a batch; returns how many went (the rest: the socket buffer is full).
    pub fn send_batch(&self, pkts: &[(SocketAddr, u8, &[u8])]) -> io::Result<usize> {
        let n = pkts.len().min(BATCH);
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: zeroed C structs, filled below, all pointers live for the call.
        let mut addrs: [libc::sockaddr_storage; BATCH] = unsafe { zeroed() };
        let mut iovs: [libc::iovec; BATCH] = unsafe { zeroed() };
        let mut cmsgs = [[0u64; 4]; BATCH];
        let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { zeroed() };
        for i in 0..n {
            let (dest, tos, data) = pkts[i];
            let (ss, len) = to_sockaddr(&dest);
            addrs[i] = ss;
            iovs[i] = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
            let h = &mut hdrs[i].msg_hdr;
            h.msg_name = &mut addrs[i] as *mut _ as *mut libc::c_void;
            h.msg_namelen = len;
            h.msg_iov = &mut iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = cmsgs[i].as_mut_ptr() as *mut libc::c_void;
            // SAFETY: CMSG macros over a buffer of CMSG_SPACE(sizeof(int)) bytes.
            unsafe {
                h.msg_controllen = libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) as usize;
                let c = libc::CMSG_FIRSTHDR(h);
                if self.v6 {
                    (*c).cmsg_level = libc::IPPROTO_IPV6;
                    (*c).cmsg_type = libc::IPV6_TCLASS;
                } else {
                    (*c).cmsg_level = libc::IPPROTO_IP;
                    (*c).cmsg_type = libc::IP_TOS;
                }
                (*c).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, tos as libc::c_int);
            }
        }
        // SAFETY: hdrs[..n] are fully initialised.
        let r = unsafe { libc::sendmmsg(self.raw(), hdrs.as_mut_ptr(), n as u32, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(0);
            }
            return Err(e);
        }
        Ok(r as usize)
    }

    /// Receive up to BATCH datagrams into `bufs`; calls `f(from, ce, arrived_ns, bytes)`
    /// for each (`arrived_ns`: the kernel's receive time when `set_rx_timestamps` is on).
    pub fn recv_batch(
        &self,
        bufs: &mut [[u8; MAX_DATAGRAM]],
        mut f: impl FnMut(SocketAddr, bool, Option<u64>, &[u8]),
    ) -> io::Result<usize> {
        let n = bufs.len().min(BATCH);
        // SAFETY: zeroed C structs, filled below, pointers live for the call.
        let mut addrs: [libc::sockaddr_storage; BATCH] = unsafe { zeroed() };
        let mut iovs: [libc::iovec; BATCH] = unsafe { zeroed() };
        // Room for IP_TOS (24 bytes) and SCM_TIMESTAMPNS (32).
        let mut cmsgs = [[0u64; 12]; BATCH];
        let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { zeroed() };
        for i in 0..n {
            iovs[i] = libc::iovec { iov_base: bufs[i].as_mut_ptr() as *mut libc::c_void, iov_len: MAX_DATAGRAM };
            let h = &mut hdrs[i].msg_hdr;
            h.msg_name = &mut addrs[i] as *mut _ as *mut libc::c_void;
            h.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_iov = &mut iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = cmsgs[i].as_mut_ptr() as *mut libc::c_void;
            h.msg_controllen = size_of::<[u64; 12]>();
        }
        // SAFETY: hdrs[..n] initialised; MSG_DONTWAIT on a nonblocking socket.
        let r = unsafe { libc::recvmmsg(self.raw(), hdrs.as_mut_ptr(), n as u32, libc::MSG_DONTWAIT, std::ptr::null_mut()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(0);
            }
            return Err(e);
        }
        for i in 0..r as usize {
            let h = &hdrs[i].msg_hdr;
            let mut tos = 0u8;
            let mut arrived = None;
            // SAFETY: walking the control buffer the kernel filled.
            unsafe {
                let mut c = libc::CMSG_FIRSTHDR(h);
                while !c.is_null() {
                    let (l, t) = ((*c).cmsg_level, (*c).cmsg_type);
                    if (l == libc::IPPROTO_IP && t == libc::IP_TOS) || (l == libc::IPPROTO_IPV6 && t == libc::IPV6_TCLASS) {
                        tos = if l == libc::IPPROTO_IP {
                            *libc::CMSG_DATA(c)
                        } else {
                            std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int) as u8
                        };
                    } else if l == libc::SOL_SOCKET && t == libc::SCM_TIMESTAMPNS {
                        let ts = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::timespec);
                        arrived = Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
                    }
                    c = libc::CMSG_NXTHDR(h, c);
                }
            }
            if let Some(from) = from_sockaddr(&addrs[i]) {
                f(from, tos & CE == CE, arrived, &bufs[i][..hdrs[i].msg_len as usize]);
            }
        }
        Ok(r as usize)
    }
}

pub fn tos(dscp: u8, ect: bool) -> u8 {
    (dscp << 2) | if ect { ECT0 } else { 0 }
}
