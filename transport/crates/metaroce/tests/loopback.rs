//! Two endpoints on real UDP sockets on the loopback interface: the progress
//! thread, the sockets and the C ABI's Rust side together.

use std::time::{Duration, Instant};

use metaroce::{OpKind, PeerId, RecvBuf, SendBuf, Transport};

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 13)) as u8).collect()
}

fn wait_for(t: &Transport, n: usize, within: Duration) -> Vec<metaroce::Completion> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        t.wait(Some(Duration::from_millis(50))).unwrap();
        out.extend(t.poll(64).unwrap());
    }
    out
}

/// Two endpoints on loopback over 4 paths, each with the other as a peer: (a, b,
/// a's peer b, b's peer a).
fn pair() -> (Transport, Transport, PeerId, PeerId) {
    let a = Transport::open(Some("addr=127.0.0.1,paths=4")).unwrap();
    let b = Transport::open(Some("addr=127.0.0.1,paths=4")).unwrap();
    let to_b = a.peer(b.local_addr()).unwrap();
    let to_a = b.peer(a.local_addr()).unwrap();
    (a, b, to_b, to_a)
}

#[test]
fn messages_of_every_size_cross_real_sockets() {
    let (a, b, to_b, from_a) = pair();
    let sizes = [0usize, 1, 1400, 9000, 65536, 65537, 1 << 20, 16 << 20];
    for (i, &n) in sizes.iter().enumerate() {
        b.recv(from_a, RecvBuf::owned(n), i as u64, 0, true, i as u64, true).unwrap();
    }
    for (i, &n) in sizes.iter().enumerate() {
        a.send(to_b, SendBuf::owned(pattern(i as u64, n)), i as u64, true, Some(i as u64 + 7), i as u64, true).unwrap();
    }
    let recvs = wait_for(&b, sizes.len(), Duration::from_secs(30));
    assert_eq!(recvs.len(), sizes.len(), "{:?}", b.counters());
    for c in recvs {
        assert_eq!(c.kind, OpKind::Recv);
        assert_eq!(c.err, None);
        assert_eq!(c.cq_data, Some(c.tag + 7));
        let i = c.tag as usize;
        assert!(c.buf.unwrap().into_vec().unwrap() == pattern(i as u64, sizes[i]), "message {i} corrupted");
    }
    let sends = wait_for(&a, sizes.len(), Duration::from_secs(10));
    assert_eq!(sends.len(), sizes.len());
    let (ca, io) = a.counters().unwrap();
    println!("sender {ca:?}\nio {io:?}");
    a.close();
    b.close();
}

/// The caller spins on progress() and poll() alone, beside the progress thread,
/// as a rank spinning on fi_cq_read does: every round trip completes intact,
/// and progress() counts completions that poll() then returns.
#[test]
fn a_caller_spinning_on_progress_shares_the_work_with_the_thread() {
    let (a, b, to_b, to_a) = pair();
    let spin = |t: &Transport, kind: OpKind| -> metaroce::Completion {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pending = t.progress().unwrap();
            let got = t.poll(8).unwrap();
            assert!(got.len() >= pending, "progress() said {pending} pending, poll() gave {}", got.len());
            assert!(got.len() <= 1, "{got:?}");
            if let Some(c) = got.into_iter().next() {
                assert_eq!(c.kind, kind);
                assert_eq!(c.err, None);
                return c;
            }
            assert!(Instant::now() < deadline, "no {kind:?} completion within 10 s: {:?}", t.counters());
        }
    };
    for i in 0..200u64 {
        let n = 4096 + i as usize;
        b.recv(to_a, RecvBuf::owned(n), i, 0, true, i, true).unwrap();
        a.send(to_b, SendBuf::owned(pattern(i, n)), i, true, None, i, false).unwrap();
        let c = spin(&b, OpKind::Recv);
        assert!(c.buf.unwrap().into_vec().unwrap() == pattern(i, n), "message {i} corrupted");
        a.recv(to_b, RecvBuf::owned(8), i, 0, true, i, true).unwrap();
        b.send(to_a, SendBuf::owned(i.to_le_bytes().to_vec()), i, true, None, i, false).unwrap();
        let c = spin(&a, OpKind::Recv);
        assert_eq!(c.buf.unwrap().into_vec().unwrap(), i.to_le_bytes());
    }
    a.close();
    b.close();
}

/// A receiver that spun on progress() and then computes, calling nothing on the
/// endpoint: its progress thread, standing by while the spinning went on, takes
/// over and acknowledges, so the sender's message completes meanwhile.
#[test]
fn a_receiver_that_stops_progressing_is_acknowledged_by_its_thread() {
    let (a, b, to_b, from_a) = pair();
    let n = 1 << 20;
    b.recv(from_a, RecvBuf::owned(n), 1, 0, true, 1, true).unwrap();
    let spun = Instant::now();
    while spun.elapsed() < Duration::from_millis(20) {
        b.progress().unwrap();
    }
    // b computes from here on: nothing is called on it until the send completed.
    let t0 = Instant::now();
    a.send(to_b, SendBuf::owned(pattern(1, n)), 1, true, None, 1, true).unwrap();
    let sent = wait_for(&a, 1, Duration::from_secs(5));
    let took = t0.elapsed();
    assert_eq!(sent.len(), 1, "no send completion while the receiver computed: {:?}", a.counters());
    assert_eq!(sent[0].err, None);
    assert!(took < Duration::from_secs(1), "the send took {took:?}");
    let got = b.poll(4).unwrap();
    assert_eq!(got.len(), 1);
    assert!(got.into_iter().next().unwrap().buf.unwrap().into_vec().unwrap() == pattern(1, n));
    assert_eq!(a.counters().unwrap().0.rtos, 0, "{:?}", a.counters());
    a.close();
    b.close();
}

#[test]
fn bad_config_names_the_key() {
    let e = Transport::open(Some("addr=127.0.0.1,paths=99")).err().unwrap();
    assert!(e.contains("paths=99"), "{e}");
    let e = Transport::open(Some("adr=1.2.3.4")).err().unwrap();
    assert!(e.contains("\"adr\""), "{e}");
}

#[test]
fn ipv6_and_jumbo_mtu() {
    for cfg in ["addr=::1,paths=2", "addr=127.0.0.1,paths=2,mtu=9000"] {
        let a = Transport::open(Some(cfg)).unwrap();
        let b = Transport::open(Some(cfg)).unwrap();
        let to_b = a.peer(b.local_addr()).unwrap();
        let from_a = b.peer(a.local_addr()).unwrap();
        b.recv(from_a, RecvBuf::owned(300_000), 1, 0, true, 1, true).unwrap();
        a.send(to_b, SendBuf::owned(pattern(3, 300_000)), 1, true, None, 1, true).unwrap();
        let r = wait_for(&b, 1, Duration::from_secs(10));
        assert_eq!(r.len(), 1, "{cfg}: {:?}", b.counters());
        let c = r.into_iter().next().unwrap();
        assert!(c.buf.unwrap().into_vec().unwrap() == pattern(3, 300_000), "{cfg}");
        // Every datagram fit the MTU: none was refused with EMSGSIZE.
        assert_eq!(a.counters().unwrap().1.tx_errors, 0, "{cfg}: {:?}", a.last_io_error());
    }
}

#[test]
fn the_stats_file_follows_the_transfer_and_marks_the_close() {
    let dir = std::env::temp_dir().join(format!("mr-loopback-stats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = format!("addr=127.0.0.1,paths=4,stats_dir={}", dir.display());
    let a = Transport::open(Some(&cfg)).unwrap();
    let b = Transport::open(Some("addr=127.0.0.1,paths=4")).unwrap();
    let file = dir.join(format!("ep-{}-{}.json", std::process::id(), a.local_addr().port()));
    let to_b = a.peer(b.local_addr()).unwrap();
    let from_a = b.peer(a.local_addr()).unwrap();
    b.recv(from_a, RecvBuf::owned(1 << 20), 1, 0, true, 1, true).unwrap();
    a.send(to_b, SendBuf::owned(pattern(1, 1 << 20)), 1, true, None, 1, true).unwrap();
    assert_eq!(wait_for(&b, 1, Duration::from_secs(10)).len(), 1);
    // The progress thread publishes at least once a second.
    let deadline = Instant::now() + Duration::from_secs(3);
    let live = loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        if text.contains("\"msgs_sent\":1,") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(live.contains("\"msgs_sent\":1,") && live.contains("\"closed\":false"), "{live}");
    assert!(live.contains(&format!("\"addr\":\"{}\"", metaroce::addr::format(&b.local_addr()))), "the peer paths: {live}");
    a.close();
    let last = std::fs::read_to_string(&file).unwrap();
    assert!(last.contains("\"closed\":true"), "{last}");
    b.close();
    std::fs::remove_dir_all(&dir).unwrap();
    let e = Transport::open(Some(&cfg)).err().unwrap();
    assert!(e.contains("stats_dir="), "{e}");
}

#[test]
fn arrival_bins_hold_every_placed_byte_by_its_kernel_receive_time() {
    let (a, b, to_b, from_a) = pair();
    assert!(b.arrival_bins().unwrap().is_none(), "no bins until asked for");
    b.start_arrival_bins(10).unwrap();
    let started = Instant::now();
    let before = b.counters().unwrap().0.bytes_rcvd;
    let (n, size) = (8u64, 1usize << 20);
    for i in 0..n {
        b.recv(from_a, RecvBuf::owned(size), 5, 0, true, i, true).unwrap();
        a.send(to_b, SendBuf::owned(pattern(i, size)), 5, true, None, i, true).unwrap();
        // Spread the messages over several bins.
        std::thread::sleep(Duration::from_millis(15));
    }
    let done = wait_for(&b, n as usize, Duration::from_secs(20));
    assert_eq!(done.iter().filter(|c| c.kind == OpKind::Recv && c.err.is_none()).count(), n as usize);
    let elapsed_bins = started.elapsed().as_millis() as usize / 10 + 1;
    let placed = b.counters().unwrap().0.bytes_rcvd - before;
    let bins = b.arrival_bins().unwrap().unwrap();
    assert_eq!(bins.bins().iter().sum::<u64>(), placed, "every placed payload byte is in a bin");
    assert_eq!((bins.early, bins.late), (0, 0));
    assert!(placed >= n * size as u64);
    assert!(bins.bins().len() <= elapsed_bins, "{} bins in {elapsed_bins} bins' time", bins.bins().len());
    assert!(bins.bins().iter().filter(|&&x| x > 0).count() >= 4, "the messages fell in several bins: {:?}", bins.bins());
}
