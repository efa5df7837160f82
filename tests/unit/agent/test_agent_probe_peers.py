"""Probe peers come from a small index (finding 10): the NodeStates' metadata only (the
node label and the endpoint annotation), listed once and then kept by a watch, so a
round costs no request and no agent reads the others' full status.

On b6733c0 every agent lists every NodeState of the network, status and all, every
round: O(N^2) full payloads across the network."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from metaroce_agent.probe import PeerIndex, Prober


def _meta(node: str, endpoint: str | None, rv: str = "1") -> dict[str, Any]:
    md: dict[str, Any] = {
        "name": f"rdma-a.{node}",
        "resourceVersion": rv,
        "labels": {"metaroce.io/network": "rdma-a", "metaroce.io/node": node},
    }
    if endpoint is not None:
        md["annotations"] = {"metaroce.io/probe-endpoint": endpoint}
    return {"kind": "PartialObjectMetadata", "metadata": md}


class MetadataKube:
    """An apiserver that answers only metadata requests (as=PartialObjectMetadata...)."""

    def __init__(self) -> None:
        self.lists = 0
        self.items = [
            _meta("node-1", "probe2://10.0.0.1:47911"),
            _meta("node-2", "probe2://10.0.0.2:47911"),
        ]
        self.events: list[dict[str, Any]] = []
        self.watching = threading.Event()

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        assert "as=PartialObjectMetadataList" in str(kw.get("accept")), kw
        assert kw["params"]["labelSelector"] == "metaroce.io/network=rdma-a"
        self.lists += 1
        return {"metadata": {"resourceVersion": "5"}, "items": list(self.items)}

    def watch(self, path: str, params: dict[str, str], **kw: Any) -> Iterator[dict[str, Any]]:
        assert "as=PartialObjectMetadata" in str(kw.get("accept")), kw
        assert params["resourceVersion"] == "5"
        self.watching.set()
        while not self.events:
            time.sleep(0.01)
        yield from self.events
        time.sleep(3600)  # the watch stays open


def _prober(kube: Any) -> Prober:
    return Prober(
        kube=kube,
        network="rdma-a",
        node="node-1",
        address=lambda: None,
        port=0,
        local=lambda: [],
        publish=lambda e: None,
        report=lambda s: None,
        metrics=None,
        interval=3600,
        peers=3,
        max_latency_us=1000,
        max_loss=0.01,
    )


def test_peers_come_from_metadata_listed_once_and_kept_by_a_watch() -> None:
    kube = MetadataKube()
    p = _prober(kube)
    assert p.endpoints() == {"node-2": "probe2://10.0.0.2:47911"}
    assert p.endpoints() == {"node-2": "probe2://10.0.0.2:47911"}
    assert kube.lists == 1  # the second round asked nothing
    stop = threading.Event()
    threading.Thread(target=p.index.run, args=(stop,), daemon=True).start()
    assert kube.watching.wait(5)
    kube.events = [
        {"type": "ADDED", "object": _meta("node-3", "probe2://10.0.0.3:47911", "6")},
        {"type": "MODIFIED", "object": _meta("node-2", "probe2://10.0.0.22:47911", "7")},
    ]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(p.endpoints()) < 2:
        time.sleep(0.02)
    stop.set()
    assert p.endpoints() == {
        "node-2": "probe2://10.0.0.22:47911",
        "node-3": "probe2://10.0.0.3:47911",
    }
    assert kube.lists == 1


def test_a_deleted_nodestate_leaves_the_index() -> None:
    index = PeerIndex(MetadataKube(), "rdma-a", "node-1")
    index.relist()
    index.apply({"type": "DELETED", "object": _meta("node-2", "probe2://10.0.0.2:47911", "9")})
    assert index.endpoints() == {}
    assert index.resource_version == "9"


def test_peers_on_the_old_probe_protocol_are_skipped_not_failed() -> None:
    """A rollout runs old and new agents side by side: the endpoint names its protocol
    (`probe2://`), so a new agent skips an old peer's bare `<ip>:<port>` (instead of
    failing it and risking a taint), and an old agent cannot parse a new endpoint (so it
    skips the new peer in turn)."""
    kube = MetadataKube()
    kube.items = [
        _meta("node-2", "10.0.0.2:47911"),  # an agent from before the change
        _meta("node-3", "probe2://10.0.0.3:47911"),
        _meta("node-4", "probe2://[fd00::4]:47911"),
    ]
    index = PeerIndex(kube, "rdma-a", "node-1")
    assert index.endpoints() == {
        "node-3": "probe2://10.0.0.3:47911",
        "node-4": "probe2://[fd00::4]:47911",
    }
    assert index.old_protocol == {"node-2"}
