"""Pod networking through Multus (spec.attachment.podNetwork), no cluster: validation, the
per-node blocks, the NetworkAttachmentDefinition, the node's CNI configuration (its step
applied, verified and undone on a fixture root), and the pod annotation's merge."""

from __future__ import annotations

import json
from ipaddress import IPv4Network
from typing import Any

import pytest

from metaroce_api import InvalidObject, validate_network
from metaroce_api.examples import merge, minimal_network
from metaroce_api.network import PodNetworkSpec
from metaroce_api.podnet import (
    block_annotation,
    cni_config,
    conf_path,
    merge_networks_annotation,
    nad_name,
)
from metaroce_operator.podblocks import plan_blocks, too_small_message
from metaroce_operator.render import render_network
from metaroce_operator.settings import RenderSettings

LOSSY_METAROCE: dict[str, Any] = {"transport": {"mode": "metaroce"}, "qos": {"profile": "lossy"}}


def body(name: str = "mr", **pod_network: Any) -> dict[str, Any]:
    spec = {**LOSSY_METAROCE, "attachment": {"podNetwork": pod_network}}
    out = merge(minimal_network(name), {"spec": spec})
    out["metadata"].update({"uid": "uid-1", "generation": 1})
    return out


def refusal(obj: dict[str, Any]) -> str:
    with pytest.raises(InvalidObject) as err:
        validate_network(obj)
    return str(err.value)


# --- validation ----------------------------------------------------------------------------


def test_defaults_macvlan_mr0_and_24s() -> None:
    spec = validate_network(body(subnet="10.56.0.0/16")).spec.attachment.pod_network
    assert spec is not None
    assert (spec.mode, spec.interface, spec.node_prefix_length) == ("macvlan", "mr0", 24)
    assert spec.block_count == 256 and spec.secondary


@pytest.mark.parametrize(
    ("pod_network", "field", "words"),
    [
        ({}, "spec.attachment.podNetwork.subnet", "set subnet"),
        ({"subnet": "10.56.1.0/16"}, "spec.attachment.podNetwork.subnet", "without host bits"),
        ({"subnet": "10.56.0.0/33"}, "spec.attachment.podNetwork.subnet", "CIDR"),
        ({"subnet": "300.1.0.0/16"}, "spec.attachment.podNetwork.subnet", "CIDR"),
        (
            {"subnet": "10.56.0.0/24", "nodePrefixLength": 16},
            "spec.attachment.podNetwork.nodePrefixLength",
            "widen subnet",
        ),
        ({"subnet": "10.56.0.0/16", "interface": "Mr-0"}, "interface", "pattern"),
        ({"subnet": "10.56.0.0/16", "mode": "bridge"}, "mode", "macvlan"),
    ],
)
def test_bad_pod_networks_are_refused_naming_the_field(
    pod_network: dict[str, Any], field: str, words: str
) -> None:
    text = refusal(body(**pod_network))
    assert field in text and words in text, text


def test_host_network_needs_no_subnet_and_pod_network_needs_metaroce() -> None:
    spec = validate_network(body(mode="hostNetwork")).spec.attachment.pod_network
    assert spec is not None and not spec.secondary
    other = merge(
        minimal_network("sr"),
        {
            "spec": {
                "transport": {"mode": "softroce"},
                "attachment": {"podNetwork": {"mode": "hostNetwork"}},
            }
        },
    )
    text = refusal(other)
    assert "spec.attachment.podNetwork" in text and "transport.mode: metaroce" in text, text


# --- per-node blocks -------------------------------------------------------------------------


def spec_of(**kw: Any) -> PodNetworkSpec:
    return PodNetworkSpec.model_validate({"subnet": "10.56.0.0/22", **kw})


def test_new_nodes_get_the_lowest_free_blocks_in_name_order() -> None:
    plan = plan_blocks(spec_of(), {"n-b", "n-a", "n-c"}, {})
    assert plan.blocks == {"n-a": "10.56.0.0/24", "n-b": "10.56.1.0/24", "n-c": "10.56.2.0/24"}
    assert plan.changes == plan.blocks and not plan.unassigned


def test_blocks_are_stable_and_never_shared() -> None:
    current = {"n-a": "10.56.2.0/24", "n-b": "10.56.2.0/24", "n-z": "10.56.0.0/24"}
    plan = plan_blocks(spec_of(), {"n-a", "n-b", "n-c", "n-z"}, current)
    # n-a keeps its block (first by name), n-z keeps its own, n-b and n-c get free ones
    assert plan.blocks == {
        "n-a": "10.56.2.0/24",
        "n-z": "10.56.0.0/24",
        "n-b": "10.56.1.0/24",
        "n-c": "10.56.3.0/24",
    }
    assert plan.changes == {"n-b": "10.56.1.0/24", "n-c": "10.56.3.0/24"}
    assert len(set(plan.blocks.values())) == len(plan.blocks)
    # the same state again: nothing to change
    again = plan_blocks(spec_of(), {"n-a", "n-b", "n-c", "n-z"}, plan.blocks)
    assert again.changes == {} and again.blocks == plan.blocks


def test_a_node_out_of_the_network_gives_its_block_back() -> None:
    plan = plan_blocks(spec_of(), {"n-b"}, {"n-a": "10.56.0.0/24", "n-b": "10.56.1.0/24"})
    assert plan.changes == {"n-a": None} and plan.blocks == {"n-b": "10.56.1.0/24"}
    later = plan_blocks(spec_of(), {"n-b", "n-c"}, {"n-b": "10.56.1.0/24"})
    assert later.changes == {"n-c": "10.56.0.0/24"}  # the freed block, re-used


def test_a_changed_subnet_reassigns_and_hostnetwork_removes() -> None:
    current = {"n-a": "10.56.0.0/24"}
    moved = plan_blocks(spec_of(subnet="10.57.0.0/16"), {"n-a"}, current)
    assert moved.changes == {"n-a": "10.57.0.0/24"}
    resized = plan_blocks(spec_of(nodePrefixLength=26), {"n-a"}, current)
    assert resized.changes == {"n-a": "10.56.0.0/26"}
    host = PodNetworkSpec.model_validate({"mode": "hostNetwork"})
    assert plan_blocks(host, {"n-a"}, current).changes == {"n-a": None}


def test_a_subnet_too_small_for_the_nodes_is_reported() -> None:
    spec = spec_of(subnet="10.56.0.0/23")  # two /24 blocks
    plan = plan_blocks(spec, {"n-a", "n-b", "n-c"}, {"n-c": "bogus"})
    assert plan.blocks == {"n-a": "10.56.0.0/24", "n-b": "10.56.1.0/24"}
    assert plan.unassigned == ("n-c",) and plan.changes["n-c"] is None
    text = too_small_message(spec, 3, set(plan.unassigned))
    assert "spec.attachment.podNetwork.subnet 10.56.0.0/23 holds 2 blocks" in text
    assert "3 nodes" in text and "n-c" in text and "widen subnet" in text


# --- the NetworkAttachmentDefinition -----------------------------------------------------------


def test_the_nad_is_rendered_without_config_before_the_daemonset() -> None:
    net = validate_network(body(subnet="10.56.0.0/16"))
    objs = render_network(net, RenderSettings())
    kinds = [o["kind"] for o in objs]
    assert kinds.index("NetworkAttachmentDefinition") < kinds.index("DaemonSet")
    nad = objs[kinds.index("NetworkAttachmentDefinition")]
    assert nad["apiVersion"] == "k8s.cni.cncf.io/v1" and "spec" not in nad
    assert nad["metadata"]["name"] == "metaroce-mr"
    assert nad["metadata"]["namespace"] == "metaroce-system"
    assert nad["metadata"]["ownerReferences"][0]["kind"] == "MetaRoceNetwork"
    summary = json.loads(nad["metadata"]["annotations"]["metaroce.io/pod-network"])
    assert summary["subnet"] == "10.56.0.0/16" and summary["interface"] == "mr0"
    pod = objs[-1]["spec"]["template"]["spec"]
    assert {"name": "multus-conf", "mountPath": "/etc/cni/multus/net.d"} in pod["containers"][0][
        "volumeMounts"
    ]
    # hostNetwork mode and networks without podNetwork: no NAD, no extra mount
    for other in (body(mode="hostNetwork"), merge(minimal_network("x"), {"spec": {}})):
        objs = render_network(validate_network(other), RenderSettings())
        assert "NetworkAttachmentDefinition" not in [o["kind"] for o in objs]
        assert "multus-conf" not in json.dumps(objs[-1])


def test_long_network_names_give_nad_names_that_fit() -> None:
    long = "n" * 63
    assert len(nad_name(long)) <= 63 and nad_name(long) != nad_name("n" * 62 + "m")
    assert conf_path("mr") == "/etc/cni/multus/net.d/metaroce-mr.conf"
    assert block_annotation("mr") == "podnet.metaroce.io/mr"


# --- the node's CNI configuration --------------------------------------------------------------


def test_cni_config_hands_out_the_node_block_with_the_subnet_prefix() -> None:
    spec = spec_of(subnet="10.56.0.0/16")
    conf = cni_config("mr", spec, "eth0", "10.56.3.0/24")
    assert conf == {
        "cniVersion": "0.4.0",
        "name": "metaroce-mr",
        "type": "macvlan",
        "master": "eth0",
        "mode": "bridge",
        "ipam": {
            "type": "host-local",
            "ranges": [
                [{"subnet": "10.56.0.0/16", "rangeStart": "10.56.3.1", "rangeEnd": "10.56.3.254"}]
            ],
        },
    }
    first = cni_config("mr", spec, "eth0", "10.56.0.0/24")["ipam"]["ranges"][0][0]
    assert first["rangeStart"] == "10.56.0.2"  # .1 is host-local's gateway of the subnet
    ipvlan = cni_config("mr", spec_of(subnet="10.56.0.0/16", mode="ipvlan"), "ens1", "10.56.1.0/24")
    assert (ipvlan["type"], ipvlan["mode"], ipvlan["master"]) == ("ipvlan", "l2", "ens1")
    with pytest.raises(ValueError, match="is not a /24 of"):
        cni_config("mr", spec, "eth0", "10.57.0.0/24")
    # blocks of different nodes never overlap, and all are inside the subnet
    ranges = [
        cni_config("mr", spec, "eth0", str(b))["ipam"]["ranges"][0][0]
        for b in IPv4Network("10.56.0.0/16").subnets(new_prefix=24)
    ]
    assert len({r["rangeStart"] for r in ranges}) == 256


# --- the pod's k8s.v1.cni.cncf.io/networks annotation ------------------------------------------


REF = "metaroce-system/metaroce-mr@mr0"
ENTRY = '{"name":"metaroce-mr","namespace":"metaroce-system","interface":"mr0"}'


@pytest.mark.parametrize(
    ("value", "merged"),
    [
        (None, REF),
        ("  ", REF),
        ("sriov-a", f"sriov-a,{REF}"),
        ("other/sriov-a@net5 , b", f"other/sriov-a@net5 , b,{REF}"),
        ("metaroce-system/metaroce-mr@data", None),
        ("metaroce-mr", None),
        ("[]", f"[{ENTRY}]"),
        ("[ ]", f"[{ENTRY}]"),
        ('[{"name": "a"}]', f'[{{"name": "a"}},{ENTRY}]'),
        ('[{"name": "metaroce-mr", "interface": "x"}]', None),
        ('[{"name": "a"}', None),  # not a list: left for Multus to refuse
    ],
)
def test_merge_in_both_forms(value: str | None, merged: str | None) -> None:
    assert merge_networks_annotation(value, "metaroce-system", "mr", "mr0") == merged
    if merged is not None and merged.startswith("["):
        assert json.loads(merged)[-1]["interface"] == "mr0"
