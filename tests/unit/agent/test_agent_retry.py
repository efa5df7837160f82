"""A failed apply pass is retried with backoff, and at once when the inventory changes
(a driver or ib_uverbs loaded after the agent started) -- finding 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import make_config
from fakes import FakeKernel, SysfsTree, fixture_agent, running, softroce_node, until

from metaroce_agent import loop
from metaroce_agent.kube import KubeError
from metaroce_agent.loop import Agent

TOS = "/sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos"


def _agent(tmp_path: Path, tree: SysfsTree, kernel: FakeKernel, **cfg) -> Agent:  # type: ignore[no-untyped-def]
    return fixture_agent(tmp_path, tree, kernel, make_config(driftInterval="1h", **cfg))


def test_a_failed_pass_is_retried_with_backoff(
    tmp_path: Path, fast_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop, "RETRY_BASE_SECONDS", 0.2, raising=False)
    tree, kernel = softroce_node(tmp_path / "root")
    kernel.fail["tc filter replace"] = (2, "Error: TC classifier not found.")
    agent = _agent(
        tmp_path, tree, kernel, nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"}
    )
    with running(agent) as a:
        assert until(lambda: a.state.status is not None, 5)
        assert a.state.status is not None and a.state.status.phase != "Ready"
        # each attempt is reported with its number and when the next one comes
        assert until(lambda: "attempt 2" in _errors(a), 5), _errors(a)
        assert "next attempt in" in _errors(a)
        del kernel.fail["tc filter replace"]  # the transient fault is gone
        assert until(lambda: a.state.status is not None and a.state.status.phase == "Ready", 10)
        assert a.host.read(TOS) == "104"


def test_a_device_that_appears_later_is_planned_at_once(
    tmp_path: Path, fast_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop, "RETRY_BASE_SECONDS", 3600.0, raising=False)  # not the timer
    tree = SysfsTree(tmp_path / "root")
    tree.configfs()
    tree.netdev("ens1f0", pci="0000:3b:00.0", ipv4=["192.168.10.5/24"], ecn=True)
    kernel = FakeKernel(tree, dcb_devices={"ens1f0"})
    agent = _agent(
        tmp_path, tree, kernel, nics={"interfaceNames": ["ens1f0"]}, transport={"mode": "rocev2"}
    )
    with running(agent) as a:
        assert until(lambda: a.state.status is not None, 5)
        assert a.state.status is not None and a.state.status.phase != "Ready"
        with a._lock:  # the device appears whole (the fixture writes it file by file)
            tree.rdma("mlx5_0", netdev="ens1f0")  # mlx5_ib loaded after the agent started
        assert until(lambda: a.state.result is not None and a.state.result.ok, 10)
        with a._lock:  # the pass sets its result before it writes its report: let it finish
            status = a.state.status
        assert status is not None
        assert status.phase == "Ready", (status.phase, _errors(a))


def test_backoff_doubles_up_to_a_cap() -> None:
    from metaroce_agent.loop import retry_delay

    delays = [retry_delay(n, base=5, cap=300) for n in range(1, 9)]
    assert delays == [5, 10, 20, 40, 80, 160, 300, 300]


def _errors(agent: Agent) -> str:
    status = agent.state.status
    return "" if status is None else " | ".join(f"{e.step}: {e.message}" for e in status.errors)


class _FlakyWriter:
    """A NodeState writer whose first `failures` writes cannot reach the apiserver."""

    name = "net.node-1"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.written: list[str] = []
        self._ensured = True

    def write(self, status: Any) -> bool:
        if self.failures > 0:
            self.failures -= 1
            raise KubeError(0, "POST ...: cannot reach the apiserver: EOF")
        self.written.append(status.phase)
        return True


def test_a_failed_report_is_written_again_without_waiting_for_the_next_pass(
    tmp_path: Path, fast_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the drift interval is an hour: the report must not wait for it (CI, 2026-12-03: both
    # agents' first NodeState write failed and nothing else wrote it for 420 s)
    monkeypatch.setattr(loop, "REPORT_RETRY_BASE_SECONDS", 0.1)
    tree, kernel = softroce_node(tmp_path / "root")
    agent = _agent(
        tmp_path, tree, kernel, nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"}
    )
    writer = _FlakyWriter(failures=2)
    agent.writer = writer  # type: ignore[assignment]
    agent.options.watch = False  # a writer without an apiserver: nothing to watch
    with running(agent) as a:
        assert until(lambda: "Ready" in writer.written, 5), (writer.written, writer.failures)
        assert a.report_retry_at is None
