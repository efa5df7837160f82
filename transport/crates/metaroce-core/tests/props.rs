//! Property: for any impairment seed, every message arrives exactly once and
//! intact, in both directions at once.

mod util;

use metaroce_core::time::SEC;
use metaroce_core::{Config, RecvBuf, SendBuf};
use proptest::prelude::*;
use util::{pattern, Link, Sim};

fn run(seed: u64, loss: f64, dup: f64, burst: bool, sizes: &[usize]) {
    let mut links: Vec<Link> = [15, 60, 200, 700].iter().map(|d| Link::new(*d, 31.25)).collect();
    for l in &mut links {
        l.loss = loss;
        l.dup = dup;
        if burst {
            l.burst_enter = 0.002;
            l.burst_leave = 0.25;
            l.burst_loss = 0.7;
        }
    }
    let mut sim = Sim::two(Config { paths: 6, ..Config::default() }, links, seed);
    let p01 = sim.eps[0].peer(sim.addrs[1]);
    let p10 = sim.eps[1].peer(sim.addrs[0]);
    for (i, &n) in sizes.iter().enumerate() {
        let i = i as u64;
        sim.eps[1].recv(p10, RecvBuf::owned(n), i, 0, true, i, true).unwrap();
        sim.eps[0].recv(p01, RecvBuf::owned(n), i, 0, true, i, true).unwrap();
        sim.eps[0].send(sim.now, p01, SendBuf::owned(pattern(i, n)), i, true, None, i, true).unwrap();
        sim.eps[1].send(sim.now, p10, SendBuf::owned(pattern(i + 1000, n)), i, true, None, i, true).unwrap();
    }
    let want = sizes.len();
    let mut got = [vec![0u32; want], vec![0u32; want]];
    let mut sends = [0usize; 2];
    let ok = sim.run_until(120 * SEC, |s| {
        for (e, ep) in s.eps.iter_mut().enumerate() {
            while let Some(c) = ep.poll_completion() {
                assert_eq!(c.err, None, "seed {seed}: {c:?}");
                match c.kind {
                    metaroce_core::OpKind::Send => sends[e] += 1,
                    metaroce_core::OpKind::Recv => {
                        let i = c.tag as usize;
                        got[e][i] += 1;
                        let base = if e == 1 { 0 } else { 1000 };
                        assert!(
                            c.buf.unwrap().into_vec().unwrap() == pattern(i as u64 + base, sizes[i]),
                            "seed {seed}: message {i} corrupted"
                        );
                    }
                }
            }
        }
        sends == [want, want] && got.iter().all(|g| g.iter().all(|n| *n >= 1))
    });
    assert!(ok, "seed {seed}: incomplete: sends {sends:?}; {:?} {:?}", sim.eps[0].counters(), sim.eps[1].counters());
    assert!(got.iter().all(|g| g.iter().all(|n| *n == 1)), "seed {seed}: a message was delivered twice");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn exactly_once_and_intact(seed in any::<u64>(), loss in 0.0f64..0.15, dup in 0.0f64..0.05, burst in any::<bool>(),
                               sizes in prop::collection::vec(prop_oneof![0usize..3000, 60_000usize..70_000, 200_000usize..400_000], 1..12)) {
        run(seed, loss, dup, burst, &sizes);
    }
}
