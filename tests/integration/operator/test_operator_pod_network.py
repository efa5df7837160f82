"""Issue 14: a metaroce network whose pods get a Multus secondary interface, against the
real control plane and the real operator process.

Without Multus's NetworkAttachmentDefinition CRD the network says so (Ready False,
MultusNotInstalled, naming the CRD) and nothing of it is applied; once the CRD is served
(Multus's own, from the pinned module hack/build-multus.sh builds) the operator renders
the network's NAD without spec.config (and puts it back when it is deleted), gives each
node of the network its block of the subnet as a node annotation, mounts Multus's confDir
into the agents, reports a subnet too small for the nodes as Degraded, and removes the
blocks when the network goes."""

from __future__ import annotations

import json
from typing import Any

from conftest import OperatorEnv
from operator_env import condition, network_manifest, wait_for

from metaroce_api import constants as c
from metaroce_api.podnet import NAD_CRD, block_annotation, nad_name
from metaroce_harness import multus

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}
SPEC: dict[str, Any] = {
    "nodeSelector": POOL_A,
    "transport": {"mode": "metaroce"},
    "qos": {"profile": "lossy"},
    "attachment": {"podNetwork": {"subnet": "10.56.0.0/23"}},
}


def blocks(env: OperatorEnv, network: str) -> dict[str, str]:
    nodes = json.loads(env.cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    key = block_annotation(network)
    return {
        n["metadata"]["name"]: n["metadata"]["annotations"][key]
        for n in nodes
        if key in (n["metadata"].get("annotations") or {})
    }


def nad(env: OperatorEnv, network: str) -> dict[str, Any] | None:
    got = env.cluster.kubectl(
        "get", "network-attachment-definitions.k8s.cni.cncf.io", nad_name(network),
        "-n", env.namespace, "-o", "json", check=False,
    )  # fmt: skip
    return json.loads(got.stdout) if got.returncode == 0 else None


def test_pod_network_needs_multus_then_gets_a_nad_and_node_blocks(env: OperatorEnv) -> None:
    env.start_operator()
    served = env.cluster.kubectl("get", "--raw", "/apis/k8s.cni.cncf.io/v1", check=False)
    env.apply(network_manifest("pn", **SPEC))
    if served.returncode != 0:  # the session's first test to need Multus: not installed yet
        net = env.wait_condition(
            "pn", c.CONDITION_READY, "False", reason=c.REASON_MULTUS_MISSING, timeout=60
        )
        message = condition(net, c.CONDITION_READY)["message"]
        assert NAD_CRD in message and "Multus" in message, message
        assert env.daemonset("pn") is None  # nothing applied, not half
        multus.install_prerequisites(env.cluster, multus.ensure_multus())

    created = wait_for("the network's NAD", lambda: nad(env, "pn"), timeout=90)
    assert "spec" not in created or not created["spec"].get("config"), created
    owners = created["metadata"].get("ownerReferences") or []
    assert [o["kind"] for o in owners] == [c.NETWORK_KIND], owners
    ds = wait_for("the agents' DaemonSet", lambda: env.daemonset("pn"), timeout=60)
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["multus-conf"]["hostPath"]["path"] == "/etc/cni/multus/net.d"

    want = {"kwok-a1": "10.56.0.0/24", "kwok-a2": "10.56.1.0/24"}
    wait_for("a block per node of the network", lambda: blocks(env, "pn") == want, timeout=60)

    # the NAD deleted by hand comes back within a node pass (3 s here), not a restart
    env.cluster.kubectl(
        "delete", "network-attachment-definitions.k8s.cni.cncf.io", nad_name("pn"),
        "-n", env.namespace,
    )  # fmt: skip
    back = wait_for("the NAD put back", lambda: nad(env, "pn"), timeout=30)
    assert back["metadata"]["uid"] != created["metadata"]["uid"]

    # A subnet with one block for two nodes: the first keeps its block, Degraded says why
    env.cluster.kubectl(
        "patch", "metarocenetwork", "pn", "--type=merge",
        "-p", json.dumps({"spec": {"attachment": {"podNetwork": {"subnet": "10.56.0.0/24"}}}}),
    )  # fmt: skip
    net = env.wait_condition(
        "pn", c.CONDITION_DEGRADED, "True", reason=c.REASON_POD_SUBNET_TOO_SMALL, timeout=60
    )
    message = condition(net, c.CONDITION_DEGRADED)["message"]
    assert "spec.attachment.podNetwork.subnet 10.56.0.0/24 holds 1 blocks" in message, message
    assert blocks(env, "pn") == {"kwok-a1": "10.56.0.0/24"}

    env.cluster.kubectl("delete", "metarocenetwork", "pn", "--wait=true", timeout=120)
    wait_for("the blocks removed", lambda: not blocks(env, "pn"), timeout=60)
    wait_for("the NAD collected", lambda: nad(env, "pn") is None, timeout=60)
