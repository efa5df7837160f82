"""Lease decisions (client-go semantics) and the write gate's timing."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from metaroce_operator.kube import Credentials, Kube, NotLeader
from metaroce_operator.leader import Record, may_take, next_spec

NOW = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def rec(holder: str, renew: str = "t1", duration: int = 15, transitions: int = 0) -> Record:
    return Record(holder, renew, duration, transitions, "t0")


def test_free_or_own_lease_may_be_taken_at_once() -> None:
    assert may_take(rec(""), "me", observed_since=100, now=100, default_duration=15)
    assert may_take(rec("me"), "me", observed_since=100, now=100, default_duration=15)


def test_foreign_lease_only_after_it_was_unchanged_for_its_duration() -> None:
    assert not may_take(rec("other"), "me", observed_since=100, now=114.9, default_duration=15)
    assert may_take(rec("other"), "me", observed_since=100, now=115, default_duration=15)
    # The lease's own duration wins over ours.
    assert not may_take(rec("other", duration=60), "me", 100, 130, 15)


def test_next_spec_counts_transitions_and_keeps_acquire_time_on_renewal() -> None:
    taken = next_spec(rec("other", transitions=2), "me", 15, NOW)
    assert taken["holderIdentity"] == "me" and taken["leaseTransitions"] == 3
    assert taken["acquireTime"] == taken["renewTime"] == "2026-03-01T12:00:00.123456Z"
    renewed = next_spec(Record("me", "x", 15, 3, "2026-01-01T00:00:00.000000Z"), "me", 15, NOW)
    assert renewed["leaseTransitions"] == 3
    assert renewed["acquireTime"] == "2026-01-01T00:00:00.000000Z"
    assert next_spec(None, "me", 15, NOW)["leaseTransitions"] == 0


def test_gated_client_refuses_writes_without_the_lease() -> None:
    kube = Kube(Credentials("https://127.0.0.1:1")).gated(lambda: False)
    with pytest.raises(NotLeader):
        asyncio.run(kube.request("PATCH", "/api/v1/nodes/x", body={}))
    assert kube.writes == 0
