"""The agents' upgrade policy (issue 16 #17) against the real apiserver and DaemonSet
controller: a node that holds off updates by label keeps its agent while the other
nodes' agents are replaced; the hold shows in status and ends at its deadline; a paused
network replaces no agent and stays Ready on the config its agents run.

On b6733c0 (and until this fix) the DaemonSet is always RollingUpdate: a spec change
restarts every agent, the one under a running job too."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from conftest import OperatorEnv
from operator_env import condition, network_manifest, wait_for

from metaroce_api import constants as c
from metaroce_harness.cluster import FakeNode

NODES = ["upg-1", "upg-2", "upg-3"]
POOL = {"matchLabels": {"harness.metaroce.io/pool": "upg"}}
REVISION = "controller-revision-hash"


def _pods(env: OperatorEnv, network: str) -> dict[str, tuple[str, str]]:
    """node -> (pod name, revision) of the live agents."""
    out = {}
    for pod in env.agent_pods(network):
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        out[pod["spec"].get("nodeName", "")] = (meta["name"], meta["labels"].get(REVISION, ""))
    return out


def _strategy(env: OperatorEnv, network: str) -> str:
    return str(((env.daemonset(network) or {}).get("spec") or {}).get("updateStrategy", {})
               .get("type"))  # fmt: skip


def _agent_update(env: OperatorEnv, network: str) -> dict[str, Any]:
    return dict(((env.network(network) or {}).get("status") or {}).get("agentUpdate") or {})


def _ready(env: OperatorEnv, network: str) -> tuple[str, str]:
    """(status, lastTransitionTime) of the network's Ready condition."""
    cond = condition(env.network(network), c.CONDITION_READY)
    return str(cond.get("status")), str(cond.get("lastTransitionTime"))


def _deadline(delta: timedelta) -> str:
    return (datetime.now(UTC) + delta).strftime(c.UPDATE_HOLD_FORMAT)


def test_a_node_holding_updates_keeps_its_agent_until_the_deadline_issue_16_17(
    env: OperatorEnv,
) -> None:
    env.cluster.add_nodes([FakeNode(n, labels={"harness.metaroce.io/pool": "upg"}) for n in NODES])
    try:
        env.start_operator("--housekeeping-interval=2s")
        env.loadgen("upg")
        manifest = network_manifest(
            "upg", nodeSelector=POOL, agent={"updateStrategy": {"maxUnavailable": 2}}
        )
        env.apply(manifest)
        env.wait_condition("upg", c.CONDITION_READY, "True")
        before = wait_for("an agent on each node", lambda: (p := _pods(env, "upg")) and
                          set(p) >= set(NODES) and p, timeout=60)  # fmt: skip
        assert _strategy(env, "upg") == "RollingUpdate"

        ready_since = _ready(env, "upg")
        hold = f"{c.UPDATE_HOLD_LABEL}={_deadline(timedelta(minutes=30))}"
        env.cluster.kubectl("label", "node", "upg-2", hold)
        wait_for("the DaemonSet to be OnDelete", lambda: _strategy(env, "upg") == "OnDelete",
                 timeout=30)  # fmt: skip
        shown = wait_for("the hold in status", lambda: (u := _agent_update(env, "upg"))
                         .get("holding") == 1 and u, timeout=30)  # fmt: skip
        assert shown["strategy"] == "OnDelete"
        assert shown["heldNodes"][0]["node"] == "upg-2"
        assert shown["heldNodes"][0]["state"] == "holding"
        # A node merely holding (the DaemonSet switched to OnDelete) does not flap Ready.
        assert _ready(env, "upg") == ready_since, "Ready went False and back for a hold"

        # A spec change that restarts agents (a new config): only the nodes not holding.
        manifest["spec"]["agent"]["logLevel"] = "debug"
        env.apply(manifest)

        def others_updated() -> dict[str, tuple[str, str]] | None:
            now = _pods(env, "upg")
            if not {"upg-1", "upg-3"} <= set(now):
                return None
            fresh = all(now[n][1] != before[n][1] for n in ("upg-1", "upg-3"))
            return now if fresh else None

        after = wait_for("the other nodes' agents to be replaced", others_updated, timeout=120)
        # Once they report the new config, the held node serving the old one keeps Ready.
        ready = env.wait_condition("upg", c.CONDITION_READY, "True", generation=2)
        message = next(x for x in ready["status"]["conditions"] if x["type"] == "Ready")["message"]
        assert "1 of them hold off the agent update" in message, message
        time.sleep(5)  # a few node passes: the held node's agent stays
        assert _pods(env, "upg")["upg-2"] == before["upg-2"], "the held node's agent was replaced"
        assert after["upg-1"][1] == after["upg-3"][1]

        # The deadline passes: the DaemonSet is RollingUpdate again and updates upg-2.
        passed = f"{c.UPDATE_HOLD_LABEL}={_deadline(-timedelta(minutes=1))}"
        env.cluster.kubectl("label", "node", "upg-2", "--overwrite", passed)
        wait_for("the DaemonSet to be RollingUpdate", lambda: _strategy(env, "upg") ==
                 "RollingUpdate", timeout=30)  # fmt: skip
        wait_for("the held node's agent to be updated",
                 lambda: _pods(env, "upg").get("upg-2", ("", ""))[1] == after["upg-1"][1],
                 timeout=120)  # fmt: skip
        expired = _agent_update(env, "upg")
        assert expired["holding"] == 0 and expired["heldNodes"][0]["state"] == "expired"
    finally:
        env.cluster.kubectl("delete", "node", *NODES, "--wait=false", check=False)


def test_a_paused_network_replaces_no_agent_issue_16_17(env: OperatorEnv) -> None:
    env.cluster.add_nodes([FakeNode(n, labels={"harness.metaroce.io/pool": "upg"}) for n in NODES])
    try:
        env.start_operator("--housekeeping-interval=2s")
        env.loadgen("paused")
        manifest = network_manifest("paused", nodeSelector=POOL)
        env.apply(manifest)
        env.wait_condition("paused", c.CONDITION_READY, "True")
        before = wait_for("an agent on each node", lambda: (p := _pods(env, "paused")) and
                          set(p) >= set(NODES) and p, timeout=60)  # fmt: skip

        manifest["spec"]["agent"] = {"updateStrategy": {"paused": True}, "logLevel": "debug"}
        env.apply(manifest)
        wait_for("the DaemonSet to be OnDelete", lambda: _strategy(env, "paused") == "OnDelete",
                 timeout=30)  # fmt: skip
        wait_for("paused in status", lambda: _agent_update(env, "paused").get("paused") is True,
                 timeout=30)  # fmt: skip
        # The agents still serve the config they run: a pause holds every node, so Ready
        # stays True as for a node holding by label (it went False until the unpause).
        ready = env.wait_condition("paused", c.CONDITION_READY, "True", generation=2)
        message = next(x for x in ready["status"]["conditions"] if x["type"] == "Ready")["message"]
        assert "on an older config while agent updates are paused" in message, message
        time.sleep(8)
        assert _pods(env, "paused") == before, "a paused network's agents were replaced"

        manifest["spec"]["agent"]["updateStrategy"]["paused"] = False
        env.apply(manifest)
        wait_for("the rollout to go on",
                 lambda: all(v[1] != before[k][1] for k, v in _pods(env, "paused").items()
                             if k in before) and set(_pods(env, "paused")) >= set(NODES),
                 timeout=120)  # fmt: skip
    finally:
        env.cluster.kubectl("delete", "node", *NODES, "--wait=false", check=False)
