"""The leader's view of networks orders bodies without comparing resourceVersions
(issue 16 #10): they are opaque strings, not integers."""

from __future__ import annotations

from typing import Any

from metaroce_operator.controller import Store


def _body(rv: str, generation: int, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "net", "resourceVersion": rv, "generation": generation},
        "spec": {"generation-marker": generation},
    }
    if status is not None:
        body["status"] = status
    return body


def test_a_newer_spec_is_taken_whatever_its_resource_version_looks_like() -> None:
    store = Store()
    store.set_network(_body("100", 1))
    # An apiserver whose resourceVersions do not increase as integers (they need not).
    assert store.set_network(_body("99", 2))
    assert store.networks["net"]["metadata"]["generation"] == 2


def test_a_lower_generation_is_stale() -> None:
    store = Store()
    store.set_network(_body("a", 3))
    assert not store.set_network(_body("b", 2))
    assert store.networks["net"]["metadata"]["generation"] == 3


def test_the_leaders_own_status_write_outlives_watch_events_before_its_echo() -> None:
    store = Store()
    store.set_network(_body("rv-a", 1, {"observedGeneration": 0}))
    store.wrote_status(_body("rv-c", 1, {"observedGeneration": 1}))
    # An event from before the write, delivered after its response (opaque versions).
    store.set_network(_body("rv-b", 1, {"observedGeneration": 0}))
    assert store.status_of("net") == {"observedGeneration": 1}
    # The echo: from now on the watch's status is the truth again.
    store.set_network(_body("rv-c", 1, {"observedGeneration": 1}))
    store.set_network(_body("rv-d", 1, {"observedGeneration": 7}))
    assert store.status_of("net") == {"observedGeneration": 7}


def test_a_coalesced_echo_ends_the_wait_too() -> None:
    store = Store()
    store.wrote_status(_body("rv-c", 1, {"observedGeneration": 1}))
    # kopf batches events: the echo may be skipped, a later event carries our status.
    store.set_network(_body("rv-e", 1, {"observedGeneration": 1}))
    store.set_network(_body("rv-f", 1, {"observedGeneration": 5}))
    assert store.status_of("net") == {"observedGeneration": 5}


def test_someone_elses_status_is_trusted_after_the_echo_wait() -> None:
    from metaroce_operator.freshness import ECHO_WAIT, NetworkBodies

    now = [0.0]
    bodies = NetworkBodies(clock=lambda: now[0])
    bodies.from_write(_body("rv-c", 1, {"observedGeneration": 1}))
    bodies.from_watch(_body("rv-x", 1, {"observedGeneration": 9}))
    assert bodies.status("net") == {"observedGeneration": 1}
    now[0] = ECHO_WAIT + 1
    bodies.from_watch(_body("rv-y", 1, {"observedGeneration": 9}))
    assert bodies.status("net") == {"observedGeneration": 9}
