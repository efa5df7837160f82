"""The leader's node pass (stale NodeStates, NIC conflicts, probe taints), the agents'
RBAC, and an idle operator making no writes but its lease renewals."""

from __future__ import annotations

import time
from typing import Any

import yaml
from conftest import OperatorEnv
from operator_env import LoadGenerator, condition, get_json, network_manifest, wait_for

from metaroce_api import ProbePeer
from metaroce_api import constants as c
from metaroce_api.examples import minimal_nodestate
from metaroce_harness.cluster import FakeNode
from metaroce_operator.render.common import child_name

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}


def test_stale_nodestates_are_collected(env: OperatorEnv) -> None:
    env.start_operator("--nodestate-grace=1s")
    env.loadgen("house")
    env.apply(network_manifest("house", nodeSelector=POOL_A))
    env.wait_condition("house", c.CONDITION_READY, "True")
    ghost = minimal_nodestate("house", "ghost-node")
    orphan = minimal_nodestate("no-such-network", "kwok-a1")
    env.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([ghost, orphan]))
    names = {ghost["metadata"]["name"], orphan["metadata"]["name"]}

    def present() -> set[str]:
        found = get_json(env.cluster, c.NODESTATE_PLURAL) or {}
        return {i["metadata"]["name"] for i in found.get("items") or []} & names

    wait_for("stale NodeStates to be deleted", lambda: not present(), timeout=30)
    # The real ones stay.
    assert len(env.nodestates("house")) == 2


def test_nic_conflicts_hold_the_network_created_later(env: OperatorEnv) -> None:
    env.start_operator()
    env.loadgen("left")
    env.apply(network_manifest("left", nodeSelector=POOL_A, nics={"interfaceNames": ["eth1"]}))
    env.wait_condition("left", c.CONDITION_READY, "True")
    env.apply(network_manifest("right", nics={"interfaceNames": ["eth*"]}))
    env.apply(network_manifest("apart", nodeSelector=POOL_A, nics={"interfaceNames": ["ens9"]}))

    # The later network is held: told why and how to fix it, and no agents roll out.
    right = env.wait_condition("right", c.CONDITION_READY, "False", reason=c.REASON_NIC_CONFLICT)
    message = condition(right, c.CONDITION_READY)["message"]
    assert "rollout held" in message and "network 'left'" in message, message
    assert "kwok-a1" in message and "disjoint" in message, message
    progressing = condition(right, c.CONDITION_PROGRESSING)
    assert (progressing["status"], progressing["reason"]) == ("False", c.REASON_NIC_CONFLICT)
    assert right["status"]["observedGeneration"] == right["metadata"]["generation"]
    # The older network keeps its NICs and its Ready, and names the held one.
    left = env.wait_condition("left", c.CONDITION_DEGRADED, "True", reason=c.REASON_NIC_CONFLICT)
    assert "'right' was created later" in condition(left, c.CONDITION_DEGRADED)["message"]
    assert condition(left, c.CONDITION_READY)["status"] == "True"
    apart = env.wait_condition("apart", c.CONDITION_PROGRESSING, "True")
    assert condition(apart, c.CONDITION_DEGRADED).get("reason") != c.REASON_NIC_CONFLICT
    time.sleep(4)  # a node pass or more: still no DaemonSet for the held network
    assert env.daemonset("right") is None
    assert env.daemonset("apart") is not None

    # Fixing the held network's spec rolls it out at once; both conflicts clear.
    env.apply(network_manifest("right", nics={"interfaceNames": ["eth2"]}))
    wait_for("right's DaemonSet", lambda: env.daemonset("right") is not None, timeout=30)
    for name in ("left", "right"):
        wait_for(
            f"{name} without conflict",
            lambda name=name: (
                condition(env.network(name), c.CONDITION_DEGRADED).get("reason")
                != c.REASON_NIC_CONFLICT
            ),
            timeout=30,
        )
    assert condition(env.network("left"), c.CONDITION_READY)["status"] == "True"


def test_a_held_rollout_resumes_when_the_older_network_goes(env: OperatorEnv) -> None:
    env.start_operator()
    env.loadgen("first")
    env.loadgen("second")
    env.apply(network_manifest("first", nodeSelector=POOL_A))
    env.wait_condition("first", c.CONDITION_READY, "True")
    env.apply(network_manifest("second", nodeSelector=POOL_A))
    env.wait_condition("second", c.CONDITION_READY, "False", reason=c.REASON_NIC_CONFLICT)
    assert env.daemonset("second") is None and not env.nodestates("second")
    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "first", "--wait=true", "--timeout=60s")
    # Nothing about "second" changed: the node pass sees the conflict gone and resumes.
    env.wait_condition("second", c.CONDITION_READY, "True", timeout=90)
    assert len(env.nodestates("second")) == 2


def _peers(node: str, nodes: list[str], bad: set[str]) -> list[ProbePeer]:
    return [
        ProbePeer(node=p, reachable=not ({p, node} & bad), latency_p99_microseconds=20.0)
        for p in nodes
        if p != node
    ]


def _tainted(env: OperatorEnv, nodes: list[str]) -> dict[str, str]:
    out = {}
    for node in nodes:
        body = get_json(env.cluster, "node", node) or {}
        for taint in (body.get("spec") or {}).get("taints") or []:
            if taint["key"] == c.UNHEALTHY_TAINT_KEY:
                out[node] = taint.get("value", "")
    return out


def test_probe_failures_taint_nodes_within_the_cap(env: OperatorEnv) -> None:
    nodes = [f"probe-t{i}" for i in range(4)]
    env.cluster.add_nodes(
        [FakeNode(n, labels={"harness.metaroce.io/pool": "probe-t"}) for n in nodes]
    )
    try:
        env.start_operator()
        gen: LoadGenerator = env.loadgen("probed")
        bad = {"probe-t2"}
        for n in nodes:
            gen.probe_peers[n] = _peers(n, nodes, bad)
        env.apply(
            network_manifest(
                "probed",
                nodeSelector={"matchLabels": {"harness.metaroce.io/pool": "probe-t"}},
                health={"action": "taint", "maxTaintedFraction": 0.25},
            )
        )
        net = env.wait_condition(
            "probed", c.CONDITION_DEGRADED, "True", reason=c.REASON_NODES_UNHEALTHY
        )
        assert [f["node"] for f in net["status"]["failingNodes"]] == ["probe-t2"]
        wait_for(
            "probe-t2 tainted", lambda: _tainted(env, nodes) == {"probe-t2": "probed"}, timeout=30
        )

        # A second bad node: the cap (25% of 4 = 1) holds its taint back, and says so.
        bad = {"probe-t2", "probe-t3"}
        for n in nodes:
            gen.probe_peers[n] = _peers(n, nodes, bad)
        gen.rewrite(nodes)
        wait_for(
            "the cap to be reported",
            lambda: (
                "were not tainted"
                in condition(env.network("probed"), c.CONDITION_DEGRADED).get("message", "")
            ),
            timeout=30,
        )
        assert _tainted(env, nodes) == {"probe-t2": "probed"}

        # Healed: the taint goes.
        for n in nodes:
            gen.probe_peers[n] = _peers(n, nodes, set())
        gen.rewrite(nodes)
        env.wait_condition("probed", c.CONDITION_READY, "True", timeout=60)
        wait_for("taints removed", lambda: not _tainted(env, nodes), timeout=30)
    finally:
        env.cluster.kubectl("delete", "node", *nodes, "--wait=false", check=False)


def test_agent_rbac_is_least_privilege(env: OperatorEnv) -> None:
    env.start_operator()
    env.apply(network_manifest("rbac", nodeSelector=POOL_A))
    wait_for("the agent's ServiceAccount", lambda: env.daemonset("rbac") is not None)
    agent = f"system:serviceaccount:{env.namespace}:{child_name('rbac')}"

    def can(*args: str) -> bool:
        proc = env.cluster.kubectl("auth", "can-i", *args, "--as", agent, check=False)
        return bool(proc.stdout.strip() == "yes")

    assert can("create", f"{c.NODESTATE_PLURAL}.{c.GROUP}")
    assert can("patch", f"{c.NODESTATE_PLURAL}.{c.GROUP}")
    # No status subresource on NodeStates, so no rule for one.
    assert not can("patch", f"{c.NODESTATE_PLURAL}.{c.GROUP}", "--subresource=status")
    assert can("get", f"{c.NETWORK_PLURAL}.{c.GROUP}/rbac")
    assert can("get", "nodes/kwok-a1")
    assert can("create", "events", "-n", "default")
    assert not can("delete", f"{c.NODESTATE_PLURAL}.{c.GROUP}")
    assert not can("get", f"{c.NETWORK_PLURAL}.{c.GROUP}/other")
    assert not can("update", f"{c.NETWORK_PLURAL}.{c.GROUP}/rbac")
    assert not can("patch", "nodes/kwok-a1")
    assert not can("get", "secrets", "-n", env.namespace)
    assert not can("list", "pods", "-n", env.namespace)


def _versions(env: OperatorEnv, network: str) -> dict[str, Any]:
    name = child_name(network)
    out: dict[str, Any] = {}
    for key, args in {
        "network": [c.NETWORK_PLURAL, network],
        "daemonset": ["daemonset", name, "-n", env.namespace],
        "configmap": ["configmap", name, "-n", env.namespace],
        "serviceaccount": ["serviceaccount", name, "-n", env.namespace],
        "clusterrole": ["clusterrole", name],
        "clusterrolebinding": ["clusterrolebinding", name],
    }.items():
        out[key] = (get_json(env.cluster, *args) or {})["metadata"]["resourceVersion"]
    out["nodestates"] = sorted(
        (n["metadata"]["name"], n["metadata"]["resourceVersion"]) for n in env.nodestates(network)
    )
    nodes = get_json(env.cluster, "nodes") or {}
    out["node-writes"] = sorted(
        (n["metadata"]["name"], m.get("time"))
        for n in nodes.get("items") or []
        for m in n["metadata"].get("managedFields") or []
        if m.get("manager", "").startswith(("metaroce", "kopf", "Python"))
    )
    out["events"] = len(
        (
            get_json(
                env.cluster, "events", "-n", "default", "-l", f"{c.MANAGED_BY_LABEL}={c.MANAGED_BY}"
            )
            or {}
        ).get("items")
        or []
    )
    return out


def test_idle_operator_writes_nothing_but_its_lease(env: OperatorEnv) -> None:
    op = env.start_operator("--housekeeping-interval=2s", "--status-interval=1s")
    gen = env.loadgen("quiet")
    env.apply(network_manifest("quiet", nodeSelector=POOL_A, health={"action": "taint"}))
    env.wait_condition("quiet", c.CONDITION_READY, "True")
    # and the rollout over: the agents available (ready for minReadySeconds)
    env.wait_condition("quiet", c.CONDITION_PROGRESSING, "False", timeout=60)
    wait_for("the load generator to settle", lambda: time.monotonic() - gen.last_write > 3)
    time.sleep(3)
    lease_before = (get_json(env.cluster, "lease", "metaroce-operator", "-n", env.namespace) or {})[
        "metadata"
    ]["resourceVersion"]
    before = _versions(env, "quiet")
    writes_before = op.metric("metaroce_operator_status_writes_total")
    time.sleep(20)
    after = _versions(env, "quiet")
    lease_after = (get_json(env.cluster, "lease", "metaroce-operator", "-n", env.namespace) or {})[
        "metadata"
    ]["resourceVersion"]
    assert after == before
    assert op.metric("metaroce_operator_status_writes_total") == writes_before
    assert lease_after != lease_before, "the lease was not renewed: the check proves nothing"
