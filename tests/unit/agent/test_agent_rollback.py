"""A failed re-apply reports what is in force; a failed rollback is Degraded and retried.

After a re-apply (config B over a verified config A) fails and is rolled back, the node
runs A: the NodeState lists A's knobs as applied. When the rollback fails too, the node
runs neither: the NodeState says Degraded with reason RollbackIncomplete (which the
operator counts as failed, never configured), names the knobs left off A's values, and
every later attempt retries that rollback first, whatever step it fails on, until the
node is back on A. Never a fall back to the pre-agent state.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Node, make_config
from fakes import fixture_agent, softroce_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.loop import Agent
from metaroce_agent.plan import make_plan
from metaroce_api import MetaRoceNodeStateStatus, constants, failpoints

TOS = "/sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos"
MTU = "/sys/class/net/eth0/mtu"


def softroce_cfg(mtu: int, dscp: int, generation: int):  # type: ignore[no-untyped-def]
    return make_config(
        nics={"interfaceNames": ["eth0"]},
        transport={"mode": "softroce", "mtu": mtu},
        qos={"data": {"dscp": dscp}},
        generation=generation,
    )


@pytest.fixture
def faults() -> Iterator[None]:
    """Failpoints set by the test, cleared after it."""
    yield
    failpoints.reset("")


@pytest.fixture
def sockdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dpr-") as d:  # unix socket paths are short
        yield Path(d)


def _agent_on_a(tmp_path: Path, **options: Any) -> Agent:
    tree, kernel = softroce_node(tmp_path / "root")
    agent = fixture_agent(tmp_path, tree, kernel, softroce_cfg(1400, 26, 3), **options)
    agent.start_plugin()
    assert agent.apply_pass().ok
    assert agent.host.read(MTU) == "1400" and agent.host.read(TOS) == "104"
    agent.config = softroce_cfg(1300, 34, 4)  # config B, as after a reload
    return agent


def _applied(status: MetaRoceNodeStateStatus | None) -> dict[str, str]:
    assert status is not None
    return {k.name: k.value for k in (status.qos.applied or [])} if status.qos else {}


def _ready(status: MetaRoceNodeStateStatus | None) -> tuple[str, str]:
    assert status is not None and status.conditions
    ready = next(c for c in status.conditions if c.type == "Ready")
    return ready.reason, ready.message


def _marked_dscp(agent: Agent) -> set[int]:
    kernel = agent.host.runner
    table = kernel.tc_filters.get(("eth0", "egress"), {})  # type: ignore[attr-defined]
    vals = set()
    for entry in table.values():
        for action in entry["options"]["actions"]:
            if action["kind"] == "pedit":
                vals.add(int(action["keys"][0]["val"], 16) >> 16 >> 2)
    return vals


def test_a_rolled_back_reapply_lists_the_verified_knobs_in_force(
    tmp_path: Path, faults: None
) -> None:
    agent = _agent_on_a(tmp_path)
    ready_on_a = _applied(agent.state.status)
    failpoints.reset("apply.step.roce-tos=1:error")
    result = agent.apply_pass()
    assert not result.ok and not result.rollback_incomplete
    status = agent.state.status
    assert status is not None and status.phase == "Failed"
    assert _ready(status)[0] == constants.NODESTATE_REASON_APPLY_FAILED
    # the node runs A again, and the NodeState says so, knob by knob
    assert agent.host.read(MTU) == "1400" and _marked_dscp(agent) == {26}
    assert _applied(status) == ready_on_a
    assert ready_on_a["mtu"] == "1400" and ready_on_a["roce-tos"].startswith("104 ")


def test_a_failed_rollback_is_degraded_and_retried_until_the_verified_state(
    tmp_path: Path, faults: None
) -> None:
    agent = _agent_on_a(tmp_path)
    ready_on_a = _applied(agent.state.status)

    # B fails at the ToS, and putting the marking back to A's DSCP fails too
    failpoints.reset("apply.step.roce-tos=1:error,restore.step.tc-mark=1:error")
    result = agent.apply_pass()
    assert result.rollback_incomplete
    assert [s.name for s in result.left_off] == ["dscp-mark on eth0"]
    assert agent.host.read(MTU) == "1400" and _marked_dscp(agent) == {34}
    status = agent.state.status
    assert status is not None and status.phase == "Degraded"
    reason, message = _ready(status)
    assert reason == constants.NODESTATE_REASON_ROLLBACK_INCOMPLETE
    assert reason in constants.NODESTATE_INCOMPLETE_REASONS
    assert "rollback incomplete (retrying" in message and "dscp-mark on eth0" in message
    # applied: what holds A's values; the marking, off A's value, is not listed
    assert _applied(status) == {k: v for k, v in ready_on_a.items() if k != "dscp-mark"}
    assert agent.state.next_retry is not None, "a failed rollback is retried"
    assert not agent.ready()[0]

    # the next attempt fails earlier (at the MTU, its first step): the marking still goes
    # back to A's value, not to the pre-agent state and not left at B's
    failpoints.reset("apply.step.mtu=1:error")
    result = agent.apply_pass()
    assert not result.ok and not result.rollback_incomplete, result.undo_errors
    assert "dscp-mark on eth0" in result.rolled_back
    assert agent.host.read(MTU) == "1400" and _marked_dscp(agent) == {26}
    assert agent.host.read(TOS) == "104"
    status = agent.state.status
    assert status is not None and status.phase == "Failed"
    assert _ready(status)[0] == constants.NODESTATE_REASON_APPLY_FAILED
    assert _applied(status) == ready_on_a

    # once nothing fails, B applies
    failpoints.reset("")
    assert agent.apply_pass().ok
    assert agent.host.read(MTU) == "1300" and _marked_dscp(agent) == {34}
    assert agent.state.status is not None and agent.state.status.phase == "Ready"


def test_a_plan_that_cannot_apply_still_retries_a_failed_rollback(
    tmp_path: Path, faults: None
) -> None:
    """A device gone (a plan with errors) applies nothing, but what a failed rollback
    left off the verified state is put back all the same."""
    agent = _agent_on_a(tmp_path)
    failpoints.reset("apply.step.roce-tos=1:error,restore.step.tc-mark=1:error")
    assert agent.apply_pass().rollback_incomplete
    failpoints.reset("")
    agent.config = make_config(
        nics={"interfaceNames": ["eth9"]}, transport={"mode": "softroce"}, generation=5
    )
    result = agent.apply_pass()
    assert agent.state.plan is not None and not agent.state.plan.ok
    assert not result.ok and not result.rollback_incomplete, result.undo_errors
    assert _marked_dscp(agent) == {26}
    status = agent.state.status
    assert status is not None and status.phase == "Failed"
    assert _ready(status)[0] == constants.NODESTATE_REASON_PLAN_BLOCKED


CM = "/sys/kernel/config/rdma_cm"


def test_a_first_apply_that_changed_nothing_at_its_failed_step_is_apply_failed(
    tmp_path: Path,
) -> None:
    """The e2e case (test_failed_step_rolls_back_and_is_reported): rdma_cm's configfs is
    mounted read-only, so the first apply fails creating the device's directory, and
    removing that directory fails as well (EROFS comes before the lookup), although the
    step changed nothing. Only knobs that differ from their last verified (here:
    pre-agent) value are left off: the node reads ApplyFailed, not RollbackIncomplete,
    what the pass made before is undone, and nothing stays journaled."""
    tree, kernel = softroce_node(tmp_path / "root")
    tree.configfs()
    agent = fixture_agent(tmp_path, tree, kernel, softroce_cfg(1400, 26, 3))
    agent.host.read_only.add(CM)  # type: ignore[attr-defined]
    result = agent.apply_pass()
    assert not result.ok and result.failed_step is not None
    assert result.failed_step.name == "rdma-cm-configfs on rxe_eth0"
    assert "Read-only file system" in result.error
    assert not result.rollback_incomplete, (result.left_off, result.undo_errors)
    assert result.undo_errors == []
    status = agent.state.status
    assert status is not None and status.phase == "Failed"
    reason, message = _ready(status)
    assert reason == constants.NODESTATE_REASON_APPLY_FAILED, message
    # nothing half-applied: the rxe link and the marking the pass made are undone
    assert not agent.host.exists("/sys/class/infiniband/rxe_eth0")
    assert _marked_dscp(agent) == set()
    assert len(agent.engine.journal) == 0
    assert agent.state.next_retry is not None, "a failed apply is retried"

    # the revert that follows (the network deleted with cleanupOnDelete) completes
    agent.revert()
    assert agent.state.reverted
    assert agent.state.status is not None and agent.state.status.phase == "Reverted"


def test_a_revert_drops_a_knob_already_at_its_original_without_undoing_it(
    node: Callable[..., Node],
) -> None:
    """A killed agent can leave a step journaled but never applied (killed at
    apply.before_step): its knob still reads as the original the journal holds, so the
    revert has nothing to undo there and drops the entry, even where undoing would fail
    (rdma_cm's configfs read-only: removing a directory that is not there fails with
    EROFS). Before, every retry of the revert failed on it and the node never reverted."""
    n = node(softroce_node)
    n.tree.configfs()
    cfg = softroce_cfg(1400, 26, 3)
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    journal = Journal(n.host, cfg.network)
    cm_dir = next(s for s in plan.steps if s.kind == "rdma-cm-dir")
    journal.put(cm_dir, cm_dir.snapshot(n.host), None)  # journaled, then killed
    n.host.read_only.add(CM)
    result = Engine(n.host, Journal(n.host, cfg.network)).revert()
    assert result.ok, result.errors
    assert len(Journal(n.host, cfg.network)) == 0


def _serving(agent: Agent) -> tuple[int, int, bool]:
    """(healthy units, all units) of the agent's device plugin, and whether the NodeState
    says the transport is ready."""
    assert agent.plugin is not None and agent.state.status is not None
    plugin = agent.plugin.status()
    transport = agent.state.status.transport
    return plugin.healthy_units, plugin.total_units, bool(transport and transport.ready)


def test_a_rolled_back_reapply_keeps_the_devices_healthy_and_the_transport_ready(
    tmp_path: Path, faults: None, sockdir: Path
) -> None:
    """Config B fails and is rolled back whole: the node runs the last verified config,
    which running jobs use, so the device plugin keeps its units healthy and the
    transport stays ready, while the NodeState reports the failed attempt (Failed,
    ApplyFailed, retried). Only when the rollback fails too (the node on neither config)
    do the units go unhealthy and the transport not ready."""
    agent = _agent_on_a(tmp_path, device_plugin_dir=sockdir)
    try:
        healthy, total, ready = _serving(agent)
        assert total > 0 and healthy == total and ready

        failpoints.reset("apply.step.roce-tos=1:error")
        result = agent.apply_pass()
        assert not result.ok and result.verified_in_force
        status = agent.state.status
        assert status is not None and status.phase == "Failed"
        assert _ready(status)[0] == constants.NODESTATE_REASON_APPLY_FAILED
        assert agent.state.next_retry is not None
        assert any(e.step == "retry" for e in status.errors or [])
        healthy, total, ready = _serving(agent)
        assert healthy == total > 0, agent.plugin.status().unhealthy if agent.plugin else None
        assert ready

        # the rollback fails too: the marking is left on B's DSCP, A is not in force
        failpoints.reset("apply.step.roce-tos=1:error,restore.step.tc-mark=1:error")
        result = agent.apply_pass()
        assert result.rollback_incomplete and not result.verified_in_force
        healthy, total, ready = _serving(agent)
        assert healthy == 0 and total > 0 and not ready

        # once the next attempt restores A, both come back
        failpoints.reset("apply.step.roce-tos=1:error")
        result = agent.apply_pass()
        assert not result.ok and result.verified_in_force
        healthy, total, ready = _serving(agent)
        assert healthy == total > 0 and ready
    finally:
        agent.stop_plugin()


def test_a_metaroce_state_in_force_serves_only_its_own_library() -> None:
    """A rolled-back re-apply of a metaroce network keeps serving only when the plan's
    library is the one in force: pods of a library change that failed would otherwise be
    handed a version the node never verified."""
    from metaroce_agent.engine import ApplyResult, verified_state_serving
    from metaroce_agent.plan import Plan
    from metaroce_agent.qos.mtu import MtuStep
    from metaroce_agent.transport.base import Library
    from metaroce_agent.transport.library import MetaRoceLibraryStep

    old = MetaRoceLibraryStep("", version="1.0", checksum="a" * 64, network="rdma-a")
    new = MetaRoceLibraryStep("", version="1.1", checksum="b" * 64, network="rdma-a")
    result = ApplyResult(ok=False, in_force=[old, MtuStep("eth0")], verified_in_force=True)

    def plan(step: MetaRoceLibraryStep) -> Plan:
        lib = Library(directory=step.directory, version=step.version, checksum=step.checksum)
        return Plan(mode="metaroce", library=lib)

    assert verified_state_serving(result, plan(old)) == result.in_force
    assert verified_state_serving(result, plan(new)) == []
    # a rollback left incomplete, or a pass that verified, is not this case
    incomplete = ApplyResult(ok=False, in_force=[old], left_off=[MtuStep("eth0")])
    assert verified_state_serving(incomplete, plan(old)) == []
    assert verified_state_serving(ApplyResult(ok=True, applied=[old]), plan(old)) == []
