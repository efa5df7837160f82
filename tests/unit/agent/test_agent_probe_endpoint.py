"""The probe endpoint is a real address of the node, republished when it changes
(finding 9, IPv4). On b6733c0 a node without an address yet publishes 0.0.0.0:port,
peers probe their own localhost and call it healthy, and the endpoint is never
republished."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

from metaroce_agent.probe import Prober, probe_address, split_endpoint


class FakeKube:
    def __init__(self, endpoints: dict[str, str]) -> None:
        self.items = [
            {
                "metadata": {
                    "name": f"rdma-a.{node}",
                    "labels": {"metaroce.io/node": node},
                    "annotations": {"metaroce.io/probe-endpoint": ep},
                },
            }
            for node, ep in endpoints.items()
        ]

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "1"}, "items": self.items}

    def watch(self, path: str, params: dict[str, str], **kw: Any) -> Iterator[dict[str, Any]]:
        time.sleep(3600)
        yield {}


def _prober(address: list[str | None], published: list[str], kube: Any = None) -> Prober:
    return Prober(
        kube=kube or FakeKube({}),
        network="rdma-a",
        node="node-1",
        address=lambda: address[0],  # type: ignore[arg-type,return-value]
        port=0,
        local=lambda: [],
        publish=published.append,
        report=lambda s: None,
        metrics=None,
        interval=3600,
        peers=3,
        max_latency_us=1000,
        max_loss=0.01,
    )


def test_no_address_publishes_nothing_and_a_new_address_is_published() -> None:
    address: list[str | None] = [None]
    published: list[str] = []
    p = _prober(address, published)
    try:
        p.start()
        assert not [e for e in published if e.startswith("0.0.0.0")], published
        address[0] = "127.0.0.1"
        p.refresh()
        assert published and published[-1].startswith("probe2://127.0.0.1:"), published
        assert p.server is not None and p.server.port > 0
        before = len(published)
        p.refresh()  # unchanged: no new write
        assert len(published) == before
    finally:
        p.stop()


def test_peers_with_unspecified_or_loopback_endpoints_are_not_probed() -> None:
    kube = FakeKube(
        {
            "node-2": "probe2://0.0.0.0:47911",
            "node-3": "probe2://127.0.0.1:47911",
            "node-4": "probe2://192.168.77.14:47911",
            "node-5": "probe2://:47911",
        }
    )
    p = _prober(["192.168.77.11"], [], kube)
    assert p.endpoints() == {"node-4": "probe2://192.168.77.14:47911"}


def test_an_ipv6_only_netdev_is_served_and_published_in_brackets() -> None:
    """Finding 9, IPv6: on b6733c0 (and before this fix) an IPv6-only netdev publishes
    nothing (or 0.0.0.0), and a bracketed peer endpoint cannot be probed."""
    published: list[str] = []
    p = _prober(["::1"], published)
    try:
        p.refresh()
        assert published and published[-1].startswith("probe2://[::1]:"), published
        host, port = split_endpoint(published[-1])
        assert host == "::1" and port == p.server.port  # type: ignore[union-attr]
        with socket.create_connection((host, port), timeout=3) as c:
            assert "nonce" in c.makefile("r").readline()  # an IPv6 listener answers
    finally:
        p.stop()


def test_the_probe_address_prefers_ipv4_then_a_global_ipv6() -> None:
    assert probe_address(("192.168.1.5/24",), ("fd00::5/64",)) == "192.168.1.5"
    assert probe_address((), ("fe80::1/64", "fd00::5/64")) == "fd00::5"
    assert probe_address((), ("fe80::1/64",)) is None  # link-local needs a scope: no
    assert split_endpoint("probe2://10.0.0.2:47911") == ("10.0.0.2", 47911)
    assert split_endpoint("probe2://[fd00::2]:47911") == ("fd00::2", 47911)
