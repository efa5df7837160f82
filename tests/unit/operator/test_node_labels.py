"""The operator-managed node label (issue 15 finding 4), the pure planning: a node the
network selects gets the label; one that left it keeps the label until its agent
reverted it (cleanupOnDelete), or loses it at once (without); a node that never had an
agent has nothing to revert; labels of deleted networks are orphans.

On b6733c0 (and until this fix) the agents are placed by the network's selector alone:
a node leaving it loses its agent at once, settings and journal left behind."""

from __future__ import annotations

from metaroce_api import constants as c
from metaroce_operator.nodelabels import orphaned_labels, plan_labels

L = c.node_label("net")


def test_the_label_is_the_operator_s_and_fits() -> None:
    assert L == "metaroce.io/agent-net"
    long = c.node_label("n" * 253)
    assert long.startswith(c.NODE_LABEL_PREFIX) and len(long.split("/", 1)[1]) <= 63
    assert long != c.node_label("n" * 252)


def test_selected_nodes_get_the_label() -> None:
    plan = plan_labels(L, {"a", "b"}, {"a": {}, "b": {L: "selected"}, "c": {}}, {}, True)
    assert plan == {"a": "selected"}


def test_a_node_that_left_is_reverted_before_it_loses_its_agent() -> None:
    labels = {"gone": {L: "selected"}}
    assert plan_labels(L, set(), labels, {"gone": "Ready"}, True) == {"gone": "revert"}
    asked = {"gone": {L: "revert"}}
    assert plan_labels(L, set(), asked, {"gone": "Reverting"}, True) == {}
    assert plan_labels(L, set(), asked, {"gone": "Reverted"}, True) == {"gone": None}
    # an agent that never reports reverted is let go after the cleanup timeout
    assert plan_labels(L, set(), asked, {"gone": "Ready"}, True, {"gone"}) == {"gone": None}
    # and a node that comes back before is the network's again
    assert plan_labels(L, {"gone"}, asked, {"gone": "Reverting"}, True) == {"gone": "selected"}


def test_without_cleanup_or_without_an_agent_the_label_goes_at_once() -> None:
    labels = {"gone": {L: "selected"}}
    assert plan_labels(L, set(), labels, {"gone": "Ready"}, False) == {"gone": None}
    assert plan_labels(L, set(), labels, {}, True) == {"gone": None}


def test_without_cleanup_no_node_carries_the_label_issue_16_scale() -> None:
    """The label keeps an agent until it reverted its node; a network without
    cleanupOnDelete reverts nothing, so its nodes carry none (one Node write per node
    saved: the scale bench's operator arm wrote one more per node than its limit arm)."""
    assert plan_labels(L, {"a", "b"}, {"a": {}, "b": {}}, {"a": "Ready"}, False) == {}
    # a label left from a time with cleanupOnDelete goes, selected or not
    left = {"a": {L: "selected"}, "b": {L: "revert"}, "c": {}}
    assert plan_labels(L, {"a"}, left, {"b": "Ready"}, False) == {"a": None, "b": None}


def test_labels_of_deleted_networks_are_orphans() -> None:
    other = c.node_label("other")
    nodes = {"a": {L: "selected", other: "revert", "metaroce.io/rdma": "true"}, "b": {}}
    assert orphaned_labels(nodes, {L}) == {"a": [other]}
