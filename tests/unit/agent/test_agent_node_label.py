"""The operator's node label asks the agent to revert (issue 15 finding 4): an agent
cannot tell its node leaving the network's nodeSelector from a rollout (both are a
SIGTERM), so the operator keeps the agent there with `metaroce.io/agent-<network>`
and sets it to `revert`; the agent reverts the node (with cleanupOnDelete) and reports
it, and applies again if the node is selected again before it went.

On b6733c0 (and until this fix) there is no such label: a deselected node keeps the
network's settings and journal."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import make_config
from fakes import fixture_agent, running, softroce_node, until

from metaroce_agent.loop import Agent
from metaroce_api import constants as c

TOS = "/sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos"


def _agent(tmp_path: Path, cleanup: bool) -> Agent:
    tree, kernel = softroce_node(tmp_path / "root")
    config = make_config(
        driftInterval="1h", nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"},
        cleanupOnDelete=cleanup,
    )  # fmt: skip
    return fixture_agent(tmp_path, tree, kernel, config)


def _node(value: str | None) -> dict[str, object]:
    labels = {"kubernetes.io/hostname": "node-1"}
    if value is not None:
        labels[c.node_label("rdma-a")] = value
    return {"metadata": {"name": "node-1", "labels": labels}}


@pytest.fixture(autouse=True)
def _fast(fast_loop: None) -> None:
    """Every test here runs the loop fast (conftest's fast_loop)."""


def test_a_node_that_left_the_network_is_reverted_and_reapplied_if_it_comes_back(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path, cleanup=True)
    with running(agent) as a:
        assert until(lambda: a.state.status is not None and a.state.status.phase == "Ready", 10)
        assert a.host.read(TOS) == "104"
        a._check_node(_node(c.NODE_SELECTED))
        time.sleep(0.3)
        assert not a.state.reverted
        a._check_node(_node(c.NODE_REVERT))  # the node left the nodeSelector
        assert until(lambda: a.state.status is not None and a.state.status.phase == "Reverted",
                      10), a.state.status  # fmt: skip
        assert a.host.read_opt(TOS) != "104"  # the rxe link and its configfs are gone
        a._check_node(_node(c.NODE_SELECTED))  # selected again before the agent went
        assert until(lambda: a.state.status is not None and a.state.status.phase == "Ready", 10)
        assert a.host.read(TOS) == "104"


def test_without_cleanup_on_delete_the_node_keeps_its_settings(tmp_path: Path) -> None:
    agent = _agent(tmp_path, cleanup=False)
    with running(agent) as a:
        assert until(lambda: a.state.status is not None and a.state.status.phase == "Ready", 10)
        a._check_node(_node(c.NODE_REVERT))
        time.sleep(0.5)
        assert not a.state.reverted and a.host.read(TOS) == "104"
