"""A network's life against the real control plane, with the real operator process:
apply -> agents on the matching kwok nodes -> NodeStates -> Ready; a failing node;
spec changes that do and do not roll the agents; deletion removes every child."""

from __future__ import annotations

from typing import Any

from conftest import OperatorEnv
from operator_env import condition, network_manifest, wait_for

from metaroce_api import constants as c
from metaroce_operator.render.common import child_name

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}


def pod_uids(env: OperatorEnv, network: str) -> dict[str, str]:
    return {p["spec"].get("nodeName", ""): p["metadata"]["uid"] for p in env.agent_pods(network)}


def template_hash(ds: dict[str, Any]) -> str:
    return str(ds["spec"]["template"]["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION])


def test_network_lifecycle(env: OperatorEnv) -> None:
    op = env.start_operator()
    gen = env.loadgen("life")
    env.apply(network_manifest("life", nodeSelector=POOL_A))

    # The agents land only on the pool-a kwok nodes, and each reports once Running.
    def running_on() -> set[str]:
        pods = env.agent_pods("life")
        return {p["spec"].get("nodeName") for p in pods if p["status"].get("phase") == "Running"}

    assert wait_for("agents Running on pool a", lambda: running_on() == {"kwok-a1", "kwok-a2"})
    net = env.wait_condition("life", c.CONDITION_READY, "True", reason=c.REASON_RECONCILED)
    status = net["status"]
    assert status["observedGeneration"] == 1
    assert status["nodes"] == {
        "desired": 2,
        "configured": 2,
        "healthy": 2,
        "failed": 0,
        "summary": "2/2",
    }
    # The rollout is over once the agents are available: ready (verified) for the
    # DaemonSet's minReadySeconds, which may end after Ready (every node configured).
    env.wait_condition("life", c.CONDITION_PROGRESSING, "False", timeout=60)
    assert condition(net, c.CONDITION_DEGRADED)["status"] == "False"
    assert status["transport"]["active"] == "rocev2"
    assert gen.reported(1) == {"kwok-a1", "kwok-a2"}

    # Every child is there, owned by the network.
    uid = net["metadata"]["uid"]
    name = child_name("life")
    for kind, ns in (
        ("serviceaccount", env.namespace),
        ("configmap", env.namespace),
        ("daemonset", env.namespace),
        ("clusterrole", None),
        ("clusterrolebinding", None),
    ):
        args = [kind, name] + (["-n", ns] if ns else [])
        obj = wait_for(
            kind,
            lambda args=args: env.cluster.kubectl("get", *args, "-o", "json", check=False).stdout,
        )
        assert f'"uid": "{uid}"' in obj, f"{kind} is not owned by the network"
    # kopf's own annotations use the operator's prefix, and no Event per successful handler.
    annotations = net["metadata"].get("annotations") or {}
    assert not any(k.startswith("kopf.zalando.org") for k in annotations)
    reasons = [e["reason"] for e in env.events("life")]
    assert reasons == [c.REASON_RECONCILED], reasons

    # A failing NodeState: Degraded with its reason, and the node listed.
    gen.fail("kwok-a2", "apply pfc on eth1: dcb: Operation not supported")
    net = env.wait_condition("life", c.CONDITION_DEGRADED, "True", reason=c.REASON_NODES_FAILED)
    assert condition(net, c.CONDITION_READY)["reason"] == c.REASON_NODES_FAILED
    assert net["status"]["failingNodes"] == [
        {
            "node": "kwok-a2",
            "reason": "AgentFailed",
            "message": "apply pfc on eth1: dcb: Operation not supported",
        }
    ]
    assert net["status"]["nodes"]["failed"] == 1
    gen.fail("kwok-a2", None)
    env.wait_condition("life", c.CONDITION_READY, "True")
    env.wait_condition("life", c.CONDITION_DEGRADED, "False")

    # A spec change outside the agents' config: status follows, agents do not roll.
    ds_before = env.daemonset("life")
    assert ds_before is not None
    uids_before = pod_uids(env, "life")
    cm_rv = env.cluster.kubectl(
        "get", "configmap", name, "-n", env.namespace, "-o", "jsonpath={.metadata.resourceVersion}"
    ).stdout
    env.apply(network_manifest("life", nodeSelector=POOL_A, health={"maxTaintedFraction": 0.5}))
    net = env.wait_condition("life", c.CONDITION_READY, "True", generation=2)
    ds_after = env.daemonset("life")
    assert ds_after is not None
    assert ds_after["metadata"]["generation"] == ds_before["metadata"]["generation"]
    assert template_hash(ds_after) == template_hash(ds_before)
    assert pod_uids(env, "life") == uids_before
    assert (
        env.cluster.kubectl(
            "get",
            "configmap",
            name,
            "-n",
            env.namespace,
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ).stdout
        == cm_rv
    )

    # A change of the agents' config rolls them; Ready again once they reported it.
    env.apply(
        network_manifest(
            "life",
            nodeSelector=POOL_A,
            health={"maxTaintedFraction": 0.5},
            agent={"logLevel": "debug"},
        )
    )
    wait_for(
        "the DaemonSet to roll",
        lambda: (
            (env.daemonset("life") or {}).get("metadata", {}).get("generation", 0)
            > ds_before["metadata"]["generation"]
        ),
    )
    assert template_hash(env.daemonset("life") or {}) != template_hash(ds_before)
    net = env.wait_condition("life", c.CONDITION_READY, "True", generation=3, timeout=120)
    assert gen.reported(3) == {"kwok-a1", "kwok-a2"}
    new_uids = pod_uids(env, "life")
    assert set(new_uids.values()).isdisjoint(uids_before.values())

    # A child removed behind the operator's back is put back (same template: no new pods).
    current = env.daemonset("life") or {}
    ds_uid, current_hash, current_pods = (
        current["metadata"]["uid"],
        template_hash(current),
        pod_uids(env, "life"),
    )
    env.cluster.kubectl("delete", "daemonset", name, "-n", env.namespace, "--cascade=orphan")
    wait_for(
        "the DaemonSet to be re-created",
        lambda: (env.daemonset("life") or {}).get("metadata", {}).get("uid") not in (None, ds_uid),
        timeout=60,
    )
    assert template_hash(env.daemonset("life") or {}) == current_hash
    assert pod_uids(env, "life") == current_pods  # the orphans were adopted, not replaced

    cm_uid = env.cluster.kubectl(
        "get", "configmap", name, "-n", env.namespace, "-o", "jsonpath={.metadata.uid}"
    ).stdout
    env.cluster.kubectl("delete", "configmap", name, "-n", env.namespace)
    wait_for(
        "the ConfigMap to be re-created",
        lambda: (
            env.cluster.kubectl(
                "get",
                "configmap",
                name,
                "-n",
                env.namespace,
                "-o",
                "jsonpath={.metadata.uid}",
                check=False,
            ).stdout
            not in ("", cm_uid)
        ),
        timeout=60,
    )

    # Status writes are batched, not one per node event.
    writes = op.metric("metaroce_operator_status_writes_total", network="life")
    assert 0 < writes < 30, writes
    assert op.metric("metaroce_operator_leader") == 1
    assert op.probe("/healthz") == 200 and op.probe("/readyz") == 200

    # Deletion removes every child and the NodeStates.
    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "life", "--wait=true", "--timeout=60s")

    def children_left() -> list[str]:
        left = []
        for kind, ns in (
            ("daemonset", env.namespace),
            ("configmap", env.namespace),
            ("serviceaccount", env.namespace),
            ("clusterrole", None),
            ("clusterrolebinding", None),
        ):
            args = [kind, name] + (["-n", ns] if ns else [])
            if env.cluster.kubectl("get", *args, check=False).returncode == 0:
                left.append(kind)
        left += [n["metadata"]["name"] for n in env.nodestates("life")]
        return left

    wait_for("every child to be gone", lambda: not children_left(), timeout=60)
    assert not env.agent_pods("life") or wait_for(
        "agent pods gone", lambda: not env.agent_pods("life"), timeout=60
    )


def test_lossy_profile_on_go_back_n_warns_once(env: OperatorEnv) -> None:
    env.start_operator()
    env.loadgen("lossy", transport="softroce")
    env.apply(
        network_manifest(
            "lossy", nodeSelector=POOL_A, transport={"mode": "softroce"}, qos={"profile": "lossy"}
        )
    )
    net = env.wait_condition("lossy", c.CONDITION_READY, "True")
    degraded = condition(net, c.CONDITION_DEGRADED)
    assert degraded["status"] == "True"
    assert degraded["reason"] == c.REASON_LOSSY_ON_GO_BACK_N
    assert "0.21" in degraded["message"]
    events = [e for e in env.events("lossy") if e["reason"] == c.REASON_LOSSY_ON_GO_BACK_N]
    assert len(events) == 1 and events[0]["type"] == "Warning"
