//! An endpoint's name on the wire of the job (what libfabric's av_insert and
//! getname carry): MR_ADDR_LEN = 24 bytes.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | format version (1) |
//! | 1 | 1 | family: 4 or 6 |
//! | 2 | 2 | UDP port of the endpoint's receiving socket, big-endian |
//! | 4 | 16 | IPv6 address, or IPv4 in the first 4 bytes |
//! | 20 | 4 | zero |

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const ADDR_LEN: usize = 24;

pub fn encode(a: &SocketAddr) -> [u8; ADDR_LEN] {
    let mut b = [0u8; ADDR_LEN];
    b[0] = 1;
    b[2..4].copy_from_slice(&a.port().to_be_bytes());
    match a.ip() {
        IpAddr::V4(ip) => {
            b[1] = 4;
            b[4..8].copy_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            b[1] = 6;
            b[4..20].copy_from_slice(&ip.octets());
        }
    }
    b
}

pub fn decode(b: &[u8]) -> Option<SocketAddr> {
    if b.len() < ADDR_LEN || b[0] != 1 || b[20..24] != [0; 4] {
        return None;
    }
    let port = u16::from_be_bytes([b[2], b[3]]);
    let ip = match b[1] {
        4 => IpAddr::V4(Ipv4Addr::new(b[4], b[5], b[6], b[7])),
        6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[4..20]).ok()?)),
        _ => return None,
    };
    (port != 0).then_some(SocketAddr::new(ip, port))
}

/// "udp://10.0.0.1:20000" or "udp://[fe80::1]:20000".
pub fn format(a: &SocketAddr) -> String {
    format!("udp://{a}")
}

pub fn parse(s: &str) -> Option<SocketAddr> {
    s.strip_prefix("udp://").unwrap_or(s).parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        for s in ["10.1.2.3:20000", "[fd00::5]:9"] {
            let a: SocketAddr = s.parse().unwrap();
            assert_eq!(decode(&encode(&a)), Some(a));
            assert_eq!(parse(&format(&a)), Some(a));
        }
        assert_eq!(decode(&[0u8; 24]), None);
        assert_eq!(decode(&[1u8; 10]), None);
    }
}
