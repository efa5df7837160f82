"""DCB APP entries follow the config: a DSCP change leaves no entry behind (finding 3)."""

from __future__ import annotations

import json

from conftest import make_config
from fakes import mellanox_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.plan import make_plan


def plan_for(n, cfg):  # type: ignore[no-untyped-def]
    inv = n.inventory()
    return make_plan(cfg, inv, n.caps(cfg, inv))


def cfg_dscp(dscp: int):  # type: ignore[no-untyped-def]
    return make_config(
        nics={"interfaceNames": ["ens1f0"]},
        transport={"mode": "rocev2"},
        qos={"data": {"dscp": dscp}},
    )


def test_dscp_change_replaces_the_app_entry_and_revert_restores_the_original(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    n.kernel.dscp_prio["ens1f0"] = {(34, 1)}  # someone's entry from before the agent
    engine = Engine(n.host, Journal(n.host, "rdma-a"))
    assert engine.apply(plan_for(n, cfg_dscp(26))).ok
    assert n.kernel.dscp_prio["ens1f0"] == {(26, 3), (48, 6), (34, 1)}
    assert engine.apply(plan_for(n, cfg_dscp(34))).ok
    assert n.kernel.dscp_prio["ens1f0"] == {(34, 3), (48, 6)}, "(26, 3) leaked"
    assert engine.apply(plan_for(n, cfg_dscp(26))).ok
    assert n.kernel.dscp_prio["ens1f0"] == {(26, 3), (48, 6), (34, 1)}
    assert engine.apply(plan_for(n, cfg_dscp(34))).ok
    result = Engine(n.host, Journal(n.host, "rdma-a")).revert()
    assert result.ok, result.errors
    assert n.kernel.dscp_prio["ens1f0"] == {(34, 1)}, "not the pre-agent APP table"


def test_a_journal_with_one_step_for_all_entries_is_read_per_entry(node) -> None:  # type: ignore[no-untyped-def]
    """Journals of earlier agents hold one dcb-app step with every entry: an upgrade
    must neither undo the entries the new steps set nor lose the originals."""
    n = node(mellanox_node)
    n.kernel.dscp_prio["ens1f0"] = {(26, 3), (48, 6)}  # set by an earlier agent
    legacy = {
        "kind": "dcb-app",
        "id": "dcb-app:ens1f0",
        "params": {"device": "ens1f0", "entries": [[26, 3], [48, 6]]},
        "snapshot": [[48, 0]],
    }
    n.host.write_atomic(
        "/run/metaroce/agent/rdma-a/journal.json", json.dumps({"version": 1, "entries": [legacy]})
    )
    engine = Engine(n.host, Journal(n.host, "rdma-a"))
    assert engine.apply(plan_for(n, cfg_dscp(26))).ok
    assert n.kernel.dscp_prio["ens1f0"] == {(26, 3), (48, 6)}
    assert engine.revert().ok
    assert n.kernel.dscp_prio["ens1f0"] == {(48, 0)}
