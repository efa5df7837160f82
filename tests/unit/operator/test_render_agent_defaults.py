"""The chart's cluster-wide agent values reach every network's agent DaemonSet (issue 17):
tolerations, priority class, the kubelet's root directory, pod labels and annotations and
the pull policy, passed as operator flags (`chart_arguments`, the chart's operatorArgs)."""

from __future__ import annotations

from typing import Any

import pytest
from operator_testlib import network

from metaroce_api import constants as c
from metaroce_operator.cli import AgentPodDefaults, chart_arguments, settings_from_args
from metaroce_operator.render import render_network
from metaroce_operator.settings import RenderSettings, SettingsError

GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _pod(settings: RenderSettings) -> dict[str, Any]:
    (ds,) = [o for o in render_network(network("net"), settings) if o["kind"] == "DaemonSet"]
    return ds["spec"]["template"]  # type: ignore[no-any-return]


def test_defaults_render_as_before_and_pass_no_flags() -> None:
    assert AgentPodDefaults().arguments() == []
    pod = _pod(RenderSettings())
    spec = pod["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    paths = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    assert paths["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert paths["pod-resources"] == "/var/lib/kubelet/pod-resources"


def test_chart_values_reach_the_daemonset_through_the_flags() -> None:
    defaults = AgentPodDefaults(
        pull_policy="Always",
        tolerations=[GPU],
        priority_class="",
        kubelet_root_dir="/var/lib/k0s/kubelet",
        pod_labels={"team": "ml", c.NETWORK_LABEL: "someone-else"},
        pod_annotations={"example.com/owner": "rdma", c.CONFIG_HASH_ANNOTATION: "x"},
    )
    args = chart_arguments("ns", "registry.example.com/agent:v1", agent_pod_defaults=defaults)
    assert (
        '--agent-toleration={"effect":"NoSchedule","key":"nvidia.com/gpu","operator":"Exists"}'
        in args
    )
    pod = _pod(settings_from_args(args).render)
    spec = pod["spec"]
    assert "priorityClassName" not in spec
    assert spec["containers"][0]["imagePullPolicy"] == "Always"
    assert GPU in spec["tolerations"]
    assert {"key": c.UNHEALTHY_TAINT_KEY, "operator": "Exists",
            "effect": c.UNHEALTHY_TAINT_EFFECT} in spec["tolerations"]  # fmt: skip
    paths = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    assert paths["device-plugins"] == "/var/lib/k0s/kubelet/device-plugins"
    assert paths["pod-resources"] == "/var/lib/k0s/kubelet/pod-resources"
    # Inside the container the agent finds them where it always does.
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    # The operator's own keys win: the selector and the config hash cannot be overridden.
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"][c.NETWORK_LABEL] == "net"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "rdma"
    assert pod["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION] != "x"


def test_a_toleration_the_network_has_is_not_repeated() -> None:
    net = network("net", tolerations=[GPU])
    (ds,) = [
        o
        for o in render_network(net, RenderSettings(agent_tolerations=(GPU,)))
        if o["kind"] == "DaemonSet"
    ]
    tolerations = ds["spec"]["template"]["spec"]["tolerations"]
    assert tolerations.count(GPU) == 1


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("--agent-toleration=nope", ["--agent-toleration", "not JSON"]),
        ('--agent-toleration={"operator":"Sometimes"}', ["--agent-toleration", "toleration"]),
        ("--kubelet-root-dir=var/lib/kubelet", ["--kubelet-root-dir", "absolute path"]),
        ("--kubelet-root-dir=/var/lib/kubelet/", ["--kubelet-root-dir", "trailing"]),
        ("--agent-priority-class=Big_Class", ["--agent-priority-class", "PriorityClass"]),
        ("--agent-pod-label=team", ["--agent-pod-label", "KEY=VALUE"]),
        ("--agent-pod-label=team=a b", ["--agent-pod-label", "label value"]),
        ("--agent-image-pull-policy=Sometimes", ["--agent-image-pull-policy", "IfNotPresent"]),
    ],
)
def test_bad_flags_name_the_flag_and_the_fix(flag: str, words: list[str]) -> None:
    with pytest.raises(SettingsError) as err:
        settings_from_args([*chart_arguments("ns", "registry.example.com/agent:v1"), flag])
    for word in words:
        assert word in str(err.value)
