"""NIC conflicts between networks: glob intersection, selector overlap, observed overlap."""

from __future__ import annotations

import fnmatch
import itertools

import pytest
from operator_testlib import network

from metaroce_api import LabelSelector, MetaRoceNetwork, NicSelector, validate_network
from metaroce_api.examples import minimal_network
from metaroce_operator.conflicts import (
    created_order,
    find_conflicts,
    globs_intersect,
    holding_conflicts,
    nic_overlap,
    selector_matches,
)


@pytest.mark.parametrize(
    ("a", "b", "meet"),
    [
        ("ens1f*", "ens1f0", True),
        ("ens1*", "ens2*", False),
        ("eth[0-3]", "eth5", False),
        ("eth[!0-3]", "eth5", True),
        ("*", "anything", True),
        ("a*b", "*c", False),
        ("mlx5_*", "rxe*", False),
        ("e?h1", "eth?", True),
        ("[ab]x", "[bc]x", True),
        ("[a]x", "[b]x", False),
        ("eth1", "eth1", True),
        ("eth1", "eth10", False),
    ],
)
def test_globs_intersect(a: str, b: str, meet: bool) -> None:
    assert globs_intersect(a, b) is meet
    assert globs_intersect(b, a) is meet


def test_globs_intersect_agrees_with_fnmatch_on_samples() -> None:
    names = ["".join(p) for n in range(1, 4) for p in itertools.product("ab1", repeat=n)]
    globs = ["a*", "*1", "?b", "a?1", "[ab]*", "[!a]1", "*", "b", "a*b*1"]
    for x, y in itertools.product(globs, repeat=2):
        brute = any(fnmatch.fnmatchcase(n, x) and fnmatch.fnmatchcase(n, y) for n in names)
        if brute:  # the sample set is finite: only "can meet" is decidable by sampling
            assert globs_intersect(x, y), (x, y)


def test_nic_overlap_is_and_across_attributes() -> None:
    a = NicSelector(interface_names=["ens1f*"], pci_vendor_ids=["0x15b3"])
    assert nic_overlap(a, NicSelector(interface_names=["ens1f1"])) is not None
    assert nic_overlap(a, NicSelector(interface_names=["ens2f1"])) is None
    assert nic_overlap(a, NicSelector(pci_vendor_ids=["15B3"])) is not None
    assert nic_overlap(a, NicSelector(pci_vendor_ids=["0x8086"])) is None
    # Different attributes only: cannot rule an overlap out.
    assert nic_overlap(a, NicSelector(drivers=["mlx5_core"])) is not None


def test_selector_matches() -> None:
    sel = LabelSelector.model_validate(
        {
            "matchLabels": {"rdma": "yes"},
            "matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]},
                {"key": "bad", "operator": "DoesNotExist"},
            ],
        }
    )
    assert selector_matches(sel, {"rdma": "yes", "zone": "a"})
    assert not selector_matches(sel, {"rdma": "yes", "zone": "b"})
    assert not selector_matches(sel, {"rdma": "yes", "zone": "a", "bad": ""})
    assert selector_matches(LabelSelector(), {})


def test_conflicts_need_shared_nodes_and_shared_nics() -> None:
    nodes = {"n1": {"pool": "a"}, "n2": {"pool": "b"}}
    x = network(
        "x", nics={"interfaceNames": ["ens1*"]}, nodeSelector={"matchLabels": {"pool": "a"}}
    )
    y = network("y", nics={"interfaceNames": ["ens1f0"]})
    z = network(
        "z", nics={"interfaceNames": ["ens1f0"]}, nodeSelector={"matchLabels": {"pool": "b"}}
    )
    w = network("w", nics={"interfaceNames": ["eth9"]})
    found = find_conflicts([x, y, z, w], nodes, {})
    assert [(f.other, f.nodes) for f in found["x"]] == [("y", ("n1",))]
    assert sorted(f.other for f in found["y"]) == ["x", "z"]
    assert found["w"] == []
    message = found["x"][0].message()
    assert "'y'" in message and "n1" in message and "disjoint" in message


def test_observed_conflict_from_reported_netdevs() -> None:
    x = network("x", nics={"interfaceNames": ["ens1*"]})
    y = network("y", nics={"interfaceNames": ["ens2*"]})
    found = find_conflicts([x, y], {"n1": {}}, {"x": {"n1": ["ens1f0"]}, "y": {"n1": ["ens1f0"]}})
    (conflict,) = found["x"]
    assert conflict.observed and conflict.nodes == ("n1",)
    assert "also configures" in conflict.message()


def test_the_network_created_later_is_held() -> None:
    nodes = {"n1": {}}
    old = network("zz-old", nics={"interfaceNames": ["eth*"]})
    new = network("aa-new", nics={"interfaceNames": ["eth1"]})
    apart = network("apart", nics={"interfaceNames": ["ens9"]})
    nets = {n.name: n for n in (old, new, apart)}
    stamps = {"zz-old": "00", "aa-new": "05", "apart": "09"}
    order = {
        name: created_order(
            {"metadata": {"name": name, "creationTimestamp": f"2026-01-01T00:00:{sec}Z"}}
        )
        for name, sec in stamps.items()
    }
    (held,) = holding_conflicts("aa-new", nets, order, nodes, {})
    assert held.other == "zz-old" and held.nodes == ("n1",)
    message = held.held_message()
    assert "rollout held" in message and "'zz-old' was created first" in message
    assert "n1" in message and "disjoint" in message
    assert holding_conflicts("zz-old", nets, order, nodes, {}) == []
    assert holding_conflicts("apart", nets, order, nodes, {}) == []


def test_equal_creation_times_are_ordered_by_name() -> None:
    stamp = "2026-01-01T00:00:00Z"
    a = created_order({"metadata": {"name": "a", "creationTimestamp": stamp}})
    b = created_order({"metadata": {"name": "b", "creationTimestamp": stamp}})
    assert a < b
    # Not created yet (no timestamp): after every existing network.
    assert created_order({"metadata": {"name": "a"}}) > b


def only_nics(name: str, nics: dict[str, list[str]]) -> MetaRoceNetwork:
    """A network selecting NICs by `nics` alone (the example network's are replaced)."""
    body = minimal_network(name)
    body["metadata"].update({"generation": 1, "uid": f"uid-{name}"})
    body["spec"]["nics"] = nics
    return validate_network(body)


def test_selectors_on_different_attributes_are_decided_from_the_reports_issue_16_3() -> None:
    """drivers on one side, interfaceNames on the other: no static verdict is possible
    (the webhook admits the pair saying so); the NICs the agents report decide, and with
    nothing that matches both, nothing is held."""
    nodes = {"n1": {}}
    old = only_nics("old", {"drivers": ["mlx5_core"]})
    new = only_nics("new", {"interfaceNames": ["eth9"]})
    nets = {n.name: n for n in (old, new)}
    order = {"old": ("2026-01-01T00:00:00Z", "old"), "new": ("2026-01-01T00:00:05Z", "new")}
    # Before any report, and with old's agents reporting a NIC new cannot select.
    assert holding_conflicts("new", nets, order, nodes, {}) == []
    assert holding_conflicts("new", nets, order, nodes, {"old": {"n1": ["ens1f0"]}}) == []
    assert find_conflicts([old, new], nodes, {})["new"] == []


def test_a_reported_nic_that_both_select_is_a_conflict_issue_16_3() -> None:
    from metaroce_operator.observed import ReportedNic

    nodes = {"n1": {}}
    old = only_nics("old", {"drivers": ["mlx5_core"]})
    new = only_nics("new", {"interfaceNames": ["ens1*"]})
    nets = {n.name: n for n in (old, new)}
    order = {"old": ("2026-01-01T00:00:00Z", "old"), "new": ("2026-01-01T00:00:05Z", "new")}
    reported = {"old": {"n1": [ReportedNic("ens1f0", driver="mlx5_core")]}}
    (held,) = holding_conflicts("new", nets, order, nodes, {}, nics=reported)
    assert held.other == "old" and held.nodes == ("n1",) and "ens1f0" in held.message()
    elsewhere = {"old": {"n1": [ReportedNic("ens2f0", driver="mlx5_core")]}}
    assert holding_conflicts("new", nets, order, nodes, {}, nics=elsewhere) == []


def test_two_networks_advertising_one_resource_conflict_issue_16_10() -> None:
    """The webhook refuses a second network with the same attachment.resourceName, but
    two writes can race: the leader must notice, or a pod asking for the resource gets
    either network's NICs (two device plugins advertise it)."""
    nodes = {"n1": {"pool": "a"}, "n2": {"pool": "b"}}
    old = only_nics("old", {"interfaceNames": ["eth1"]})
    body = minimal_network("new")
    body["metadata"].update({"generation": 1, "uid": "uid-new"})
    body["spec"]["nics"] = {"interfaceNames": ["eth2"]}
    body["spec"]["attachment"] = {"resourceName": old.resource_name}
    new = validate_network(body)
    order = {"old": ("2026-01-01T00:00:00Z", "old"), "new": ("2026-01-01T00:00:05Z", "new")}
    (held,) = holding_conflicts("new", {"old": old, "new": new}, order, nodes, {})
    assert held.other == "old" and old.resource_name in held.message()
    assert "resourceName" in held.message()
