"""The pod webhook for a metaroce network with a Multus secondary interface
(spec.attachment.podNetwork): the pod's `k8s.v1.cni.cncf.io/networks` entry, merged in
both of Multus's forms, and the transport pointed at the interface; hostNetwork pods
keep the node's netdev. The admission policy renders the same rules in CEL (its
equivalence with the webhook is checked on the real apiserver, in the integration tier)."""

from __future__ import annotations

import json
from typing import Any

from webhook_testlib import apply_patch, pod, view, views

from metaroce_operator.render.podpolicy import render_pod_policy
from metaroce_operator.settings import RenderSettings
from metaroce_operator.webhooks.mutate import Allowed, Namespace, mutate_pod

NS = Namespace("jobs", {"kubernetes.io/metadata.name": "jobs"})
METAROCE = {"transport": {"mode": "metaroce"}, "qos": {"profile": "lossy"}}
NETS = views(
    view("mr", **METAROCE, attachment={"podNetwork": {"subnet": "10.56.0.0/16"}}),
    view("mrh", **METAROCE, attachment={"podNetwork": {"mode": "hostNetwork"}}),
    view("mrp", **METAROCE),
    view("backend"),
)
MULTUS = "k8s.v1.cni.cncf.io/networks"
REF = "metaroce-system/metaroce-mr@mr0"


def mutated(p: dict[str, Any], **kw: Any) -> tuple[dict[str, Any], Allowed]:
    decision = mutate_pod(p, NETS, NS, **kw)
    assert isinstance(decision, Allowed), decision
    return apply_patch(p, decision.patch), decision


def env_of(p: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env", [])}


def test_a_pod_gets_the_attachment_and_binds_mr0() -> None:
    out, decision = mutated(pod("mr"))
    assert out["metadata"]["annotations"][MULTUS] == REF
    env = env_of(out)
    assert env["FI_METAROCE_IFACE"] == "mr0" and env["MR_NCCL_IFNAME"] == "=mr0"
    assert env["FI_PROVIDER"] == "metaroce"
    record = json.loads(out["metadata"]["annotations"]["metaroce.io/injected"])
    assert record["attachments"] == [REF]
    assert decision.warnings == []
    again = mutate_pod(out, NETS, NS)  # idempotent
    assert isinstance(again, Allowed) and again.patch == []


def test_the_agents_namespace_names_the_nad() -> None:
    out, _ = mutated(pod("mr"), attachment_namespace="rdma-system")
    assert out["metadata"]["annotations"][MULTUS] == "rdma-system/metaroce-mr@mr0"


def test_user_entries_are_kept_in_both_forms() -> None:
    out, _ = mutated(pod("mr", annotations={MULTUS: "sriov-a@net1"}))
    assert out["metadata"]["annotations"][MULTUS] == f"sriov-a@net1,{REF}"
    listed = json.dumps([{"name": "sriov-a", "interface": "net1"}])
    out, _ = mutated(pod("mr", annotations={MULTUS: listed}))
    entries = json.loads(out["metadata"]["annotations"][MULTUS])
    assert entries == [
        {"name": "sriov-a", "interface": "net1"},
        {"name": "metaroce-mr", "namespace": "metaroce-system", "interface": "mr0"},
    ]


def test_a_user_entry_for_the_nad_stands_and_a_different_interface_is_warned() -> None:
    mine = "metaroce-system/metaroce-mr@data0"
    out, decision = mutated(pod("mr", annotations={MULTUS: mine}))
    assert out["metadata"]["annotations"][MULTUS] == mine
    assert "attachments" not in decision.injected
    assert any("data0" in w and "'mr0'" in w for w in decision.warnings), decision.warnings
    out, decision = mutated(pod("mr", annotations={MULTUS: '[{"name": "a"}'}))
    assert out["metadata"]["annotations"][MULTUS] == '[{"name": "a"}'
    assert any("does not end" in w for w in decision.warnings), decision.warnings


def test_user_interface_values_are_kept_and_reported() -> None:
    p = pod("mr")
    p["spec"]["containers"][0]["env"] = [{"name": "FI_METAROCE_IFACE", "value": "eth0"}]
    out, decision = mutated(p)
    assert env_of(out)["FI_METAROCE_IFACE"] == "eth0" and env_of(out)["MR_NCCL_IFNAME"] == "=mr0"
    assert any(
        "FI_METAROCE_IFACE='eth0'" in w and "not its secondary interface" in w
        for w in decision.warnings
    ), decision.warnings


def test_host_network_pods_keep_the_netdev() -> None:
    p = pod("mr")
    p["spec"]["hostNetwork"] = True
    out, _ = mutated(p)
    assert MULTUS not in out["metadata"]["annotations"]
    assert "FI_METAROCE_IFACE" not in env_of(out) and env_of(out)["FI_PROVIDER"] == "metaroce"
    for other in ("mrh", "mrp", "backend"):  # no secondary interface: nothing of Multus
        out, decision = mutated(pod(other))
        assert MULTUS not in out["metadata"]["annotations"], other
        assert "FI_METAROCE_IFACE" not in env_of(out), other
        hint = [w for w in decision.warnings if "hostNetwork: true" in w]
        assert bool(hint) == (other == "mrh"), (other, decision.warnings)


def test_the_policy_renders_the_same_rules() -> None:
    settings = RenderSettings(admission_mode="policy", namespace="rdma-system")
    net = NETS["mr"].network
    assert net is not None
    policy, _ = render_pod_policy(net, settings)
    spec = policy["spec"]
    names = [v["name"] for v in spec["variables"]]
    assert names[-3:] == ["missingHost", "replacedHost", "attachment"]
    expression = spec["mutations"][0]["jsonPatch"]["expression"]
    assert "[] : (has(object.spec.hostNetwork) && object.spec.hostNetwork) ? (" in expression
    assert "'rdma-system/metaroce-mr@mr0'" in expression
    assert "',rdma-system/metaroce-mr@mr0'" in expression
    assert '{"name":"metaroce-mr","namespace":"rdma-system","interface":"mr0"}' in expression
    assert "variables.missingHost" in expression and "'FI_METAROCE_IFACE': 'mr0'" in expression
    # a network without a secondary interface renders as before: no Multus at all
    plain = NETS["mrp"].network
    assert plain is not None
    policy, _ = render_pod_policy(plain, settings)
    assert "k8s.v1.cni.cncf.io" not in json.dumps(policy) and "hostNetwork" not in json.dumps(
        policy
    )


def test_the_network_webhook_refuses_a_subnet_too_small_for_the_selected_nodes() -> None:
    from webhook_testlib import network_obj

    from metaroce_operator.webhooks.validate import validate_network_change

    nodes = {f"n{i}": {"pool": "a"} for i in range(3)}
    small = network_obj(
        "small",
        **METAROCE,
        nodeSelector={"matchLabels": {"pool": "a"}},
        attachment={"podNetwork": {"subnet": "10.56.0.0/23"}},  # two /24 blocks
    )
    verdict = validate_network_change(small, [], nodes)
    assert [str(p) for p in verdict.problems] == [
        "spec.attachment.podNetwork.subnet: 10.56.0.0/23 holds 2 blocks of /24, but "
        "spec.nodeSelector selects 3 nodes, each of which needs its own: widen subnet, or "
        "raise nodePrefixLength (smaller blocks, fewer pods per node)"
    ]
    fits = network_obj(
        "fits",
        **METAROCE,
        nodeSelector={"matchLabels": {"pool": "a"}},
        attachment={"podNetwork": {"subnet": "10.56.0.0/23", "nodePrefixLength": 25}},
    )
    assert validate_network_change(fits, [], nodes).allowed
    # another network's overlapping subnet: a warning
    other = NETS["mr"].network
    assert other is not None
    verdict = validate_network_change(fits, [other], nodes)  # (their NICs conflict too)
    assert any("overlaps network 'mr'" in w for w in verdict.warnings), verdict
