"""Network validation across networks and nodes, as a pure function over a table."""

from __future__ import annotations

from typing import Any

import pytest
from webhook_testlib import network_obj

from metaroce_api import LabelSelector, MetaRoceNetwork, validate_network
from metaroce_operator.webhooks.validate import selectors_disjoint, validate_network_change

NODES = {
    "gpu-a1": {"pool": "a", "gpu": "h100"},
    "gpu-a2": {"pool": "a"},
    "gpu-b1": {"pool": "b"},
}


def net(name: str, **spec: Any) -> MetaRoceNetwork:
    return validate_network(network_obj(name, **spec))


EXISTING = [
    net(
        "backend", nics={"interfaceNames": ["ens1f*"]}, nodeSelector={"matchLabels": {"pool": "a"}}
    ),
    net(
        "storage",
        nics={"drivers": ["mlx5_core"]},
        attachment={"resourceName": "example.com/stor"},
        nodeSelector={"matchLabels": {"pool": "b"}},
    ),
]


def check(obj: dict[str, Any], nodes: Any = NODES) -> tuple[list[str], list[str]]:
    verdict = validate_network_change(obj, EXISTING, nodes)
    return [str(p) for p in verdict.problems], verdict.warnings


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        # NICs on shared nodes
        (
            {
                "nics": {"interfaceNames": ["ens1f0"]},
                "nodeSelector": {"matchLabels": {"gpu": "h100"}},
            },
            "spec.nics",
            ["network 'backend'", "1 node(s) (gpu-a1)", "'ens1f0' and 'ens1f*'", "disjoint"],
        ),
        (
            {"nics": {"interfaceNames": ["ens*"]}},  # empty selector: every node
            "spec.nics",
            ["network 'backend'", "2 node(s)"],
        ),
        # resource names
        (
            {
                "nics": {"interfaceNames": ["eth9"]},
                "attachment": {"resourceName": "example.com/stor"},
            },
            "spec.attachment.resourceName",
            ["'example.com/stor' is already used by network 'storage'"],
        ),
        (
            {
                "nics": {"interfaceNames": ["eth9"]},
                "attachment": {"resourceName": "metaroce.io/backend"},
            },
            "spec.attachment.resourceName",
            ["used by network 'backend'"],
        ),
        # transports the NICs cannot run
        (
            {"nics": {"drivers": ["virtio_net"]}, "transport": {"mode": "rocev2"}},
            "spec.transport.mode",
            ["rocev2 needs hardware RoCE", "virtio_net", "softroce"],
        ),
        (
            {"nics": {"pciVendorIds": ["0x1af4"]}, "transport": {"mode": "rocev2"}},
            "spec.transport.mode",
            ["vendors without RDMA"],
        ),
        (
            {"nics": {"rdmaDevices": ["rxe*"]}, "transport": {"mode": "rocev2"}},
            "spec.transport.mode",
            ["only SoftRoCE (rxe)"],
        ),
        (
            {"nics": {"drivers": ["virtio_net"]}},  # mode auto, no fallback
            "spec.transport.allowSoftRoceFallback",
            ["allowSoftRoceFallback: true"],
        ),
        (
            {"nics": {"rdmaDevices": ["mlx5_*"]}, "transport": {"mode": "softroce"}},
            "spec.nics.rdmaDevices",
            ["mlx5_* can never match", "rxe*"],
        ),
        (
            {
                "nics": {"drivers": ["virtio_net"]},
                "transport": {"mode": "softroce"},
                "qos": {"onUnsupported": "error"},
            },
            "spec.qos.onUnsupported",
            ["no DCB", "onUnsupported: skip"],
        ),
        (
            {
                "nics": {"rdmaDevices": ["rxe*"]},
                "transport": {"mode": "metaroce"},
                "qos": {"profile": "lossy"},
            },
            "spec.nics.rdmaDevices",
            ["metaroce serves netdevs, not SoftRoCE devices", "interfaceNames"],
        ),
    ],
)
def test_refused(spec: dict[str, Any], field: str, words: list[str]) -> None:
    problems, _ = check(network_obj("new", **spec))
    assert problems, "expected a refusal"
    hit = [p for p in problems if p.startswith(field + ":")]
    assert hit, problems
    for word in words:
        assert word in hit[0], hit[0]


@pytest.mark.parametrize(
    "spec",
    [
        {"nics": {"interfaceNames": ["ens2*"]}},  # other NICs
        {"nics": {"interfaceNames": ["ens1f*"]}, "nodeSelector": {"matchLabels": {"pool": "b"}}},
        {"nics": {"drivers": ["virtio_net"]}, "transport": {"mode": "softroce"}},
        {"nics": {"drivers": ["virtio_net"]}, "transport": {"allowSoftRoceFallback": True}},
        {
            "nics": {"drivers": ["mlx5_core"]},
            "transport": {"mode": "rocev2"},
            "nodeSelector": {"matchLabels": {"pool": "a"}},
        },
        {"nics": {"rdmaDevices": ["rxe_*"]}, "transport": {"mode": "softroce"}},
    ],
)
def test_accepted(spec: dict[str, Any]) -> None:
    problems, _ = check(network_obj("new", **spec))
    assert problems == []


def test_updating_itself_is_not_a_conflict() -> None:
    obj = network_obj(
        "backend",
        nics={"interfaceNames": ["ens1f*"]},
        nodeSelector={"matchLabels": {"pool": "a"}},
        qos={"data": {"dscp": 24}},
    )
    assert check(obj) == ([], [])


def test_overlap_without_shared_nodes_today_is_a_warning() -> None:
    obj = network_obj(
        "new", nics={"interfaceNames": ["ens1f1"]}, nodeSelector={"matchLabels": {"gpu": "a100"}}
    )
    problems, warnings = check(obj)
    assert problems == []
    assert any("no node is selected by both" in w for w in warnings)


def test_without_node_information_selectors_decide() -> None:
    obj = network_obj(
        "new", nics={"interfaceNames": ["ens1f1"]}, nodeSelector={"matchLabels": {"gpu": "a100"}}
    )
    problems, _ = check(obj, nodes=None)
    assert problems and "can select the same nodes" in problems[0]
    obj = network_obj(
        "new", nics={"interfaceNames": ["ens1f1"]}, nodeSelector={"matchLabels": {"pool": "b"}}
    )
    assert check(obj, nodes=None)[0] == []


def test_same_agent_ports_on_shared_nodes_warn() -> None:
    """Disjoint NICs on the same nodes are fine, but both agents cannot bind one host port."""
    obj = network_obj(
        "new", nics={"interfaceNames": ["ens2f*"]}, nodeSelector={"matchLabels": {"pool": "a"}}
    )
    problems, warnings = check(obj)
    assert problems == []
    (warning,) = [w for w in warnings if "host port" in w]
    assert "network 'backend'" in warning and "2 node(s)" in warning and "9478" in warning
    assert "spec.agent.metricsPort" in warning
    other_ports = network_obj(
        "new",
        nics={"interfaceNames": ["ens2f*"]},
        nodeSelector={"matchLabels": {"pool": "a"}},
        agent={"metricsPort": 9479, "probePort": 47912},
    )
    assert not [w for w in check(other_ports)[1] if "host port" in w]
    elsewhere = network_obj(
        "new", nics={"interfaceNames": ["ens2f*"]}, nodeSelector={"matchLabels": {"pool": "c"}}
    )
    assert not [w for w in check(elsewhere)[1] if "host port" in w]


def test_metaroce_runs_on_any_netdev_without_warnings() -> None:
    obj = network_obj(
        "new",
        nics={"drivers": ["virtio_net"]},
        transport={"mode": "metaroce"},
        qos={"profile": "lossy"},
    )
    problems, warnings = check(obj)
    assert problems == [] and not any("metaroce" in w for w in warnings), warnings


def test_invalid_object_lists_its_issues() -> None:
    obj = network_obj("new")
    obj["spec"]["qos"] = {"profile": "lossy", "pfcPriorities": [3]}
    problems, _ = check(obj)
    assert any(p.startswith("spec.qos.pfcPriorities:") for p in problems)


def sel(**kw: Any) -> LabelSelector:
    return LabelSelector.model_validate(kw)


@pytest.mark.parametrize(
    ("a", "b", "disjoint"),
    [
        ({"matchLabels": {"p": "a"}}, {"matchLabels": {"p": "b"}}, True),
        ({"matchLabels": {"p": "a"}}, {"matchLabels": {"q": "b"}}, False),
        ({}, {"matchLabels": {"p": "b"}}, False),
        (
            {"matchExpressions": [{"key": "p", "operator": "In", "values": ["a", "b"]}]},
            {"matchExpressions": [{"key": "p", "operator": "NotIn", "values": ["a", "b"]}]},
            True,
        ),
        (
            {"matchExpressions": [{"key": "p", "operator": "Exists"}]},
            {"matchExpressions": [{"key": "p", "operator": "DoesNotExist"}]},
            True,
        ),
        (
            {"matchLabels": {"p": "a"}},
            {"matchExpressions": [{"key": "p", "operator": "DoesNotExist"}]},
            True,
        ),
        (
            {"matchExpressions": [{"key": "p", "operator": "In", "values": ["a", "b"]}]},
            {"matchLabels": {"p": "b"}},
            False,
        ),
    ],
)
def test_selectors_disjoint(a: dict[str, Any], b: dict[str, Any], disjoint: bool) -> None:
    assert selectors_disjoint(sel(**a), sel(**b)) is disjoint
    assert selectors_disjoint(sel(**b), sel(**a)) is disjoint


def test_nics_chosen_by_other_attributes_only_warn() -> None:
    obj = network_obj("new", nics={"interfaceNames": ["ens9"]})  # storage picks by driver
    problems, warnings = check(obj)
    assert problems == []
    assert any("'storage' selects NICs by other attributes" in w for w in warnings)


def _update_review(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {"operation": "UPDATE", "object": new, "oldObject": old}


def test_conflicting_networks_stay_editable_issue_16_9() -> None:
    """Two networks that conflict already (a race at admission, or nodes relabelled
    since): an edit that leaves the conflict as it was, or makes it smaller, is admitted
    with a warning; only a problem the edit brings is refused."""
    import threading

    from webhook_testlib import views

    from metaroce_operator.webhooks.mutate import NetworkView
    from metaroce_operator.webhooks.server import AdmissionHandler

    synced = threading.Event()
    synced.set()
    cached = views(*(NetworkView(n.name, n) for n in EXISTING))
    handler = AdmissionHandler(lambda: cached, synced, lambda _: {}, lambda: NODES)
    old = network_obj(
        "late", nics={"interfaceNames": ["ens1f*"]}, nodeSelector={"matchLabels": {"pool": "a"}}
    )
    # Another field (the log level) while the conflict with 'backend' stands.
    edited = network_obj(
        "late",
        nics={"interfaceNames": ["ens1f*"]},
        nodeSelector={"matchLabels": {"pool": "a"}},
        agent={"logLevel": "debug"},
    )
    decision = handler.validate(_update_review(old, edited))
    assert decision.__class__.__name__ == "Allowed", decision
    assert any("network 'backend'" in w for w in decision.warnings), decision.warnings
    # A step towards the fix: one node less in the conflict.
    narrower = network_obj(
        "late", nics={"interfaceNames": ["ens1f*"]}, nodeSelector={"matchLabels": {"gpu": "h100"}}
    )
    assert handler.validate(_update_review(old, narrower)).__class__.__name__ == "Allowed"
    # A new problem is still refused: taking storage's resource name.
    worse = network_obj(
        "late",
        nics={"interfaceNames": ["ens1f*"]},
        nodeSelector={"matchLabels": {"pool": "a"}},
        attachment={"resourceName": "example.com/stor"},
    )
    refused = handler.validate(_update_review(old, worse))
    assert refused.__class__.__name__ == "Denied"
    assert "spec.attachment.resourceName" in refused.message  # type: ignore[union-attr]
    assert "network 'backend'" not in refused.message  # type: ignore[union-attr]


PINNED = "ghcr.io/metaroce/metaroce-agent:0.1.0"
BY_DIGEST = "registry.example.com/agent@sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("image", "refused"),
    [
        (None, False),  # the operator's own (pinned) image
        (PINNED, False),
        (BY_DIGEST, False),
        ("registry.example.com/agent:v2", True),  # the right repository is not enough
        ("evil.example.com/root:1", True),
    ],
)
def test_agent_images_come_from_the_allowlist_issue_16_11(image: str | None, refused: bool) -> None:
    """spec.agent.image runs privileged with the host's PID and network namespaces and
    read-write /dev and /sys: only images the operator was given may run there."""
    spec: dict[str, Any] = {"nics": {"interfaceNames": ["eth7"]}}
    if image:
        spec["agent"] = {"image": image}
    verdict = validate_network_change(
        network_obj("new", **spec), EXISTING, NODES, allowed_agent_images=(PINNED, BY_DIGEST)
    )
    assert (not verdict.allowed) is refused, verdict.problems
    if refused:
        (problem,) = verdict.problems
        assert problem.field == "spec.agent.image"
        assert repr(image) in problem.message and PINNED in problem.message
        assert "--allowed-agent-image" in problem.message and "allowedImages" in problem.message
