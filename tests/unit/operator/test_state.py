"""The leader's state, one object per concern (issue 16, structure): every table kept per
network is forgotten with its network, and observed state cannot be read before the
first list of its kind (finding 1: a cleanup decided from NodeStates not listed yet)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from metaroce_operator.observed import NodeView
from metaroce_operator.state import NotSynced, PerNetwork, Store, tables

NOT_PER_NETWORK = {
    ("Reports", "_by_network"),  # a report outlives its network until its NodeState goes
    ("Reports", "_keys"),
    ("Nodes", "_view"),  # the cluster's nodes, not a network's
}
"""Collections a concern keeps that are not by network name, and why."""


def nodestate(name: str, network: str, node: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "labels": {}},
        "spec": {"node": node, "network": network},
        "status": {"phase": "Ready", "configGeneration": 1, **status},
    }


def test_every_collection_of_a_concern_is_per_network_or_says_why_not() -> None:
    store = Store()
    for attr, concern in vars(store).items():
        if attr in ("bodies", "networks"):
            continue  # the network bodies themselves (freshness.NetworkBodies forgets them)
        for field, value in vars(concern).items():
            if isinstance(value, (dict, set, list)) and not isinstance(value, PerNetwork):
                assert (type(concern).__name__, field) in NOT_PER_NETWORK, (attr, field)


def test_forgetting_a_network_clears_every_table_of_every_concern() -> None:
    async def main() -> None:
        store = Store()
        loop = asyncio.get_running_loop()
        filled = 0
        for concern in store.concerns():
            for table in tables(concern):
                # Any value does; a timer also suits the one table that cancels its values.
                table["net"], table["other"] = (loop.call_later(60, lambda: None) for _ in "ab")
                filled += 1
        store.cleanup.recheck_at("net", 60, lambda: None)  # a real timer, to be cancelled
        timer = store.cleanup.timers["net"]
        assert filled >= 12  # children 6, conflicts 3, taints 2, ... : found, not listed
        store.forget_network("net")
        for concern in store.concerns():
            for table in tables(concern):
                assert "net" not in table and "other" in table, (concern, table)
        assert timer.cancelled()

    asyncio.run(main())


def test_reports_are_unreadable_until_the_first_list_is_in() -> None:
    store = Store()
    # The first list comes in through events before the informer marks it complete.
    assert store.reports.on_event(None, nodestate("net.a", "net", "a"))[0] is None
    for read in (
        lambda: store.reports.of("net"),
        lambda: list(store.reports.every()),
        store.reports.netdevs,
        store.reports.nics,
    ):
        with pytest.raises(NotSynced):
            read()
    assert store.reports.count("net") == 1  # the cheap pre-check stays ungated
    store.reports.listed.set()
    assert set(store.reports.of("net")) == {"a"}
    # A NodeState that now names another network moves; a deleted one goes.
    was, report = store.reports.on_event("MODIFIED", nodestate("net.a", "other", "a"))
    assert was == "net" and report is not None and report.network == "other"
    assert not store.reports.of("net") and set(store.reports.of("other")) == {"a"}
    assert store.reports.on_event("DELETED", nodestate("net.a", "other", "a")) == ("other", None)
    assert not store.reports.of("other")


def test_nodes_are_unreadable_until_the_first_node_pass() -> None:
    store = Store()
    with pytest.raises(NotSynced):
        store.nodes.view()
    with pytest.raises(NotSynced):
        store.nodes.labels()
    assert store.nodes.names_or_none() is None  # cleanup: "unknown", not "no nodes"
    store.nodes.listed([NodeView.from_body({"metadata": {"name": "a", "labels": {"x": "1"}}})])
    assert store.nodes.labels() == {"a": {"x": "1"}}
    assert store.nodes.names_or_none() == {"a"}


def test_replace_says_whether_a_value_changed() -> None:
    table: PerNetwork[tuple[str, ...]] = PerNetwork()
    assert not table.replace("net", (), ())  # empty stays empty: no status write
    assert table.replace("net", ("x",), ())
    assert not table.replace("net", ("x",), ())
    assert table.replace("net", (), ()) and table["net"] == ()
