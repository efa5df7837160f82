//! The protocol core under a deterministic impairment model: every test is a
//! seeded replay of loss, reordering, duplication, CE marks and timers.

mod util;

use metaroce_core::time::{Micros, MS, SEC};
use metaroce_core::{Completion, Config, Error, OpKind, RecvBuf, SendBuf, ANY_PEER};
use util::{four_links, pattern, Link, Sim};

fn cfg() -> Config {
    Config { paths: 8, ..Config::default() }
}

#[derive(Debug, Default)]
struct Outcome {
    sends: Vec<Completion>,
    recvs: Vec<Completion>,
    took: Micros,
}

/// Send `sizes` from endpoint `from` to `to` (tag = index), with receives posted
/// first; run until all complete. Verifies data, lengths and exactly-once.
fn transfer(sim: &mut Sim, from: usize, to: usize, sizes: &[usize], limit: Micros) -> Outcome {
    let dst = sim.eps[from].peer(sim.addrs[to]);
    let src = sim.eps[to].peer(sim.addrs[from]);
    for (i, &n) in sizes.iter().enumerate() {
        sim.eps[to].recv(src, RecvBuf::owned(n), i as u64, 0, true, 1000 + i as u64, true).unwrap();
    }
    let t0 = sim.now;
    for (i, &n) in sizes.iter().enumerate() {
        sim.eps[from].send(sim.now, dst, SendBuf::owned(pattern(i as u64, n)), i as u64, true, None, i as u64, true).unwrap();
    }
    let mut out = Outcome::default();
    let total = sizes.len();
    let done = sim.run_until(limit, |s| {
        while let Some(c) = s.eps[from].poll_completion() {
            out.sends.push(c);
        }
        while let Some(c) = s.eps[to].poll_completion() {
            out.recvs.push(c);
        }
        out.sends.len() >= total && out.recvs.len() >= total
    });
    out.took = sim.now - t0;
    assert!(
        done,
        "not done after {limit} us: {} of {total} sends, {} recvs; counters {:?} / {:?}",
        out.sends.len(),
        out.recvs.len(),
        sim.eps[from].counters(),
        sim.eps[to].counters()
    );
    let mut seen = vec![false; total];
    for c in &mut out.recvs {
        assert_eq!(c.err, None, "{c:?}");
        let i = c.tag as usize;
        assert!(!seen[i], "message {i} delivered twice");
        seen[i] = true;
        assert_eq!(c.len as usize, sizes[i]);
        let data = c.buf.take().unwrap().into_vec().unwrap();
        assert!(data == pattern(i as u64, sizes[i]), "message {i} ({} bytes) corrupted", sizes[i]);
    }
    for c in &out.sends {
        assert_eq!(c.err, None, "{c:?}");
        assert_eq!(c.kind, OpKind::Send);
    }
    out
}

fn goodput_mbps(bytes: usize, took: Micros) -> f64 {
    bytes as f64 * 8.0 / took as f64
}

#[test]
fn every_size_arrives_intact_without_retransmits() {
    let mss = cfg().mss() as usize;
    let sizes = [0, 1, mss - 1, mss, mss + 1, 64 << 10, (64 << 10) + 1, 1 << 20, 8 << 20];
    let mut sim = Sim::two(cfg(), four_links(20, 31.25), 1);
    transfer(&mut sim, 0, 1, &sizes, 10 * SEC);
    let (a, b) = (sim.eps[0].counters(), sim.eps[1].counters());
    assert_eq!(a.retransmits, 0, "{a:?}");
    assert_eq!(b.dup_rcvd, 0, "{b:?}");
    assert_eq!(a.rtos, 0);
    assert_eq!(a.bytes_acked, sizes.iter().sum::<usize>() as u64, "every payload byte acknowledged once");
}

#[test]
fn lossless_goodput_fills_four_links() {
    // 4 x 250 Mbit/s, 20 us one way: the payload rate of the links is the capacity.
    let mut sim = Sim::two(cfg(), four_links(20, 31.25), 2);
    let sizes = vec![1 << 20; 32];
    let out = transfer(&mut sim, 0, 1, &sizes, 10 * SEC);
    let g = goodput_mbps(32 << 20, out.took);
    let mss = cfg().mss() as f64;
    let capacity = 1000.0 * mss / (mss + 36.0 + 16.0 + 4.0);
    println!("lossless goodput {g:.0} Mbit/s of {capacity:.0} (ratio {:.3})", g / capacity);
    assert!(g >= 0.9 * capacity, "goodput {g:.0} Mbit/s < 0.9 x {capacity:.0}");
    let a = sim.eps[0].counters();
    let b = sim.eps[1].counters();
    assert!((b.dup_rcvd as f64) <= 0.01 * a.pkts_sent as f64, "spurious {} of {}", b.dup_rcvd, a.pkts_sent);
}

#[test]
fn a_busy_host_delaying_every_path_does_not_starve_the_links() {
    // 16 paths hashed unevenly onto 4 x 250 Mbit/s, and a host that holds every
    // datagram 600 us for half of each 20 ms (what the namespace fabric shows on a
    // loaded 2-core machine). Delay every path shares is not a queue on a link.
    let cfg = Config { paths: 16, ..Config::default() };
    let mut sim = Sim::two(cfg.clone(), four_links(20, 31.25), 5);
    sim.host_busy = Some((20 * MS, 600));
    let sizes = vec![1 << 20; 48];
    let out = transfer(&mut sim, 0, 1, &sizes, 10 * SEC);
    let g = goodput_mbps(48 << 20, out.took);
    let mss = cfg.mss() as f64;
    let capacity = 1000.0 * mss / (mss + 36.0 + 16.0 + 4.0);
    let per_link: Vec<u64> = sim.links.iter().map(|l| l.bytes[0] >> 20).collect();
    println!("busy host: goodput {g:.0} Mbit/s of {capacity:.0} (ratio {:.3}), MiB per link {per_link:?}", g / capacity);
    println!("  {:?}", sim.eps[0].counters());
    let peer = sim.eps[0].peer(sim.addrs[1]);
    for st in sim.eps[0].path_stats(peer) {
        let link = sim.link_of(sim.src_addr(0, st.path), sim.addrs[1]);
        println!(
            "  path {} link {link} cwnd {} srtt {} min {} recent {} sent {} losses {}",
            st.path, st.cwnd, st.srtt_us, st.min_rtt_us, st.recent_rtt_us, st.pkts_sent, st.losses
        );
    }
    assert!(g >= 0.9 * capacity, "goodput {g:.0} Mbit/s < 0.9 x {capacity:.0}; MiB per link {per_link:?}");
}

#[test]
fn stalls_longer_than_the_min_rto_teach_an_rto_floor() {
    // Every 100 ms the hosts stall datagrams by 15 ms for 50 ms, three times the 5 ms
    // minimum RTO (emulated guests do this). The first timeout of a stall is premature;
    // the ACK that shows it undoes the cut and raises the path's floor, so the
    // stalls that follow within the next second time out no more.
    let mut sim = Sim::two(cfg(), four_links(20, 31.25), 9);
    sim.host_busy = Some((100 * MS, 15 * MS));
    let sizes = vec![1 << 20; 160];
    let took = transfer(&mut sim, 0, 1, &sizes, 30 * SEC).took;
    let (a, b) = (sim.eps[0].counters(), sim.eps[1].counters());
    println!(
        "stalls: rtos {} spurious {} tlps {} retransmits {} dup_rcvd {} of {} sent",
        a.rtos, a.spurious_rtos, a.tlps, a.retransmits, b.dup_rcvd, a.pkts_sent
    );
    assert!(a.spurious_rtos > 0, "premature timeouts are recognised: {a:?}");
    // Each path times out once or twice per stall it has not yet learned: the
    // first, and again after its floor has halved for a second. Without the floor
    // this run took 2947 timeouts and 19% spurious resends.
    let seconds = took.div_ceil(SEC);
    assert!(a.rtos <= 3 * cfg().paths as u64 * seconds, "{} timeouts in {seconds} s: {a:?}", a.rtos);
    // A timeout resends only its oldest packet and holds the rest until an ACK
    // answers (`Path::on_timeout`): 989 spurious resends here, where handing the
    // whole window back at each timeout sent 2013 (1.7%). 1165 since each ACK entry
    // rides two ACKs (`ACK_REPORTS`): the stalls reorder datagrams by 15 ms across
    // links, and the sender hears of later packets sooner. 1243 (1.04%) since the
    // whole RTT is held to the standing RTT: windows stay larger through a stall.
    assert!((b.dup_rcvd as f64) <= 0.011 * a.pkts_sent as f64, "spurious resends {} of {}", b.dup_rcvd, a.pkts_sent);
    // Every copy the receiver saw twice was sent again, tail-loss probes included: the
    // spurious share of the resends is at most 1 (reports once read 963 of 928).
    assert!(b.dup_rcvd <= a.retransmits, "dup_rcvd {} > retransmits {}", b.dup_rcvd, a.retransmits);
}

fn lossy(loss: f64, seed: u64) -> Sim {
    let mut links = four_links(20, 31.25);
    for l in &mut links {
        l.loss = loss;
    }
    Sim::two(cfg(), links, seed)
}

#[test]
fn random_loss_in_both_directions_keeps_goodput() {
    let sizes = vec![1 << 20; 24];
    let mut base = lossy(0.0, 3);
    let lossless = transfer(&mut base, 0, 1, &sizes, 10 * SEC).took;
    for (loss, floor) in [(0.01, 0.90), (0.10, 0.5)] {
        let mut sim = lossy(loss, 4);
        let out = transfer(&mut sim, 0, 1, &sizes, 60 * SEC);
        let ratio = lossless as f64 / out.took as f64;
        println!("loss {loss}: goodput ratio to lossless {ratio:.3}; {:?}", sim.eps[0].counters());
        assert!(ratio >= floor, "loss {loss}: ratio {ratio:.3} < {floor}");
        // Retransmits and duplicates are not goodput: each byte counts once.
        assert_eq!(sim.eps[0].counters().bytes_acked, 24 << 20);
    }
}

/// Two emulated nodes' pods: one link (1 ms each way, 48 Mbit/s), four paths, the
/// hosts stalling every datagram 8 ms in half of each 40 ms. At 1% loss the least
/// RTT of the last millisecond read each stall as a queue every path shares, and
/// the windows fell to a few packets a path: 0.48-0.50 of the lossless goodput in
/// three seeds of four. The standing RTT (the least of one to two srtt) keeps 0.99.
#[test]
fn host_stalls_at_one_percent_loss_keep_goodput() {
    let run = |loss: f64, seed: u64| {
        let cfg = Config { paths: 4, min_rto: 5 * MS, queue_target: 500, ..Config::default() };
        let mut link = Link::new(MS, 6.0);
        link.loss = loss;
        let mut sim = Sim::two(cfg, vec![link], seed);
        sim.host_busy = Some((40 * MS, 8 * MS));
        let out = transfer(&mut sim, 0, 1, &vec![64 << 10; 400], 60 * SEC);
        (out.took, sim.eps[0].counters())
    };
    let (lossless, _) = run(0.0, 1);
    for seed in 1..=4 {
        let (took, c) = run(0.01, 99 + 2 * seed);
        let ratio = lossless as f64 / took as f64;
        println!("stalls at 1% loss, seed {seed}: ratio {ratio:.2}; rtos {} tlps {} retransmits {}", c.rtos, c.tlps, c.retransmits);
        assert!(ratio >= 0.9, "seed {seed}: {ratio:.2} of the lossless goodput: {c:?}");
    }
}

/// The receiver's rate hint caps what the sender puts on the receiver's link,
/// resends and the link's own headers included: left out, the resends at 10%
/// loss came on top of the hint.
#[test]
fn the_rate_hint_caps_resends_and_headers_too() {
    let hint_mbps = 200;
    let mut links = four_links(20, 31.25);
    for l in &mut links {
        l.loss = 0.10;
    }
    let mut sim = Sim::two(Config { rate_mbps: hint_mbps, ..cfg() }, links, 7);
    let sizes = vec![1 << 20; 16];
    let out = transfer(&mut sim, 0, 1, &sizes, 60 * SEC);
    let c = sim.eps[0].counters();
    let per_packet = (metaroce_core::wire::DATA_OVERHEAD as u64 + metaroce_core::connection::LINK_OVERHEAD) * c.pkts_sent;
    let link_mbps = (c.bytes_sent + per_packet) as f64 * 8.0 / out.took as f64;
    println!("hint {hint_mbps} Mbit/s: the link carried {link_mbps:.1}; {c:?}");
    assert!(c.retransmits * 20 > c.pkts_sent, "expected about 10% resends: {c:?}");
    assert!(link_mbps <= hint_mbps as f64 * 1.02, "{link_mbps:.1} Mbit/s on the link against a hint of {hint_mbps}");
    assert!(link_mbps >= hint_mbps as f64 * 0.8, "the cap starved the sender: {link_mbps:.1} Mbit/s");
}

#[test]
fn bursty_loss_is_recovered() {
    let mut links = four_links(20, 31.25);
    for l in &mut links {
        // About 1% average: bursts of ~5 packets lost at 80%.
        l.burst_enter = 0.0025;
        l.burst_leave = 0.2;
        l.burst_loss = 0.8;
    }
    let mut sim = Sim::two(cfg(), links, 5);
    transfer(&mut sim, 0, 1, &vec![256 << 10; 32], 60 * SEC);
    // The goodput must-hold under bursty loss of the same 1% average: bursts of 16
    // packets lost back to back (the namespace fabric's BURSTY), entered so that 1% of
    // the packets fall in one.
    let sizes = vec![1 << 20; 24];
    let lossless = transfer(&mut lossy(0.0, 3), 0, 1, &sizes, 10 * SEC).took;
    let mut links = four_links(20, 31.25);
    for l in &mut links {
        l.burst_leave = 1.0 / 16.0;
        l.burst_enter = 0.01 / 0.99 * l.burst_leave;
        l.burst_loss = 1.0;
    }
    let mut sim = Sim::two(cfg(), links, 6);
    let out = transfer(&mut sim, 0, 1, &sizes, 60 * SEC);
    let ratio = lossless as f64 / out.took as f64;
    println!("bursty loss, 1% in runs of 16: goodput ratio to lossless {ratio:.3}; {:?}", sim.eps[0].counters());
    assert!(ratio >= 0.9, "bursty 1%: ratio {ratio:.3} < 0.9");
    assert_eq!(sim.eps[0].counters().bytes_acked, 24 << 20);
}

#[test]
fn reordering_across_paths_and_duplicates_are_harmless() {
    let mut links = vec![Link::new(10, 0.0), Link::new(80, 0.0), Link::new(300, 0.0), Link::new(1200, 0.0)];
    for l in &mut links {
        l.dup = 0.05;
    }
    let mut sim = Sim::two(cfg(), links, 6);
    let mss = cfg().mss() as usize;
    let sizes: Vec<usize> = (0..200).map(|i| (i * 977) % (3 * mss) + (i % 7) * 70_000).collect();
    transfer(&mut sim, 0, 1, &sizes, 60 * SEC);
    let b = sim.eps[1].counters();
    assert!(b.dup_rcvd > 0, "duplicates must be counted: {b:?}");
    // Reordering across paths is not loss: nothing was lost, so nothing needed resending.
    let a = sim.eps[0].counters();
    assert!(a.retransmits <= a.tlps + a.rtos * 8, "{a:?}");
}

/// The marked link's share over several seeds: one 32 MiB run's share moves by
/// about 0.01 with the seed (0.10-0.13), so the goal (under half an even share)
/// is asserted on the mean, and every run must still steer clearly away.
#[test]
fn ce_marks_are_echoed_and_steer_traffic_away() {
    let mut shares = Vec::new();
    for seed in [3, 5, 7, 9, 11] {
        let mut links = four_links(20, 31.25);
        links[2].ce = 0.05;
        let mut sim = Sim::two(cfg(), links, seed);
        transfer(&mut sim, 0, 1, &vec![1 << 20; 32], 20 * SEC);
        assert!(sim.eps[1].counters().ce_rcvd > 0);
        let bytes: Vec<u64> = sim.links.iter().map(|l| l.bytes[0]).collect();
        println!("seed {seed}: bytes per link with CE on link 2: {bytes:?}");
        shares.push(bytes[2] as f64 / bytes.iter().sum::<u64>() as f64);
    }
    let mean = shares.iter().sum::<f64>() / shares.len() as f64;
    assert!(mean < 0.5 / 4.0, "marked link share {mean:.3} on average: {shares:.3?}");
    assert!(shares.iter().all(|s| *s < 0.6 / 4.0), "marked link shares {shares:.3?}");
}

#[test]
fn a_dead_link_is_routed_around_and_readmitted() {
    let mut sim = Sim::two(Config { rotate_after: 10 * SEC, ..cfg() }, four_links(20, 31.25), 8);
    let dst = sim.eps[0].peer(sim.addrs[1]);
    let src = sim.eps[1].peer(sim.addrs[0]);
    let n = 48;
    for i in 0..n {
        sim.eps[1].recv(src, RecvBuf::owned(1 << 20), i, 0, true, i, true).unwrap();
    }
    for i in 0..n {
        sim.eps[0].send(sim.now, dst, SendBuf::owned(pattern(i, 1 << 20)), i, true, None, i, true).unwrap();
    }
    let mut got = 0;
    sim.run_until(40 * MS, |_| false);
    sim.links[1].down = true;
    sim.run_until(300 * MS, |s| {
        while s.eps[1].poll_completion().is_some() {
            got += 1;
        }
        false
    });
    let c = sim.eps[0].counters();
    assert!(c.path_failures > 0, "{c:?}");
    // The dead path's first timeout held its window; the other paths' ACKs released it.
    assert!(c.held_released > 0, "{c:?}");
    sim.links[1].down = false;
    let before = sim.links[1].delivered[0];
    sim.run_until(20 * SEC, |s| {
        while s.eps[1].poll_completion().is_some() {
            got += 1;
        }
        got >= n
    });
    assert_eq!(got, n);
    let c = sim.eps[0].counters();
    assert!(c.path_readmissions > 0, "{c:?}");
    assert!(sim.links[1].delivered[0] > before, "the recovered link carried nothing");
}

#[test]
fn receiver_not_ready_waits_for_credit_without_timeouts() {
    let mut sim = Sim::two(Config { credit_window: 1 << 20, ..cfg() }, four_links(20, 31.25), 9);
    let dst = sim.eps[0].peer(sim.addrs[1]);
    let src = sim.eps[1].peer(sim.addrs[0]);
    let n = 64u64; // 64 x 64 KiB = 4 MiB of eager data into a 1 MiB credit window
    for i in 0..n {
        sim.eps[0].send(sim.now, dst, SendBuf::owned(pattern(i, 64 << 10)), i, true, None, i, true).unwrap();
    }
    sim.run_until(2 * SEC, |_| false);
    let a = sim.eps[0].counters();
    assert!(a.rnr_waits > 0, "{a:?}");
    assert_eq!(a.rtos, 0, "waiting for the receiver is not loss: {a:?}");
    assert!(sim.eps[1].memory_bytes() <= 2 << 20, "pool {} bytes", sim.eps[1].memory_bytes());
    let mut got = 0;
    for i in 0..n {
        sim.eps[1].recv(src, RecvBuf::owned(64 << 10), i, 0, true, i, true).unwrap();
    }
    let ok = sim.run_until(5 * SEC, |s| {
        while let Some(c) = s.eps[1].poll_completion() {
            assert_eq!(c.buf.unwrap().into_vec().unwrap(), pattern(c.tag, 64 << 10));
            got += 1;
        }
        got == n
    });
    assert!(ok, "{got} of {n}: {:?} {:?}", sim.eps[0].counters(), sim.eps[1].counters());
}

#[test]
fn a_silent_peer_fails_the_sends_with_a_timeout() {
    let mut sim = Sim::two(Config { abort_timeout: 2 * SEC, ..cfg() }, four_links(20, 31.25), 10);
    let dst = sim.eps[0].peer(sim.addrs[1]);
    let src = sim.eps[1].peer(sim.addrs[0]);
    sim.eps[1].recv(src, RecvBuf::owned(4), 0, 0, true, 0, true).unwrap();
    sim.eps[0].send(sim.now, dst, SendBuf::owned(vec![1; 4]), 0, true, None, 0, true).unwrap();
    sim.run_until(100 * MS, |_| false);
    sim.silent[1] = true;
    sim.eps[0].send(sim.now, dst, SendBuf::owned(vec![1; 100_000]), 1, true, None, 7, true).unwrap();
    let mut err = None;
    let t0 = sim.now;
    sim.run_until(10 * SEC, |s| {
        while let Some(c) = s.eps[0].poll_completion() {
            if c.context == 7 {
                err = Some(c.err);
            }
        }
        err.is_some()
    });
    assert_eq!(err, Some(Some(Error::TimedOut)));
    let took = sim.now - t0;
    // Measured from the last acknowledged progress, 100 ms before the silence.
    assert!((1800 * MS..3 * SEC).contains(&took), "abort after {took} us");
}

#[test]
fn a_restarted_peer_is_a_new_connection() {
    let mut sim = Sim::two(cfg(), four_links(20, 31.25), 11);
    transfer(&mut sim, 0, 1, &[100, 5000], SEC);
    // Endpoint 1 restarts at the same address: new incarnation, no state.
    sim.eps[1] = metaroce_core::Endpoint::new(cfg(), 999).unwrap();
    sim.epochs[1] = vec![0; 8];
    let dst = sim.eps[0].peer(sim.addrs[1]);
    sim.eps[0].send(sim.now, dst, SendBuf::owned(vec![5; 10]), 9, true, None, 77, true).unwrap();
    let mut err = None;
    sim.run_until(SEC, |s| {
        while let Some(c) = s.eps[0].poll_completion() {
            err = Some(c.err);
        }
        err.is_some()
    });
    assert_eq!(err, Some(Some(Error::ConnReset)), "the old connection's send fails with a reset");
    transfer(&mut sim, 0, 1, &[10, 100_000], 2 * SEC);
}

#[test]
fn both_sides_opening_at_once_make_one_connection() {
    let mut sim = Sim::two(cfg(), four_links(20, 31.25), 12);
    let p01 = sim.eps[0].peer(sim.addrs[1]);
    let p10 = sim.eps[1].peer(sim.addrs[0]);
    sim.eps[0].recv(p01, RecvBuf::owned(10), 1, 0, true, 1, true).unwrap();
    sim.eps[1].recv(p10, RecvBuf::owned(10), 0, 0, true, 1, true).unwrap();
    sim.eps[0].send(sim.now, p01, SendBuf::owned(vec![1; 10]), 0, true, None, 2, true).unwrap();
    sim.eps[1].send(sim.now, p10, SendBuf::owned(vec![2; 10]), 1, true, None, 2, true).unwrap();
    let mut n = [0, 0];
    assert!(sim.run_until(SEC, |s| {
        for (ep, count) in s.eps.iter_mut().zip(n.iter_mut()) {
            while let Some(c) = ep.poll_completion() {
                assert_eq!(c.err, None);
                *count += 1;
            }
        }
        n == [2, 2]
    }));
    assert_eq!(sim.eps[0].conns_active(), 1);
    assert_eq!(sim.eps[1].conns_active(), 1);
}

#[test]
fn matching_semantics() {
    let mut sim = Sim::new(3, cfg(), four_links(20, 0.0), 13);
    let to2_from0 = sim.eps[0].peer(sim.addrs[2]);
    let to2_from1 = sim.eps[1].peer(sim.addrs[2]);
    let from0 = sim.eps[2].peer(sim.addrs[0]);
    // Same tag twice from one sender: matched in send order (FI_ORDER_SAS).
    sim.eps[0].send(sim.now, to2_from0, SendBuf::owned(b"first".to_vec()), 5, true, None, 1, true).unwrap();
    sim.eps[0].send(sim.now, to2_from0, SendBuf::owned(b"second".to_vec()), 5, true, None, 2, true).unwrap();
    // Untagged messages live in their own space.
    sim.eps[1].send(sim.now, to2_from1, SendBuf::owned(b"untagged".to_vec()), 0, false, Some(42), 3, true).unwrap();
    // Truncation: 100 KiB (rendezvous) into 10 bytes; 3 KiB (eager) into 2 bytes.
    sim.eps[1].send(sim.now, to2_from1, SendBuf::owned(pattern(1, 100 << 10)), 9, true, None, 4, true).unwrap();
    sim.eps[1].send(sim.now, to2_from1, SendBuf::owned(pattern(2, 3 << 10)), 10, true, None, 5, true).unwrap();
    sim.run_until(100 * MS, |_| false);
    let e = &mut sim.eps[2];
    // Peek finds without taking; claim holds it for a context.
    let p = e.peek(ANY_PEER, 5, 0, true, None, false).unwrap();
    assert_eq!((p.len, p.peer), (5, from0));
    assert_eq!(e.peek(ANY_PEER, 6, 0, true, None, false), Err(Error::NoMsg));
    e.peek(ANY_PEER, 5, 0, true, Some(500), false).unwrap();
    // The claimed one is invisible: the next match for tag 5 is "second".
    e.recv(ANY_PEER, RecvBuf::owned(10), 5, 0, true, 600, true).unwrap();
    e.recv_claimed(500, Some(RecvBuf::owned(10)), true).unwrap();
    e.recv(ANY_PEER, RecvBuf::owned(10), 0, 0, false, 700, true).unwrap();
    e.recv(ANY_PEER, RecvBuf::owned(10), 9, 0, true, 800, true).unwrap();
    e.recv(ANY_PEER, RecvBuf::owned(2), 0x10, 0xff, true, 900, true).unwrap(); // ignore mask
                                                                               // A receive that matches nothing can be cancelled.
    e.recv(ANY_PEER, RecvBuf::owned(10), 77, 0, true, 1000, true).unwrap();
    e.cancel(1000).unwrap();
    assert_eq!(e.cancel(1000), Err(Error::NoEntry));
    sim.run_until(200 * MS, |_| false);
    let mut got = std::collections::HashMap::new();
    while let Some(c) = sim.eps[2].poll_completion() {
        got.insert(c.context, c);
    }
    let mut keys: Vec<u64> = got.keys().copied().collect();
    keys.sort();
    println!("completions: {keys:?} {:?}", sim.eps[2].counters());
    let data = |c: &mut Completion| {
        let n = c.len as usize;
        c.buf.take().unwrap().into_vec().unwrap()[..n].to_vec()
    };
    assert_eq!(data(got.get_mut(&500).unwrap()), b"first");
    assert_eq!(data(got.get_mut(&600).unwrap()), b"second");
    let u = got.get_mut(&700).unwrap();
    assert_eq!((u.cq_data, u.tagged), (Some(42), false));
    assert_eq!(data(u), b"untagged");
    let t = &got[&800];
    assert_eq!((t.err, t.len, t.olen), (Some(Error::Truncated), 10, (100 << 10) - 10));
    let t = &got[&900];
    assert_eq!((t.err, t.len, t.olen, t.tag), (Some(Error::Truncated), 2, (3 << 10) - 2, 10));
    assert_eq!(got[&1000].err, Some(Error::Canceled));
    // The truncated rendezvous sender still completes.
    let mut sends = 0;
    while let Some(c) = sim.eps[1].poll_completion() {
        assert_eq!(c.err, None);
        sends += 1;
    }
    assert_eq!(sends, 3);
}

#[test]
fn garbage_and_altered_replays_are_counted_drops() {
    let mut sim = Sim::two(cfg(), four_links(20, 31.25), 14);
    let dst = sim.eps[0].peer(sim.addrs[1]);
    let src = sim.eps[1].peer(sim.addrs[0]);
    let n = 16u64;
    for i in 0..n {
        sim.eps[1].recv(src, RecvBuf::owned(200_000), i, 0, true, i, true).unwrap();
        sim.eps[0].send(sim.now, dst, SendBuf::owned(pattern(i, 200_000)), i, true, None, i, true).unwrap();
    }
    let mut got = 0;
    let from = sim.addrs[0];
    assert!(sim.run_until(20 * SEC, |s| {
        // Random datagrams at the receiver's port while the transfer runs.
        if s.rng.below(20) == 0 {
            let len = (s.rng.below(1600) + 1) as usize;
            let junk: Vec<u8> = (0..len).map(|_| s.rng.next_u64() as u8).collect();
            s.inject(1, from, junk);
        }
        while let Some(c) = s.eps[1].poll_completion() {
            assert_eq!(c.buf.unwrap().into_vec().unwrap(), pattern(c.tag, 200_000), "corrupted");
            got += 1;
        }
        got == n
    }));
    let c = sim.eps[1].counters();
    assert!(c.drops_malformed + c.drops_crc > 0, "{c:?}");
}

/// Goodput in 10 ms bins around a link failure: back to 0.7 of the 4-link
/// rate within 100 ms, held for 500 ms; the link carries traffic again within
/// 1 s after it recovers.
#[test]
fn link_failure_recovery_in_10ms_bins() {
    let mut sim = Sim::two(Config { rotate_after: 10 * SEC, ..cfg() }, four_links(20, 31.25), 15);
    post_mib_messages(&mut sim, 0, 1, 400);
    let bin = 10 * MS;
    let mut bins = Vec::new();
    let mut last = 0;
    let mut sample = |sim: &mut Sim, bins: &mut Vec<f64>| {
        sim.run_until(bin, |_| false);
        while sim.eps[1].poll_completion().is_some() {}
        let b = sim.eps[1].counters().bytes_rcvd;
        bins.push((b - last) as f64 * 8.0 / bin as f64); // Mbit/s
        last = b;
    };
    for _ in 0..30 {
        sample(&mut sim, &mut bins);
    }
    let lossless = bins[10..30].iter().sum::<f64>() / 20.0;
    sim.links[3].down = true;
    let fail_at = bins.len();
    for _ in 0..70 {
        sample(&mut sim, &mut bins);
    }
    let after = &bins[fail_at..];
    let back = after.iter().position(|g| *g >= 0.7 * lossless).expect("never recovered");
    println!("lossless {lossless:.0} Mbit/s; after the failure (10 ms bins): {:?}", after.iter().map(|g| *g as u32).collect::<Vec<_>>());
    assert!(back * 10 <= 100, "back to 0.7 after {} ms", back * 10);
    let held = &after[back..(back + 50).min(after.len())];
    assert!(held.iter().all(|g| *g >= 0.7 * lossless), "did not hold 0.7 for 500 ms: {held:?}");
    sim.links[3].down = false;
    let before = sim.links[3].delivered[0];
    for _ in 0..100 {
        sample(&mut sim, &mut bins);
        if sim.links[3].delivered[0] > before + 100 {
            break;
        }
    }
    assert!(sim.links[3].delivered[0] > before + 100, "the recovered link was not used again within 1 s");
}

/// The host fabric's shape at MTU 9000: 4 links of 250 Mbit/s with tbf's 128 KiB
/// queue, 16 paths.
fn host_fabric_sim(seed: u64) -> Sim {
    let mut links = four_links(30, 31.25);
    for l in &mut links {
        l.queue_limit = 128 << 10;
    }
    Sim::two(Config { paths: 16, mtu: 9000, ..cfg() }, links, seed)
}

/// `n` 1 MiB messages from endpoint `from` to `to`, each receive posted before its send.
fn post_mib_messages(sim: &mut Sim, from: usize, to: usize, n: u64) {
    let dst = sim.eps[from].peer(sim.addrs[to]);
    let src = sim.eps[to].peer(sim.addrs[from]);
    for i in 0..n {
        sim.eps[to].recv(src, RecvBuf::owned(1 << 20), i, 0, true, i, true).unwrap();
        sim.eps[from].send(sim.now, dst, SendBuf::owned(vec![7; 1 << 20]), i, true, None, i, true).unwrap();
    }
}

/// ACKs leave by the receiver's own source ports, hashed onto links whose
/// failure it cannot see (it sends no data to learn from). With one link dark
/// in the return direction only, a change sent in one ACK left the sender's
/// path full until a probe or timeout resent a packet that had arrived: every
/// change rides two ACKs, so the sender resends no more than on a clean fabric.
#[test]
fn acks_lost_on_a_dark_return_link_cost_no_resends() {
    let mut sim = host_fabric_sim(16);
    post_mib_messages(&mut sim, 0, 1, 200);
    let span = |sim: &mut Sim| {
        let c0 = sim.eps[1].counters();
        sim.run_until(400 * MS, |s| {
            while s.eps[1].poll_completion().is_some() {}
            false
        });
        let c1 = sim.eps[1].counters();
        (c1.bytes_rcvd - c0.bytes_rcvd, c1.dup_rcvd - c0.dup_rcvd)
    };
    span(&mut sim); // slow start
    let (clean_bytes, clean_dups) = span(&mut sim);
    sim.links[1].down_from = Some(1);
    let (bytes, dups) = span(&mut sim);
    println!("clean: {clean_bytes} bytes, {clean_dups} duplicates; return link dark: {bytes} bytes, {dups} duplicates");
    assert!(dups <= clean_dups + 10, "{dups} duplicates against {clean_dups}: {:?}", sim.eps[0].counters());
    assert!(bytes as f64 >= 0.97 * clean_bytes as f64, "{bytes} against {clean_bytes} bytes");
}

/// Where both sides send, each finds the dead link's paths by its own data: its
/// ACKs then skip those paths (they leave by the same source ports), and what
/// still enters the dark link is the failed paths' probes.
#[test]
fn acks_skip_paths_their_own_side_found_dead() {
    let mut sim = host_fabric_sim(17);
    post_mib_messages(&mut sim, 0, 1, 100);
    post_mib_messages(&mut sim, 1, 0, 100);
    let run = |sim: &mut Sim, t: Micros| {
        sim.run_until(t, |s| {
            for e in &mut s.eps {
                while e.poll_completion().is_some() {}
            }
            false
        })
    };
    run(&mut sim, 300 * MS);
    sim.links[1].down = true;
    run(&mut sim, 300 * MS); // the dead link's paths fail on both sides
    let before = sim.links[1].dropped;
    run(&mut sim, 600 * MS);
    let dropped = [sim.links[1].dropped[0] - before[0], sim.links[1].dropped[1] - before[1]];
    let failures = [sim.eps[0].counters().path_failures, sim.eps[1].counters().path_failures];
    println!("paths failed {failures:?}; datagrams into the dark link in 600 ms, each way: {dropped:?}");
    assert!(failures.iter().all(|f| *f > 0), "{failures:?}");
    // Probes: at most a ping per failed path every 50 ms. Sending ACKs round the
    // dead paths too put 324 datagrams a way into the dark link here.
    assert!(dropped.iter().all(|d| *d <= 60), "{dropped:?}");
}

/// Median and 90th percentile of `n` ping-pong round trips of `size` bytes.
fn pingpong_times(sim: &mut Sim, size: usize, n: usize) -> (Micros, Micros) {
    let ab = sim.eps[0].peer(sim.addrs[1]);
    let ba = sim.eps[1].peer(sim.addrs[0]);
    let mut times = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let t0 = sim.now;
        sim.eps[1].recv(ba, RecvBuf::owned(size), i, 0, true, i, true).unwrap();
        sim.eps[0].recv(ab, RecvBuf::owned(size), i, 0, true, i, true).unwrap();
        sim.eps[0].send(sim.now, ab, SendBuf::owned(pattern(i, size)), i, true, None, i, true).unwrap();
        let (mut ping, mut pong) = (false, false);
        let done = sim.run_until(10 * SEC, |s| {
            while let Some(c) = s.eps[1].poll_completion() {
                if c.kind == OpKind::Recv {
                    assert_eq!(c.err, None);
                    let now = s.now;
                    s.eps[1].send(now, ba, SendBuf::owned(pattern(i, size)), i, true, None, i, true).unwrap();
                    ping = true;
                }
            }
            while let Some(c) = s.eps[0].poll_completion() {
                pong |= c.kind == OpKind::Recv;
            }
            ping && pong
        });
        assert!(done, "round trip {i} did not finish: {:?}", sim.eps[0].counters());
        times.push(sim.now - t0);
    }
    times.sort_unstable();
    (times[n / 2], times[n * 9 / 10])
}

#[test]
fn a_small_message_tail_lost_at_one_percent_is_found_by_later_acks() {
    // 16 KiB over 16 paths is a packet or so per path: every loss is a path's
    // last packet, which no gap on that path reveals. ACKs of later packets on the
    // other paths show it overdue after its path's own RTT spread instead of the
    // tail-loss probe's floor (1.25 ms here, 10x this round trip).
    let cfg = Config { paths: 16, ..Config::default() };
    let mut times = vec![];
    for loss in [0.0, 0.01] {
        let mut links = four_links(20, 31.25);
        for l in &mut links {
            l.loss = loss;
        }
        let mut sim = Sim::two(cfg.clone(), links, 21);
        pingpong_times(&mut sim, 16 << 10, 200); // warm up: RTT samples on every path
        let (p50, p90) = pingpong_times(&mut sim, 16 << 10, 2000);
        let c = sim.eps[0].counters();
        println!(
            "16 KiB ping-pong at loss {loss}: median {p50} us, p90 {p90} us; late losses {}, tlps {}, rtos {}",
            c.late_losses, c.tlps, c.rtos
        );
        times.push((p50, p90));
    }
    let (lossless, lossy) = (times[0], times[1]);
    assert!(lossy.0 as f64 <= 1.5 * lossless.0 as f64, "median {} us at 1% against {} us lossless", lossy.0, lossless.0);
    assert!(lossy.1 as f64 <= 3.0 * lossless.1 as f64, "p90 {} us at 1% against {} us lossless", lossy.1, lossless.1);
}

#[test]
fn a_segment_the_sender_waits_on_is_acknowledged_at_the_batch_end() {
    // The receiver holds an ACK until ACK_FLUSH_MIN packets came unless the sender
    // waits on one: a message's last segment carries ACK_REQ. Here only the last
    // segments' path arrives (no gap on it, the message incomplete: its other
    // path's packets are lost at their tail), and the ACK still goes at the end of
    // that batch, not after the (here 50 ms) ACK delay.
    use metaroce_core::wire::{self, Body, FLAG_ACK_REQ};
    let mut sim = Sim::two(Config { ack_delay: 50 * MS, ..cfg() }, four_links(20, 31.25), 21);
    transfer(&mut sim, 0, 1, &[100], SEC); // the handshake, and the paths' runs begun
    sim.run_until(200 * MS, |_| false); // every ACK delivered
    let mss = Config::default().mss() as usize;
    let (dst, src) = (sim.eps[0].peer(sim.addrs[1]), sim.eps[1].peer(sim.addrs[0]));
    sim.eps[1].recv(src, RecvBuf::owned(10 * mss), 7, 0, true, 7, true).unwrap();
    sim.eps[0].send(sim.now, dst, SendBuf::owned(pattern(7, 10 * mss)), 7, true, None, 7, true).unwrap();
    // (offset, path, ACK_REQ, datagram) of every segment, in the order sent.
    let mut segs: Vec<(u32, u8, bool, Vec<u8>)> = Vec::new();
    let mut buf = vec![0u8; 65536];
    for _ in 0..1000 {
        while let Some(t) = sim.eps[0].poll_transmit(sim.now, &mut buf) {
            let p = wire::decode(&buf[..t.len]).unwrap();
            if let Body::Data(d, _) = p.body {
                segs.push((d.offset, p.header.path, p.header.flags & FLAG_ACK_REQ != 0, buf[..t.len].to_vec()));
            }
        }
        if segs.len() >= 10 {
            break;
        }
        sim.now += 10;
    }
    assert_eq!(segs.len(), 10, "the message's 10 segments");
    let flagged: Vec<u32> = segs.iter().filter(|s| s.2).map(|s| s.0).collect();
    assert_eq!(flagged, vec![9 * mss as u32], "only the last segment asks for an ACK");
    let last_path = segs.iter().find(|s| s.2).unwrap().1;
    let on_last: Vec<&(u32, u8, bool, Vec<u8>)> = segs.iter().filter(|s| s.1 == last_path).collect();
    assert!(
        (1..4).contains(&on_last.len()),
        "the test needs the last segment's path to carry 1-3 of the 10 (runs of 8 per path): {:?}",
        segs.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>()
    );
    let from = sim.src_addr(0, last_path);
    sim.now += 100;
    for s in &on_last {
        sim.eps[1].handle_datagram(sim.now, from, false, &s.3);
    }
    sim.eps[1].flush_acks();
    let mut acks = 0;
    while let Some(t) = sim.eps[1].poll_transmit(sim.now, &mut buf) {
        if matches!(wire::decode(&buf[..t.len]).unwrap().body, Body::Ack(_)) {
            acks += 1;
        }
    }
    assert!(acks > 0, "no ACK at the batch's end for {} packets holding the ACK_REQ segment", on_last.len());
}
