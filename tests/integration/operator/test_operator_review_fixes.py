"""Regression tests of the operator review (issue 16), against the real apiserver.

Each test here failed on b6733c0 (see hack/show-operator-regressions.sh):
- #1: nothing that decides from observed NodeStates runs before the informer's first
  list completed (the cleanup finalizer was released at once when that list failed);
- #2: deleting a network takes its probe taints along;
- #7: the cleanup finalizer is on the network before any child exists, and foreground
  deletion (Argo CD's prune default) keeps the agents until the nodes reported reverted.
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest
import yaml
from conftest import OperatorEnv
from operator_env import LoadGenerator, condition, get_json, network_manifest, wait_for
from test_operator_nodes import _peers, _tainted

from metaroce_api import constants as c
from metaroce_api import failpoints
from metaroce_harness.cluster import FakeNode
from metaroce_operator.render.common import child_name

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}
BLIND_USER = "metaroce-test-blind-operator"


def _finalizers(env: OperatorEnv, name: str) -> list[str]:
    return list(((env.network(name) or {}).get("metadata") or {}).get("finalizers") or [])


def _blind_operator_rbac(env: OperatorEnv, can_list_nodestates: bool) -> None:
    """What the operator may do, except (unless `can_list_nodestates`) list and watch
    NodeStates: its informer's first list then fails and retries, as it does while the
    apiserver times out that list or RBAC is being fixed."""
    nodestate_verbs = ["get", "create", "update", "patch", "delete", "deletecollection"]
    if can_list_nodestates:
        nodestate_verbs += ["list", "watch"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": BLIND_USER},
        "rules": [
            {
                "apiGroups": [
                    "",
                    "apps",
                    "rbac.authorization.k8s.io",
                    "coordination.k8s.io",
                    "admissionregistration.k8s.io",
                    "events.k8s.io",
                ],
                "resources": ["*"],
                "verbs": ["*"],
            },
            {
                "apiGroups": [c.GROUP],
                "resources": [
                    c.NETWORK_PLURAL,
                    f"{c.NETWORK_PLURAL}/status",
                    f"{c.NETWORK_PLURAL}/finalizers",
                ],
                "verbs": ["*"],
            },
            {"apiGroups": [c.GROUP], "resources": [c.NODESTATE_PLURAL], "verbs": nodestate_verbs},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": BLIND_USER},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": BLIND_USER,
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": BLIND_USER}],
    }
    env.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))


def test_cleanup_finalizer_waits_for_the_first_nodestate_list(env: OperatorEnv) -> None:
    """#1: a new leader whose NodeState list has not completed knows no report: it must
    not conclude that no node is left to revert."""
    first = env.start_operator("--cleanup-timeout=300s")
    gen = env.loadgen("blind")
    env.apply(network_manifest("blind", nodeSelector=POOL_A, cleanupOnDelete=True))
    env.wait_condition("blind", c.CONDITION_READY, "True")
    first.stop()  # releases the lease

    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "blind", "--wait=false")
    _blind_operator_rbac(env, can_list_nodestates=False)
    try:
        blind = env.start_operator(
            "--cleanup-timeout=300s",
            identity="operator-blind",
            kubeconfig=env.cluster.kubeconfig_for(BLIND_USER),
        )
        wait_for(
            "the NodeState list to be refused",
            lambda: "metarocenodestates" in blind.log() and "403" in blind.log(),
            timeout=30,
        )
        time.sleep(8)  # several status intervals and node passes
        assert env.network("blind") is not None, (
            "the finalizer was released before any node reported reverted:\n" + blind.log()[-3000:]
        )
        assert c.CLEANUP_FINALIZER in _finalizers(env, "blind")
        assert env.daemonset("blind") is not None, "the agents must stay until they reverted"

        # Once the list works, the reports decide: released after both nodes reverted.
        _blind_operator_rbac(env, can_list_nodestates=True)
        gen.revert(["kwok-a1", "kwok-a2"])
        wait_for("the network to be released", lambda: env.network("blind") is None, timeout=90)
        env.networks.discard("blind")
    finally:
        env.cluster.kubectl("delete", "clusterrolebinding,clusterrole", BLIND_USER, check=False)


def test_deleting_a_network_removes_its_taints(env: OperatorEnv) -> None:
    """#2: a deleted network's taint would keep the node unschedulable for every pod and
    count against other networks' cap."""
    nodes = [f"gone-t{i}" for i in range(4)]
    env.cluster.add_nodes(
        [FakeNode(n, labels={"harness.metaroce.io/pool": "gone-t"}) for n in nodes]
    )
    try:
        env.start_operator()
        gen: LoadGenerator = env.loadgen("doomed")
        for n in nodes:
            gen.probe_peers[n] = _peers(n, nodes, {"gone-t1"})
        env.apply(
            network_manifest(
                "doomed",
                nodeSelector={"matchLabels": {"harness.metaroce.io/pool": "gone-t"}},
                health={"action": "taint", "maxTaintedFraction": 0.25},
            )
        )
        wait_for(
            "gone-t1 tainted", lambda: _tainted(env, nodes) == {"gone-t1": "doomed"}, timeout=60
        )
        env.cluster.kubectl("delete", c.NETWORK_PLURAL, "doomed", "--wait=true", "--timeout=60s")
        env.networks.discard("doomed")
        wait_for("the deleted network's taint to go", lambda: not _tainted(env, nodes), timeout=30)
    finally:
        env.cluster.kubectl("delete", "node", *nodes, "--wait=false", check=False)


def test_cleanup_finalizer_is_added_before_any_child(env: OperatorEnv) -> None:
    """#7: killed right after the first children were applied, the operator must have
    put the finalizer on already (else a deletion now would skip the revert)."""
    env.apply(network_manifest("first", nodeSelector=POOL_A, cleanupOnDelete=True))
    crashing = env.start_operator(
        env={failpoints.ENV: "rollout.after_configmap=1"}, wait_leader=False
    )
    assert crashing.wait(90) == -signal.SIGKILL, crashing.log()[-3000:]
    cm = get_json(env.cluster, "configmap", child_name("first"), "-n", env.namespace)
    assert cm is not None, "the kill point was not reached: the test proves nothing"
    assert c.CLEANUP_FINALIZER in _finalizers(env, "first"), json.dumps(env.network("first"))
    # A successor converges; with a short timeout, the teardown's deletion is quick.
    env.start_operator("--cleanup-timeout=5s", identity="operator-1")
    env.wait_condition("first", c.CONDITION_PROGRESSING, "True")


def _wait_until_the_garbage_collector_knows_networks(env: OperatorEnv) -> None:
    """The garbage collector discovers a new CRD's resources only at its next resync (up
    to 30 s): until then it ignores their dependents, and a foreground deletion would
    prove nothing. A canary network's child being collected shows that it knows them."""
    env.apply(
        network_manifest(
            "gc-canary",
            nodeSelector={"matchLabels": {"harness.metaroce.io/pool": "nowhere"}},
            nics={"interfaceNames": ["gc0"]},
        )
    )
    name = child_name("gc-canary")
    wait_for(
        "the canary's ConfigMap",
        lambda: get_json(env.cluster, "configmap", name, "-n", env.namespace) is not None,
        timeout=60,
    )
    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "gc-canary", "--wait=false")
    env.networks.discard("gc-canary")
    wait_for(
        "the garbage collector to collect a deleted network's children",
        lambda: get_json(env.cluster, "configmap", name, "-n", env.namespace) is None,
        timeout=90,
    )


@pytest.mark.parametrize("shared_role", [False, True], ids=["own-role", "chart-role"])
def test_foreground_deletion_keeps_the_agents_until_they_reverted(
    env: OperatorEnv, shared_role: bool
) -> None:
    """#7: `kubectl delete --cascade=foreground` (Argo CD prunes that way) makes the
    garbage collector delete the dependents first; the agents must stay until every node
    reported its settings reverted, and their RBAC with them (they report through it).
    With the chart's shared agents' ClusterRole (#13) the binding is the anchor."""
    shared = ("--agent-cluster-role=metaroce-agent",) if shared_role else ()
    env.start_operator("--cleanup-timeout=300s", *shared)
    gen = env.loadgen("fg")
    env.apply(network_manifest("fg", nodeSelector=POOL_A, cleanupOnDelete=True))
    _wait_until_the_garbage_collector_knows_networks(env)
    env.wait_condition("fg", c.CONDITION_READY, "True")
    net = env.network("fg") or {}
    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "fg", "--cascade=foreground", "--wait=false")
    name = child_name("fg")
    children = [
        ("daemonset", name, "-n", env.namespace),
        ("configmap", name, "-n", env.namespace),
        ("serviceaccount", name, "-n", env.namespace),
        ("clusterrolebinding", name),
        *([] if shared_role else [("clusterrole", name)]),
    ]
    if shared_role:
        binding = get_json(env.cluster, "clusterrolebinding", name) or {}
        assert binding["roleRef"]["name"] == "metaroce-agent"
        assert get_json(env.cluster, "clusterrole", name) is None
    deadline = time.monotonic() + 10  # the garbage collector acts within a second or two
    while time.monotonic() < deadline:
        assert (env.network("fg") or {})["metadata"].get("deletionTimestamp")
        for child in children:
            body = get_json(env.cluster, *child)
            assert body is not None, f"{child[0]} removed before the nodes reverted"
            assert not body["metadata"].get("deletionTimestamp"), f"{child[0]} is being deleted"
        pods = env.agent_pods("fg")
        assert pods and not any(p["metadata"].get("deletionTimestamp") for p in pods)
        time.sleep(1)
    assert (env.network("fg") or {}).get("metadata", {}).get("uid") == net["metadata"]["uid"]

    gen.revert(["kwok-a1", "kwok-a2"])
    wait_for("the network to be gone", lambda: env.network("fg") is None, timeout=60)
    env.networks.discard("fg")
    wait_for("its DaemonSet to be collected", lambda: env.daemonset("fg") is None, timeout=60)
    for kind in ("clusterrolebinding", "clusterrole"):
        wait_for(f"its {kind}", lambda kind=kind: get_json(env.cluster, kind, name) is None)


def test_operator_refuses_agent_images_not_on_its_allowlist(env: OperatorEnv) -> None:
    """#11: the operator itself refuses (the webhook may be off, or bypassed by an older
    object): no DaemonSet with an image it was not given, and the status says why."""
    env.start_operator()
    env.apply(
        network_manifest(
            "rooted", nodeSelector=POOL_A, agent={"image": "evil.example.com/root:1.0"}
        )
    )
    net = env.wait_condition("rooted", c.CONDITION_READY, "False", reason="AgentImageNotAllowed")
    message = condition(net, c.CONDITION_READY)["message"]
    assert "evil.example.com/root:1.0" in message and "--allowed-agent-image" in message
    time.sleep(3)
    assert env.daemonset("rooted") is None


def test_edited_children_are_restored_without_a_rollout_loop(env: OperatorEnv) -> None:
    """#8: drift repair covered deletion and config-hash edits only; an edited image or
    agent ClusterRole stayed wrong until a restart."""
    env.start_operator()
    env.loadgen("drifty")
    env.apply(network_manifest("drifty", nodeSelector=POOL_A))
    env.wait_condition("drifty", c.CONDITION_READY, "True")
    name = child_name("drifty")

    def image() -> str:
        return str(
            (env.daemonset("drifty") or {})["spec"]["template"]["spec"]["containers"][0]["image"]
        )

    original = image()
    env.cluster.kubectl(
        "set", "image", f"daemonset/{name}", "agent=evil.example.com/root:1", "-n", env.namespace
    )
    wait_for("the agent image to be restored", lambda: image() == original, timeout=30)
    rule = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
    env.cluster.kubectl(
        "patch", "clusterrole", name, "--type=json",
        "-p", json.dumps([{"op": "add", "path": "/rules/-", "value": rule}]),
    )  # fmt: skip

    def rules() -> list[dict[str, Any]]:
        return list((get_json(env.cluster, "clusterrole", name) or {}).get("rules") or [])

    wait_for("the agents' rules to be restored", lambda: rule not in rules(), timeout=30)
    generation = (env.daemonset("drifty") or {})["metadata"]["generation"]
    time.sleep(6)  # a loop would show as a growing generation
    assert (env.daemonset("drifty") or {})["metadata"]["generation"] == generation
