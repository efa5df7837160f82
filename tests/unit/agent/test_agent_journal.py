"""The journal: written atomically and durably, and a corrupt one never makes the
agent's own values pass for the node's originals (finding 4, the agent's side)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import make_config
from fakes import softroce_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.plan import make_plan

JOURNAL = "/run/metaroce/agent/rdma-a/journal.json"
TOS = "/sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos"


def _cfg(dscp: int = 26):  # type: ignore[no-untyped-def]
    return make_config(
        nics={"interfaceNames": ["eth0"]},
        transport={"mode": "softroce"},
        qos={"data": {"dscp": dscp}},
    )


def plan_for(n, cfg):  # type: ignore[no-untyped-def]
    inv = n.inventory()
    return make_plan(cfg, inv, n.caps(cfg, inv))


def test_journal_is_fsynced_before_and_after_the_rename(
    node, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert Engine(n.host, Journal(n.host, "rdma-a")).apply(plan_for(n, _cfg())).ok
    target = str(n.host.path(JOURNAL))
    # the data of the temporary file, then the directory holding the new name
    assert any(p.startswith(str(Path(target).parent) + "/.journal.json") for p in synced), synced
    assert str(Path(target).parent) in synced, synced
    assert not [p for p in os.listdir(Path(target).parent) if p.endswith(".tmp")]


def test_a_corrupt_journal_is_kept_and_its_originals_are_not_invented(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    assert Engine(n.host, Journal(n.host, "rdma-a")).apply(plan_for(n, _cfg(26))).ok
    n.host.write_atomic(JOURNAL, '{"version": 1, "entries": [')  # torn or hand-edited
    journal = Journal(n.host, "rdma-a")
    assert journal.problem and "unreadable" in journal.problem
    kept = [p for p in n.host.listdir("/run/metaroce/agent/rdma-a") if "corrupt" in p]
    assert kept, "the unreadable journal must be kept for a human, not overwritten"

    engine = Engine(n.host, journal)
    assert engine.apply(plan_for(n, _cfg(34))).ok
    # 104 is the agent's own value from before the corruption: not an original
    entry = journal.entries["roce-tos:rxe_eth0:port1"]
    assert entry.original_known is False
    assert Journal(n.host, "rdma-a").entries["roce-tos:rxe_eth0:port1"].original_known is False

    result = engine.revert()
    # what cannot be restored is said, knob by knob, and left as applied (not "restored"
    # to the agent's own older value); the revert itself completes
    assert result.ok, result.errors
    left = dict(result.left)
    assert "roce-tos port1 on rxe_eth0" in left and "original" in left["roce-tos port1 on rxe_eth0"]
    assert n.host.read(TOS) == "136"
    assert len(Journal(n.host, "rdma-a")) == 0


def test_a_temporary_journal_left_by_a_kill_is_removed_at_start(node) -> None:  # type: ignore[no-untyped-def]
    """A kill between writing the temporary journal and its rename (the fault tier's
    write_atomic.before_rename) leaves `.journal.json.<pid>.tmp`; the journal in place is
    the valid one, and the next agent process removes the leftover instead of adding one
    per crash."""
    n = node(softroce_node)
    assert Engine(n.host, Journal(n.host, "rdma-a")).apply(plan_for(n, _cfg(26))).ok
    before = n.host.read(JOURNAL)
    leftover = "/run/metaroce/agent/rdma-a/.journal.json.4242.tmp"
    n.host.write(leftover, '{"version": 1, "entries": []}')
    journal = Journal(n.host, "rdma-a")
    assert not journal.problem and len(journal) > 0
    assert not n.host.exists(leftover)
    assert n.host.read(JOURNAL) == before
