"""The caches on the admission hot path never make a request wait on the API server twice."""

from __future__ import annotations

import threading
import time

from metaroce_api.examples import minimal_network
from metaroce_operator.webhooks.cache import RefreshingCache, view_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_read_fetches_once_for_concurrent_readers() -> None:
    calls: list[str] = []
    gate = threading.Event()

    def fetch(key: str) -> str:
        calls.append(key)
        gate.wait(2)
        return key.upper()

    cache = RefreshingCache(fetch, ttl=30)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("ns"))) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join()
    assert calls == ["ns"]
    assert results == ["NS"] * 8


def test_stale_value_is_served_while_one_refresh_runs() -> None:
    clock = Clock()
    release = threading.Event()
    calls: list[int] = []

    def fetch(key: str) -> int:
        calls.append(1)
        if len(calls) > 1:
            release.wait(2)
        return len(calls)

    cache = RefreshingCache(fetch, ttl=10, clock=clock)
    assert cache.get("k") == 1
    clock.now = 11  # expired
    started = time.monotonic()
    assert [cache.get("k") for _ in range(5)] == [1] * 5  # no wait, no pile of fetches
    assert time.monotonic() - started < 0.5
    release.set()
    deadline = time.monotonic() + 2
    while cache.get("k") != 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(calls) == 2


def test_failed_refresh_keeps_the_old_value() -> None:
    clock = Clock()
    fail = [False]

    def fetch(key: str) -> str:
        if fail[0]:
            raise RuntimeError("apiserver down")
        return "v"

    cache = RefreshingCache(fetch, ttl=1, clock=clock)
    assert cache.get("k") == "v"
    fail[0] = True
    clock.now = 5
    assert cache.get("k") == "v"
    time.sleep(0.1)
    assert cache.get("k") == "v"


def test_first_read_failure_gives_none() -> None:
    def fetch(key: str) -> str:
        raise RuntimeError("no")

    assert RefreshingCache(fetch).get("k") is None


def test_unreadable_network_is_kept_with_its_problem() -> None:
    obj = minimal_network("odd")
    obj["spec"]["bogus"] = 1
    got = view_of(obj)
    assert got.network is None and "bogus" in got.problem
    assert view_of(minimal_network("ok")).network is not None
