"""Probe verdicts from all nodes' results: one bad node is blamed alone."""

from __future__ import annotations

from metaroce_api import ProbeSpec
from metaroce_operator.observed import NodeReport, PeerResult
from metaroce_operator.probes import judge


def ring(n: int, bad: str, peers: int = 3) -> dict[str, NodeReport]:
    names = [f"n{i}" for i in range(n)]
    out = {}
    for i, name in enumerate(names):
        targets = [names[(i + k) % n] for k in range(1, peers + 1)]
        results = tuple(PeerResult(t, reachable=(t != bad and name != bad)) for t in targets)
        out[name] = NodeReport(
            name=name,
            network="x",
            node=name,
            phase="Ready",
            peers=results,
            probe_healthy=name != bad and bad not in targets,
        )
    return out


def test_one_bad_node_is_blamed_alone() -> None:
    verdicts = judge(ring(10, "n4"), ProbeSpec())
    assert [n for n, v in verdicts.items() if not v.healthy] == ["n4"]
    assert "3 of 3 peers" in verdicts["n4"].reason


def test_thresholds_latency_and_loss() -> None:
    probe = ProbeSpec(max_latency_microseconds=100, max_loss_fraction=0.01)
    assert PeerResult("x", True, latency_p99_us=150).failed(probe)
    assert PeerResult("x", True, loss_fraction=0.02).failed(probe)
    assert not PeerResult("x", True, latency_p99_us=50, loss_fraction=0.0).failed(probe)
    assert PeerResult("x", False).failed(probe)


def test_few_observers_fall_back_to_the_nodes_own_verdict() -> None:
    reports = {
        "a": NodeReport(name="a", network="x", node="a", probe_healthy=False),
        "b": NodeReport(name="b", network="x", node="b", probe_healthy=None),
    }
    verdicts = judge(reports, ProbeSpec())
    assert not verdicts["a"].healthy and verdicts["b"].healthy


def test_probe_disabled_means_healthy() -> None:
    verdicts = judge(ring(5, "n1"), ProbeSpec(enabled=False))
    assert all(v.healthy for v in verdicts.values())
