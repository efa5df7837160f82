"""The pod admission policy of a network (policy admission mode): what is rendered.

The CEL itself runs only in the apiserver: the shared admission cases run through it in
tests/integration/test_pod_admission_modes.py. Here: the objects, their ownership, the
literals taken from the network, and the settings and flags that pick the mode."""

from __future__ import annotations

import json
import re

import pytest
from operator_testlib import network

from metaroce_api import constants as c
from metaroce_operator.cli import chart_arguments, settings_from_args
from metaroce_operator.render import render_network
from metaroce_operator.render.podpolicy import (
    env_entries,
    forbidden_expression,
    json_text,
    lit,
    match_conditions,
    pod_patch_expression,
    pod_policy_variables,
    policy_name,
    record_env,
    record_key,
    render_pod_policy,
    single_container_expression,
    single_container_ops,
)
from metaroce_operator.settings import RenderSettings, SettingsError

POLICY = RenderSettings(
    namespace="metaroce-system", agent_image="example.com/agent:v1", admission_mode="policy"
)


def test_webhook_mode_renders_no_policy(settings: RenderSettings) -> None:
    kinds = [o["kind"] for o in render_network(network("fabric"), settings)]
    assert "MutatingAdmissionPolicy" not in kinds


def test_policy_mode_renders_the_policy_and_binding_last_owned_by_the_network() -> None:
    objs = render_network(network("fabric", cleanupOnDelete=True), POLICY)
    policy, binding = objs[-2:]
    assert [policy["kind"], binding["kind"]] == [
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
    ]
    for obj in (policy, binding):
        assert obj["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert obj["metadata"]["name"] == "metaroce-pods-fabric"
        assert obj["metadata"]["labels"][c.NETWORK_LABEL] == "fabric"
        # Owned by the network itself even with cleanupOnDelete (whose other children the
        # agents' ClusterRole owns): a deleted network's pods must lose their policy at once.
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == (c.NETWORK_KIND, "fabric", "uid-1")
    assert binding["spec"] == {
        "policyName": "metaroce-pods-fabric",
        "paramRef": {"name": "fabric", "parameterNotFoundAction": "Allow"},
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail" and spec["reinvocationPolicy"] == "Never"
    rule = spec["matchConstraints"]["resourceRules"][0]
    assert rule["resources"] == ["pods"] and rule["operations"] == ["CREATE"]
    assert [m["patchType"] for m in spec["mutations"]] == ["JSONPatch"]


def test_offline_rendering_has_no_owner_reference() -> None:
    policy, binding = render_pod_policy(network("fabric", uid=""), POLICY)
    assert "ownerReferences" not in policy["metadata"]
    assert "ownerReferences" not in binding["metadata"]


def test_the_network_s_values_are_literals_of_the_policy() -> None:
    net = network(
        "fabric",
        qos={"data": {"dscp": 46}},
        transport={"qpsPerConnection": 4, "roce": {"gidIndex": 3}},
        attachment={
            "resourceName": "example.com/fab",
            "socketInterface": "eth1",
            "ncclEnv": ["NCCL_IB_TC", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX", "NCCL_IB_HCA"],
        },
    )
    policy, _ = render_pod_policy(net, POLICY)
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    values = "{'NCCL_IB_TC': '184', 'NCCL_SOCKET_IFNAME': 'eth1', 'NCCL_IB_GID_INDEX': '3'}"
    keys = "['NCCL_IB_TC', 'NCCL_SOCKET_IFNAME', 'NCCL_IB_GID_INDEX']"
    assert keys in variables["missing"] and values in variables["replaced"]
    assert "'example.com/fab' in c.resources.requests" in variables["holds"]
    patch = policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
    # Nothing unless the namespace allows IPC_LOCK and the pod has a target container.
    assert patch.startswith("((has(namespaceObject.metadata.labels) && ")
    assert "(size(object.spec.containers) > 0 && size(variables.targets) > 0) ? " in patch
    # A container without env gets all of them as one literal, and the record says so.
    entries = (
        "[{'name': 'NCCL_IB_TC', 'value': '184'}, {'name': 'NCCL_SOCKET_IFNAME', "
        "'value': 'eth1'}, {'name': 'NCCL_IB_GID_INDEX', 'value': '3'}]"
    )
    assert entries in patch
    assert (
        """',"env":{"NCCL_IB_TC":"184","NCCL_SOCKET_IFNAME":"eth1","NCCL_IB_GID_INDEX":"3"}}'"""
        in patch
    )
    assert "jsonpatch.escapeKey('example.com/fab')" in patch
    assert "jsonpatch.escapeKey('injected.metaroce.io/fabric')" in patch


def test_match_condition_selects_the_network_and_guards_reinvocation() -> None:
    (cond,) = match_conditions("fabric")
    text = cond["expression"]
    assert "!('injected.metaroce.io/fabric' in object.metadata.annotations)" in text
    assert ".replace(' ', '') + ',').contains(',fabric,')" in text
    # The cheap tests first: && stops at the first false for the pods of other networks.
    assert (
        text.index("has(object.metadata.annotations)")
        < text.index("injected")
        < text.index("contains")
    )
    assert record_key("fabric") == "injected.metaroce.io/fabric"
    assert "params" not in text
    # A cleanupOnDelete network (the binding's param) being deleted: nothing injected.
    (held,) = match_conditions("fabric", param=True)
    assert held["expression"] == text + " && !has(params.metadata.deletionTimestamp)"


def test_only_a_cleanup_on_delete_network_is_the_binding_s_param() -> None:
    """The apiserver converts a param for every expression of every pod create: only the
    network the operator's finalizer can hold pays for it."""
    policy, binding = render_pod_policy(network("fabric"), POLICY)
    assert "paramKind" not in policy["spec"] and binding["spec"] == {
        "policyName": "metaroce-pods-fabric"
    }
    assert "params" not in policy["spec"]["matchConditions"][0]["expression"]
    policy, binding = render_pod_policy(network("fabric", cleanupOnDelete=True), POLICY)
    assert policy["spec"]["paramKind"] == {"apiVersion": c.API_VERSION, "kind": c.NETWORK_KIND}
    assert binding["spec"]["paramRef"] == {"name": "fabric", "parameterNotFoundAction": "Allow"}


def test_variables_are_declared_before_use() -> None:
    variables = pod_policy_variables("n", "metaroce.io/n", {"NCCL_IB_TC": "104"})
    seen: set[str] = set()
    for var in variables:
        used = {
            name
            for name in (v["name"] for v in variables)
            if re.search(rf"variables\.{name}\b", var["expression"])
        }
        assert used <= seen, f"{var['name']} uses {used - seen} before it is declared"
        seen.add(var["name"])


def test_pod_security_expression() -> None:
    assert forbidden_expression(False, "baseline") == "false"
    text = forbidden_expression(True, "baseline")
    assert ": 'baseline') in ['baseline', 'restricted']" in text


def test_literals_refuse_characters_that_would_need_escaping() -> None:
    assert lit("eth0") == "'eth0'"
    with pytest.raises(ValueError, match="unusual characters"):
        lit("it's")


def test_rendering_is_deterministic() -> None:
    one = json.dumps(render_pod_policy(network("fabric"), POLICY), sort_keys=True)
    two = json.dumps(render_pod_policy(network("fabric"), POLICY), sort_keys=True)
    assert one == two


def test_long_network_names_fit() -> None:
    name = "n" * 63
    assert len(policy_name(name)) <= 63


def test_admission_mode_flag_and_chart_arguments() -> None:
    args = chart_arguments("ns", "example.com/a:v1", admission_mode="policy")
    assert "--admission-mode=policy" in args
    assert not any(a.startswith("--webhook-mutating-config") for a in args)
    s = settings_from_args(args)
    assert s.render.admission_mode == "policy"
    assert s.webhook.mutating_config is None and s.webhook.validating_config
    assert settings_from_args([]).render.admission_mode == "webhook"
    with pytest.raises(SettingsError, match="--admission-mode='both'"):
        settings_from_args(["--admission-mode=both"])
    with pytest.raises(SettingsError, match="--pod-security-default='lax'"):
        settings_from_args(["--pod-security-default=lax"])


def test_the_usual_pod_s_ops_read_no_variable() -> None:
    """One container without env, not holding the resource: its branch reads no CEL
    variable (each costs the apiserver a program evaluation per pod); the general
    expression, with its per-container states, is the other branch."""
    resource = "metaroce.io/fabric"
    env = {"NCCL_IB_TC": "104", "NCCL_IB_TIMEOUT": "20"}
    single = single_container_ops("fabric", resource, env)
    assert "variables." not in single
    assert "'/spec/containers/0/env', value: [{'name': 'NCCL_IB_TC', 'value': '104'}" in single
    # The record names the capability only in the branches that add it.
    assert single.count('"capabilities":["IPC_LOCK"]') == 4
    assert single.count('"env":{"NCCL_IB_TC":"104","NCCL_IB_TIMEOUT":"20"}}') == 6
    guard = single_container_expression(resource)
    assert "!has(object.spec.initContainers) && size(object.spec.containers) == 1" in guard
    assert "!has(object.spec.containers[0].env)" in guard
    assert "'metaroce.io/fabric' in object.spec.containers[0].resources.limits" in guard
    patch = pod_patch_expression("fabric", resource, env, "F")
    assert patch.startswith(f"(F) ? [] : ({guard}) ? {single} : (")
    # No env to inject: no env op, and the record says so.
    assert "/env'" not in single_container_ops("fabric", resource, {})


def test_literal_builders() -> None:
    env = {"NCCL_IB_TC": "104", "NCCL_SOCKET_IFNAME": "eth0"}
    assert env_entries(env) == (
        "[{'name': 'NCCL_IB_TC', 'value': '104'}, {'name': 'NCCL_SOCKET_IFNAME', 'value': 'eth0'}]"
    )
    assert record_env(env) == ',"env":{"NCCL_IB_TC":"104","NCCL_SOCKET_IFNAME":"eth0"}'
    assert record_env({}) == ',"env":{}'
    assert json_text('{"a":"b"}') == """'{"a":"b"}'"""
    with pytest.raises(ValueError, match="quotes"):
        json_text("it's")
    with pytest.raises(ValueError, match="unusual characters"):
        record_env({"A": "x'y"})
