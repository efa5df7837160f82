"""The host lock that keeps two runs of real nodes from taking the same addresses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metaroce_harness.nodes import NodeError, labelled_addresses, take_host_lock


def test_a_second_holder_waits_then_fails_naming_the_first(tmp_path: Path) -> None:
    lock = tmp_path / "real-nodes.lock"
    first = take_host_lock(lock, 0)
    try:
        assert f"pid {os.getpid()}" in lock.read_text()
        with pytest.raises(NodeError, match=rf"held by another run .*pid {os.getpid()}"):
            take_host_lock(lock, 0.3, poll_s=0.1)
    finally:
        os.close(first)


def test_closing_the_descriptor_frees_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "real-nodes.lock"
    os.close(take_host_lock(lock, 0))
    os.close(take_host_lock(lock, 0))


def test_a_bad_wait_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from metaroce_harness import nodes

    monkeypatch.setenv(nodes.HOST_LOCK_WAIT_ENV, "soon")
    with pytest.raises(NodeError, match="METAROCE_REAL_NODES_WAIT='soon'"):
        nodes._host_lock_wait()


def test_labels_are_read_without_the_line_continuation() -> None:
    # what `ip -o -4 addr show dev lo` printed after a killed run (2026-12-01)
    out = (
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
        "1: lo    inet 192.168.77.11/32 scope global lo:mrk24756\\       valid_lft forever "
        "preferred_lft forever\n"
    )
    assert labelled_addresses(out) == [("192.168.77.11/32", "lo:mrk24756")]
