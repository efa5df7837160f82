//! Stateless handshake cookies: a keyed hash of the client's address, token and
//! incarnation and a coarse time, so a server keeps no state for a HELLO until
//! the client proves it receives at its address.

use std::hash::Hasher;
use std::net::SocketAddr;

use siphasher::sip128::{Hasher128, SipHasher13};

/// Cookies older than this (in cookie-time seconds) are refused.
pub const COOKIE_LIFETIME_S: u32 = 10;

#[derive(Clone, Debug)]
pub struct CookieKey {
    k0: u64,
    k1: u64,
}

impl CookieKey {
    pub fn new(k0: u64, k1: u64) -> Self {
        Self { k0, k1 }
    }

    pub fn make(&self, addr: &SocketAddr, token: u64, incarnation: u64, time_s: u32) -> [u8; 16] {
        let mut h = SipHasher13::new_with_keys(self.k0, self.k1);
        match addr {
            SocketAddr::V4(a) => h.write(&a.ip().to_ipv6_mapped().octets()),
            SocketAddr::V6(a) => h.write(&a.ip().octets()),
        }
        h.write(&addr.port().to_be_bytes());
        h.write(&token.to_be_bytes());
        h.write(&incarnation.to_be_bytes());
        h.write(&time_s.to_be_bytes());
        h.finish128().as_bytes()
    }

    pub fn verify(&self, addr: &SocketAddr, token: u64, incarnation: u64, time_s: u32, now_s: u32, cookie: &[u8; 16]) -> bool {
        now_s.wrapping_sub(time_s) <= COOKIE_LIFETIME_S && self.make(addr, token, incarnation, time_s) == *cookie
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_binds_address_token_and_time() {
        let k = CookieKey::new(1, 2);
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:5000".parse().unwrap();
        let c = k.make(&a, 7, 9, 100);
        assert!(k.verify(&a, 7, 9, 100, 105, &c));
        assert!(!k.verify(&b, 7, 9, 100, 105, &c), "another address");
        assert!(!k.verify(&a, 8, 9, 100, 105, &c), "another token");
        assert!(!k.verify(&a, 7, 10, 100, 105, &c), "another incarnation");
        assert!(!k.verify(&a, 7, 9, 100, 100 + COOKIE_LIFETIME_S + 1, &c), "expired");
        assert!(!CookieKey::new(3, 4).verify(&a, 7, 9, 100, 105, &c), "another key");
    }
}
