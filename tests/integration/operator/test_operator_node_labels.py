"""The operator-managed node label (issue 15 finding 4), against the real apiserver: a
node leaving a cleanupOnDelete network's nodeSelector keeps its agent (the label
`metaroce.io/agent-<network>=revert` keeps it placed) until its NodeState reports
reverted; only then does the label go, and the DaemonSet controller removes the agent.
Labels of a deleted network go with it.

On b6733c0 (and until this fix) the agent goes with the selector: the node keeps the
network's settings and journal, which a later network on the NIC adopts as originals."""

from __future__ import annotations

import time

from conftest import OperatorEnv
from operator_env import get_json, network_manifest, wait_for

from metaroce_api import constants as c
from metaroce_harness.cluster import FakeNode

NODES = ["lab-1", "lab-2"]
POOL = {"matchLabels": {"harness.metaroce.io/pool": "lab"}}
LABEL = c.node_label("leaving")


def _labels(
    env: OperatorEnv, label: str = LABEL, nodes: list[str] = NODES
) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for node in nodes:
        body = get_json(env.cluster, "node", node) or {}
        out[node] = ((body.get("metadata") or {}).get("labels") or {}).get(label)
    return out


def _agent_nodes(env: OperatorEnv, network: str = "leaving", nodes: list[str] = NODES) -> set[str]:
    return {p["spec"].get("nodeName") for p in env.agent_pods(network)} & set(nodes)


def test_a_node_leaving_the_selector_keeps_its_agent_until_it_reverted_issue_15_4(
    env: OperatorEnv,
) -> None:
    env.cluster.add_nodes([FakeNode(n, labels={"harness.metaroce.io/pool": "lab"}) for n in NODES])
    try:
        env.start_operator("--cleanup-timeout=300s")
        gen = env.loadgen("leaving")
        env.apply(network_manifest("leaving", nodeSelector=POOL, cleanupOnDelete=True))
        env.wait_condition("leaving", c.CONDITION_READY, "True")
        wait_for("both nodes labelled", lambda: _labels(env) == dict.fromkeys(NODES, "selected"),
                 timeout=30)  # fmt: skip
        assert _agent_nodes(env) == set(NODES)

        env.cluster.kubectl("label", "node", "lab-2", "harness.metaroce.io/pool=elsewhere",
                            "--overwrite")  # fmt: skip
        asked = {"lab-1": "selected", "lab-2": "revert"}
        wait_for("lab-2 asked to revert", lambda: _labels(env) == asked, timeout=30)
        time.sleep(3)  # a few node passes and DaemonSet syncs
        assert _agent_nodes(env) == set(NODES), "the agent went before it reverted its node"
        assert _labels(env)["lab-2"] == "revert"

        gen.revert(["lab-2"])  # its agent reports the node reverted
        wait_for("lab-2's label to go", lambda: _labels(env)["lab-2"] is None, timeout=30)
        wait_for("lab-2's agent to go", lambda: _agent_nodes(env) == {"lab-1"}, timeout=60)

        gen.revert(["lab-1"])
        env.cluster.kubectl("delete", c.NETWORK_PLURAL, "leaving", "--wait=true", "--timeout=60s")
        env.networks.discard("leaving")
        wait_for("the deleted network's labels to go",
                 lambda: _labels(env) == dict.fromkeys(NODES), timeout=30)  # fmt: skip
    finally:
        env.cluster.kubectl("delete", "node", *NODES, "--wait=false", check=False)


def test_a_network_without_cleanup_labels_no_node_issue_16_scale(env: OperatorEnv) -> None:
    """The label keeps an agent until it reverted its node; without cleanupOnDelete
    nothing is reverted, so no node gets it (the scale bench's operator arm wrote one
    Node patch per node for it, its whole surplus over the limit arm). The agents run
    on the selected nodes all the same, and go when a node leaves the selector."""
    nodes = ["plain-1", "plain-2"]
    labels = {"harness.metaroce.io/pool": "plain"}
    env.cluster.add_nodes([FakeNode(n, labels=labels) for n in nodes])
    label = c.node_label("plain")
    try:
        env.start_operator()
        env.loadgen("plain")
        env.apply(network_manifest("plain", nodeSelector={"matchLabels": labels}))
        env.wait_condition("plain", c.CONDITION_READY, "True")
        wait_for("an agent on both nodes",
                 lambda: _agent_nodes(env, "plain", nodes) == set(nodes), timeout=30)  # fmt: skip
        time.sleep(3)  # a few node passes
        assert _labels(env, label, nodes) == dict.fromkeys(nodes)

        env.cluster.kubectl("label", "node", "plain-2", "harness.metaroce.io/pool=elsewhere",
                            "--overwrite")  # fmt: skip
        wait_for("plain-2's agent to go",
                 lambda: _agent_nodes(env, "plain", nodes) == {"plain-1"}, timeout=60)  # fmt: skip
        assert _labels(env, label, nodes) == dict.fromkeys(nodes)
    finally:
        env.cluster.kubectl("delete", "node", *nodes, "--wait=false", check=False)
