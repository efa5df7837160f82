"""Drift of the agents' DaemonSet and RBAC from what the operator rendered (issue 16 #8)."""

from __future__ import annotations

import copy
from typing import Any

from operator_testlib import network

from metaroce_operator.drift import daemonset_drift, rbac_drift
from metaroce_operator.render import render_network
from metaroce_operator.settings import RenderSettings


def children(settings: RenderSettings) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in render_network(network(), settings)}


def with_defaults(ds: dict[str, Any]) -> dict[str, Any]:
    """What the apiserver returns: the rendered object plus defaulted fields."""
    out = copy.deepcopy(ds)
    pod = out["spec"]["template"]["spec"]
    pod["restartPolicy"] = "Always"
    pod["schedulerName"] = "default-scheduler"
    for c in pod["containers"]:
        c["terminationMessagePath"] = "/dev/termination-log"
        for m in c.get("volumeMounts") or []:
            m.setdefault("mountPropagation", "None")
    for v in pod.get("volumes") or []:
        if "hostPath" in v:
            v["hostPath"].setdefault("type", "")
    return out


def test_an_unchanged_daemonset_with_apiserver_defaults_has_no_drift(
    settings: RenderSettings,
) -> None:
    ds = children(settings)["DaemonSet"]
    assert daemonset_drift(ds, with_defaults(ds)) == []


def test_edited_image_security_context_and_command_are_drift(settings: RenderSettings) -> None:
    ds = children(settings)["DaemonSet"]
    edited = with_defaults(ds)
    agent = edited["spec"]["template"]["spec"]["containers"][0]
    agent["image"] = "evil.example.com/root:1"
    agent["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    agent["command"] = ["sh", "-c", "id"]
    edited["spec"]["template"]["spec"]["hostIPC"] = True
    assert daemonset_drift(ds, edited) == [
        "hostIPC",
        "containers[agent].image",
        "containers[agent].command",
        "containers[agent].securityContext",
    ]
    extra = with_defaults(ds)
    extra["spec"]["template"]["spec"]["containers"].append({"name": "miner", "image": "x"})
    assert daemonset_drift(ds, extra) == ["containers (names)"]


def test_edited_agent_rbac_is_drift(settings: RenderSettings) -> None:
    objs = children(settings)
    role = copy.deepcopy(objs["ClusterRole"])
    assert rbac_drift(objs["ClusterRole"], role) == []
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    assert rbac_drift(objs["ClusterRole"], role) == ["rules"]
    binding = copy.deepcopy(objs["ClusterRoleBinding"])
    binding["subjects"].append({"kind": "Group", "name": "system:authenticated"})
    assert rbac_drift(objs["ClusterRoleBinding"], binding) == ["subjects"]
