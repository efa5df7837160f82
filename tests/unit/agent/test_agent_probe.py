"""The probe's pure parts: peer choice (a ring) and the verdict that gates NodeState writes."""

from __future__ import annotations

from metaroce_agent.probe import PeerResult, choose_peers, summarize


def test_peers_form_a_ring_so_everyone_is_probed() -> None:
    eps = {f"node-{i}": f"10.0.0.{i}:47911" for i in range(1, 6)}
    chosen = {me: choose_peers(me, {k: v for k, v in eps.items() if k != me}, 2) for me in eps}
    assert chosen["node-1"] == ["node-2", "node-3"]
    assert chosen["node-5"] == ["node-1", "node-2"]
    probed_by = {n: sum(n in peers for peers in chosen.values()) for n in eps}
    assert set(probed_by.values()) == {2}
    assert choose_peers("node-1", {}, 3) == []


def test_summary_verdict_ignores_latency_jitter_but_not_failures() -> None:
    ok = PeerResult("node-2", True, rtts_us=(100.0, 120.0, 130.0), loss=0.0)
    jitter = PeerResult("node-2", True, rtts_us=(140.0, 150.0, 160.0), loss=0.0)
    slow = PeerResult("node-2", True, rtts_us=(100.0,) * 980 + (5000.0,) * 20, loss=0.0)
    lossy = PeerResult("node-2", True, rtts_us=(100.0,), loss=0.2, ud=(50, 40))
    gone = PeerResult("node-2", False, message="side channel unreachable")
    s1, v1 = summarize([ok], 1000, 0.01)
    _, v2 = summarize([jitter], 1000, 0.01)
    assert s1.healthy is True and v1 == v2
    assert s1.peers is not None and s1.peers[0].latency_p50_microseconds == 120.0
    for bad in (slow, lossy, gone):
        s, v = summarize([bad], 1000, 0.01)
        assert s.healthy is False and v != v1
    s, _ = summarize([slow], 1000, 0.01)
    assert s.peers is not None and "p99 5000 us (max 1000) over 1000 RTTs" in s.peers[0].message
    assert summarize([], 1000, 0.01)[0].healthy is None
