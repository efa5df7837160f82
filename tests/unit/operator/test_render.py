"""Rendering is pure and deterministic, and only agent-config changes roll the agents."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from operator_testlib import network

from metaroce_api import AgentConfig
from metaroce_api import constants as c
from metaroce_operator.render import config_generation, render_network
from metaroce_operator.render.common import child_name, config_hash, fit_name
from metaroce_operator.settings import RenderSettings


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def pod_spec(objs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(objs)["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def test_children_in_apply_order_with_owner_and_labels(settings: RenderSettings) -> None:
    objs = render_network(network("fabric"), settings)
    assert [o["kind"] for o in objs] == [
        "ClusterRole",
        "ServiceAccount",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
    ]
    for obj in objs:
        meta = obj["metadata"]
        assert meta["name"] == "metaroce-agent-fabric"
        assert meta["labels"][c.NETWORK_LABEL] == "fabric"
        assert meta["labels"][c.MANAGED_BY_LABEL] == c.MANAGED_BY
        (owner,) = meta["ownerReferences"]
        assert owner == {
            "apiVersion": c.API_VERSION,
            "kind": c.NETWORK_KIND,
            "name": "fabric",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        namespaced = obj["kind"] not in ("ClusterRole", "ClusterRoleBinding")
        assert (meta.get("namespace") == "metaroce-system") is namespaced


def test_cleanup_networks_children_are_owned_by_their_clusterrole(
    settings: RenderSettings,
) -> None:
    """Not the network's dependents, so foreground deletion of the network cannot take the
    agents before they reverted; the ClusterRole (the anchor) is owned by the namespace."""
    net = network("tidy", cleanupOnDelete=True)
    first = render_network(net, settings)
    assert all("ownerReferences" not in o["metadata"] for o in first)
    objs = render_network(net, settings, anchor_uid="role-uid", namespace_uid="ns-uid")
    role, *rest = objs
    # The namespace owns the anchor: uninstalling the chart leaves nothing behind.
    assert role["kind"] == "ClusterRole"
    assert role["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Namespace", "name": "metaroce-system", "uid": "ns-uid"}
    ]
    for obj in rest:
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "name": "metaroce-agent-tidy",
                "uid": "role-uid",
            }
        ]


def test_rendering_is_deterministic(settings: RenderSettings) -> None:
    a = yaml.safe_dump_all(render_network(network(), settings))
    b = yaml.safe_dump_all(render_network(network(), settings))
    assert a == b


def test_offline_render_has_no_owner_reference(settings: RenderSettings) -> None:
    objs = render_network(network(uid=""), settings)
    assert all("ownerReferences" not in o["metadata"] for o in objs)


def test_daemonset_runs_privileged_host_network_agent(settings: RenderSettings) -> None:
    objs = render_network(network(), settings)
    spec = pod_spec(objs)
    # No hostPID: revert counts an rxe link's users with `rdma res show` (finding 12).
    assert spec["hostNetwork"] is True and "hostPID" not in spec
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    (container,) = spec["containers"]
    assert container["securityContext"] == {"privileged": True}
    assert container["command"] == [
        "metaroce",
        "agent",
        "--config",
        "/etc/metaroce/agent.yaml",
        "--require-pyverbs",
        "--metrics-port=9478",
        "--probe-port=47911",
    ]
    assert container["image"] == "example.com/agent:v1"
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {
        "/sys",
        "/sys/kernel/config",
        "/dev",
        "/lib/modules",
        "/run/metaroce",
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
    } <= mounts
    config_volume = next(v for v in spec["volumes"] if v["name"] == "config")
    assert config_volume["projected"]["sources"][0]["configMap"]["items"] == [
        {"key": c.AGENT_CONFIG_KEY, "path": "agent.yaml"}
    ]
    assert container["resources"] == {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"memory": "256Mi"},
    }


def test_agent_host_ports_come_from_the_spec(settings: RenderSettings) -> None:
    """A second network on the same nodes picks other ports; the PodMonitor finds /metrics
    through the pod annotation (a declared hostPort would stop the scheduler placing it)."""
    objs = render_network(network(agent={"metricsPort": 9479, "probePort": 47912}), settings)
    (container,) = pod_spec(objs)["containers"]
    assert container["command"][-2:] == ["--metrics-port=9479", "--probe-port=47912"]
    assert "ports" not in container
    template = by_kind(objs)["DaemonSet"]["spec"]["template"]
    assert template["metadata"]["annotations"][c.METRICS_PORT_ANNOTATION] == "9479"


def test_node_selector_tolerations_and_update_strategy(settings: RenderSettings) -> None:
    net = network(
        nodeSelector={
            "matchLabels": {"rdma": "yes"},
            "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}],
        },
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        agent={"updateStrategy": {"maxUnavailable": "25%"}, "image": "example.com/own:v2"},
    )
    objs = render_network(net, settings)
    ds = by_kind(objs)["DaemonSet"]
    spec = pod_spec(objs)
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    # the selector, or the operator's label that keeps an agent until it reverted
    assert terms["nodeSelectorTerms"] == [
        {
            "matchExpressions": [
                {"key": "rdma", "operator": "In", "values": ["yes"]},
                {"key": "zone", "operator": "In", "values": ["a", "b"]},
            ]
        },
        {"matchExpressions": [{"key": c.node_label(net.name), "operator": "Exists"}]},
    ]
    assert {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert {
        "key": c.UNHEALTHY_TAINT_KEY,
        "operator": "Exists",
        "effect": "NoSchedule",
    } in spec["tolerations"]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": 0},
    }
    assert spec["containers"][0]["image"] == "example.com/own:v2"


def test_configmap_holds_the_agent_config(settings: RenderSettings) -> None:
    net = network(generation=7, transport={"mode": "softroce"}, cleanupOnDelete=True)
    cm = by_kind(render_network(net, settings))["ConfigMap"]
    config = AgentConfig.from_yaml(cm["data"][c.AGENT_CONFIG_KEY])
    assert config == AgentConfig.from_network(net)
    assert config.generation == 7 and config.transport.mode == "softroce"
    assert config.cleanup_on_delete is True
    assert cm["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION] == config_hash(config)


def _hash(objs: list[dict[str, Any]]) -> str:
    ds = by_kind(objs)["DaemonSet"]
    value: str = ds["spec"]["template"]["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION]
    return value


@pytest.mark.parametrize(
    "change",
    [
        {"health": {"action": "taint"}},
        {"health": {"maxTaintedFraction": 0.5}},
        {"attachment": {"ncclEnv": ["NCCL_IB_HCA", "NCCL_IB_GID_INDEX"]}},  # webhook-only ones
        {"agent": {"updateStrategy": {"maxUnavailable": 3}}},
    ],
)
def test_changes_outside_the_agent_config_keep_the_hash(
    settings: RenderSettings, change: dict[str, Any]
) -> None:
    before = render_network(network(generation=1), settings)
    after = render_network(network(generation=2, **change), settings)
    assert _hash(before) == _hash(after)


@pytest.mark.parametrize(
    "change",
    [
        {"transport": {"mode": "softroce"}},
        {"qos": {"profile": "lossy"}},
        {"health": {"probe": {"interval": "10s"}}},
        {"agent": {"logLevel": "debug"}},
        {"nics": {"interfaceNames": ["eth2"]}},
    ],
)
def test_agent_config_changes_change_the_hash(
    settings: RenderSettings, change: dict[str, Any]
) -> None:
    before = render_network(network(generation=1), settings)
    after = render_network(network(generation=2, **change), settings)
    assert _hash(before) != _hash(after)


def test_config_generation_survives_changes_that_do_not_touch_the_agents(
    settings: RenderSettings,
) -> None:
    first = render_network(network(generation=1), settings)
    cm = by_kind(first)["ConfigMap"]
    same = network(generation=2, health={"action": "taint"})
    digest = cm["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION]
    assert config_generation(digest, 2, cm) == 1
    # With that generation the ConfigMap renders byte-identical: nothing to apply.
    again = render_network(same, settings, config_generation=1)
    assert by_kind(again)["ConfigMap"] == cm
    assert by_kind(again)["DaemonSet"] == by_kind(first)["DaemonSet"]
    # A real change starts a new config generation.
    changed = network(generation=3, transport={"mode": "softroce"})
    new_digest = by_kind(render_network(changed, settings))["ConfigMap"]["metadata"]["annotations"][
        c.CONFIG_HASH_ANNOTATION
    ]
    assert config_generation(new_digest, 3, cm) == 3
    assert config_generation(digest, 2, None) == 2


def test_long_names_fit_63_characters(settings: RenderSettings) -> None:
    name = "n" * 63
    assert len(child_name(name)) == 63
    assert child_name(name) != child_name("n" * 62 + "m")
    assert fit_name("short") == "short"
    objs = render_network(network(name), settings)
    assert all(len(o["metadata"]["name"]) <= 63 for o in objs)


def test_agent_rbac_is_least_privilege(settings: RenderSettings) -> None:
    objs = by_kind(render_network(network("fabric"), settings))
    rules = objs["ClusterRole"]["rules"]
    flat = {(tuple(r["apiGroups"]), tuple(r["resources"])): r for r in rules}
    assert set(flat[(("metaroce.io",), ("metarocenodestates",))]["verbs"]) == {
        "get",
        "list",
        "watch",
        "create",
        "update",
        "patch",
    }
    # The NodeState CRD has no status subresource: the agent writes the object itself.
    assert not any(res.endswith("/status") for r in rules for res in r["resources"])
    networks = flat[(("metaroce.io",), ("metarocenetworks",))]
    assert networks["verbs"] == ["get", "list", "watch"]
    assert networks["resourceNames"] == ["fabric"]
    assert flat[(("",), ("nodes",))]["verbs"] == ["get", "list", "watch"]
    assert "delete" not in {v for r in rules for v in r["verbs"]}
    binding = objs["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "metaroce-agent-fabric", "namespace": "metaroce-system"}
    ]
    assert binding["roleRef"]["name"] == "metaroce-agent-fabric"
