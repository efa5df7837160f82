//! Coverage-guided fuzzing of the packet parser, the handshake and a live
//! connection (raw datagrams, and DATA/ACK packets with a valid token and CRC
//! but altered fields): see crates/metaroce-core/tests/harness/fuzz.rs.
#![no_main]

#[path = "../../crates/metaroce-core/tests/harness/fuzz.rs"]
mod fuzz_harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_harness::run(data);
});
