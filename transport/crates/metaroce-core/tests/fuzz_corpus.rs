//! Replays the committed fuzz corpus (transport/fuzz/corpus/*) on stable, and a
//! seeded stream of random and mutated inputs, through the fuzz harness.

#[path = "harness/fuzz.rs"]
mod fuzz_harness;
mod util;

use std::path::PathBuf;

#[test]
fn committed_corpus_replays_without_panics_or_corruption() {
    // Read at run time (cargo sets it for the test too): a binary the shared
    // target directory kept from another checkout has that checkout's path baked in.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    let dir = PathBuf::from(manifest).join("../../fuzz/corpus");
    let mut n = 0;
    for target in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        for f in std::fs::read_dir(target.unwrap().path()).unwrap() {
            let data = std::fs::read(f.unwrap().path()).unwrap();
            let _ = fuzz_harness::run(&data);
            n += 1;
        }
    }
    assert!(n >= 10, "only {n} corpus files under {}", dir.display());
}

#[test]
fn seeded_random_and_mutated_inputs() {
    let mut rng = util::Rng(0x5eed);
    let (mut dropped, mut delivered) = (0, 0);
    for round in 0..300 {
        let len = (rng.below(3000) + 3) as usize;
        let mut data: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        if round % 3 == 0 {
            // Mostly structured records (modes 1 and 2) with few raw ones.
            for i in (0..data.len()).step_by(97) {
                data[i] = 1 + (rng.below(2) as u8);
            }
        }
        let c = fuzz_harness::run(&data);
        dropped += c.drops_crc + c.drops_malformed + c.drops_stale + c.drops_unknown_conn + c.dup_rcvd;
        delivered += c.msgs_rcvd;
    }
    assert!(dropped > 100 && delivered > 100, "the harness did not exercise drops ({dropped}) or transfers ({delivered})");
}
