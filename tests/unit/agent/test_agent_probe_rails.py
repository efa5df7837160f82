"""Every served device is probed (finding 10, second half): on a node with several RDMA
devices (rails) the prober probes each peer on each rail (rail k to the peer's rail k),
the server answers on the rail the client names, and a peer fails when any rail fails,
with the failing device named.

On b6733c0 the probe uses only the plan's first device: a dead second NIC is never seen."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import pytest
from fakes import SilentEndpoint

import metaroce_agent.probe as probe
from metaroce_agent.probe import Local, PeerResult, Prober, ProbeServer, summarize

RAILS = [Local("mlx5_0", 1, 3, 104), Local("mlx5_1", 1, 3, 104)]


class RecordingEndpoint(SilentEndpoint):
    made: list[str] = []


def _session(port: int, rail: int) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as c:
        f = c.makefile("r")
        json.loads(f.readline())
        c.sendall(json.dumps({"node": "a", "rail": rail, "nonce": "ab" * 16}).encode() + b"\n")
        reply = dict(json.loads(f.readline()))
        c.sendall(b'{"op": "bye"}\n')
        return reply


def test_the_server_answers_on_the_rail_the_client_names() -> None:
    RecordingEndpoint.made = []
    srv = ProbeServer(
        "127.0.0.1",
        0,
        lambda rail: RAILS[rail] if rail < len(RAILS) else None,
        endpoint=RecordingEndpoint,
    )
    threading.Thread(target=srv.serve, daemon=True).start()
    try:
        assert "rc_qpn" in _session(srv.port, 1)
        assert "rc_qpn" in _session(srv.port, 0)
        reply = _session(srv.port, 2)
        assert "rail 2" in reply.get("error", ""), reply
    finally:
        srv.stop()
    assert RecordingEndpoint.made == ["mlx5_1", "mlx5_0"]


def test_every_peer_is_probed_on_every_rail(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, int]] = []

    def fake_probe_peer(node: str, host: str, port: int, local: Local, **kw: Any) -> PeerResult:
        calls.append((node, local.device, kw["rail"]))
        ok = local.device != "mlx5_1"
        return PeerResult(node, ok, rtts_us=(50.0,) if ok else (), device=local.device,
                          message="" if ok else "no RC echo within 1 s")  # fmt: skip

    monkeypatch.setattr(probe, "probe_peer", fake_probe_peer)
    reports: list[Any] = []
    p = Prober(
        kube=None, network="rdma-a", node="node-1", address=lambda: None, port=0,
        local=lambda: list(RAILS), publish=lambda e: None, report=reports.append,
        metrics=None, interval=3600, peers=1, max_latency_us=1000, max_loss=0.01,
    )  # fmt: skip
    p.endpoints = lambda: {"node-2": "probe2://10.0.0.2:47911"}  # type: ignore[method-assign]
    p.refresh = lambda: None  # type: ignore[method-assign]
    summary = p.round()
    assert calls == [("node-2", "mlx5_0", 0), ("node-2", "mlx5_1", 1)]
    assert summary is not None and summary.healthy is False
    (peer,) = summary.peers or []
    assert peer.node == "node-2" and peer.reachable is False
    assert "mlx5_1" in peer.message and "no RC echo" in peer.message


def test_one_entry_per_peer_node_and_healthy_only_when_every_rail_is() -> None:
    good = [PeerResult("node-2", True, rtts_us=(50.0,), device=r.device) for r in RAILS]
    s, _ = summarize(good, 1000, 0.01, {})
    assert s.healthy is True and len(s.peers or []) == 1
