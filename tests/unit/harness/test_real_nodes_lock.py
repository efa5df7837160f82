"""The host lock that keeps two runs of real nodes from taking the same addresses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metaroce_harness.nodes import NodeError, take_host_lock


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
