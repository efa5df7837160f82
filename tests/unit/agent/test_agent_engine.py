"""The engine over fake nodes: apply + read-back, idempotency, drift, rollback, revert."""

from __future__ import annotations

from conftest import make_config
from fakes import mellanox_node, softroce_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.plan import make_plan

CM = "/sys/kernel/config/rdma_cm"


def softroce_cfg(**kw):  # type: ignore[no-untyped-def]
    transport = {"mode": "softroce", **kw.pop("transport", {})}
    return make_config(nics={"interfaceNames": ["eth0"]}, transport=transport, **kw)


def plan_for(n, cfg, **kw):  # type: ignore[no-untyped-def]
    inv = n.inventory()
    return make_plan(cfg, inv, n.caps(cfg, inv), **kw)


def test_softroce_apply_creates_rxe_marks_and_sets_configfs(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = softroce_cfg()
    plan = plan_for(n, cfg)
    engine = Engine(n.host, Journal(n.host, cfg.network))
    result = engine.apply(plan)
    assert result.ok, result.error
    assert n.host.exists("/sys/class/infiniband/rxe_eth0")
    assert n.host.read(f"{CM}/rxe_eth0/ports/1/default_roce_tos") == "104"
    assert n.host.read(f"{CM}/rxe_eth0/ports/1/default_roce_mode") == "RoCE v2"
    assert "rdma link add rxe_eth0 type rxe netdev eth0" in n.kernel.commands
    assert any(c.startswith("tc filter replace dev eth0 egress") for c in n.kernel.commands)
    assert all(v is None for v in engine.verify_all(plan).values())
    assert len(engine.journal) == len(plan.steps)

    # idempotent: a second pass (even by a new agent process) changes nothing
    n.kernel.calls.clear()
    again = Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg))
    assert again.ok and again.changed == 0
    assert n.kernel.mutating() == []


def test_mellanox_apply_drift_and_revert(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    ecn3 = "/sys/class/net/ens1f0/ecn/roce_np/enable/3"
    n.kernel.pfc["ens1f0"] = [False, False, False, False, True, False, False, False]
    cfg = make_config(nics={"interfaceNames": ["ens1f0"]})
    plan = plan_for(n, cfg)
    engine = Engine(n.host, Journal(n.host, cfg.network))
    assert engine.apply(plan).ok
    assert n.kernel.pfc["ens1f0"] == [False, False, False, True, False, False, False, False]
    assert n.kernel.dscp_prio["ens1f0"] == {(26, 3), (48, 6)}
    assert n.host.read(ecn3) == "1"
    assert n.host.read("/sys/class/net/ens1f0/ecn/roce_np/cnp_dscp") == "48"

    # someone changes two knobs by hand: the drift pass repairs both and counts them
    n.kernel.pfc["ens1f0"][3] = False
    n.host.write(ecn3, "0")
    drift = engine.drift(plan)
    assert sorted(s.knob for s, _ in drift.repaired) == ["ecn", "pfc"]
    assert drift.errors == [] and drift.checked == len(plan.steps)
    assert n.host.read(ecn3) == "1"
    assert engine.drift(plan).repaired == []

    # revert restores what was there before the agent (PFC on 4, ECN off, no APP entries)
    result = Engine(n.host, Journal(n.host, cfg.network)).revert()
    assert result.ok, result.errors
    assert n.kernel.pfc["ens1f0"] == [False, False, False, False, True, False, False, False]
    assert n.kernel.dscp_prio["ens1f0"] == set()
    assert n.host.read(ecn3) == "0"
    assert not n.host.exists(f"{CM}/mlx5_0")
    assert len(Journal(n.host, cfg.network)) == 0


def test_failed_step_rolls_back_the_steps_before_it(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = softroce_cfg()
    plan = plan_for(n, cfg)
    n.host.unwritable.add(f"{CM}/rxe_eth0/ports/1/default_roce_tos")
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan)
    assert not result.ok
    assert result.failed_step is not None and result.failed_step.kind == "roce-tos"
    assert "Permission denied" in result.error
    assert result.rolled_back[0] == "roce-tos port1 on rxe_eth0"
    assert "rxe-link on rxe_eth0" in result.rolled_back
    # nothing half-applied: the rxe link, the tc filter, the configfs dir are gone
    assert not n.host.exists("/sys/class/infiniband/rxe_eth0")
    assert not n.host.exists(f"{CM}/rxe_eth0")
    assert n.kernel.tc_filters.get(("eth0", "egress"), {}) == {}
    assert "clsact" not in n.kernel.qdiscs["eth0"]
    assert len(Journal(n.host, cfg.network)) == 0


def test_failed_command_names_the_step(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = softroce_cfg()
    n.kernel.fail["tc filter replace"] = (2, "Error: TC classifier not found.")
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg))
    assert not result.ok and result.failed_step is not None
    assert result.failed_step.name == "dscp-mark on eth0"
    assert "TC classifier not found" in result.error
    assert not n.host.exists("/sys/class/infiniband/rxe_eth0")


def test_revert_leaves_what_the_agent_did_not_create(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.kernel.run(["tc", "qdisc", "add", "dev", "eth0", "clsact"])  # shared, pre-existing
    cfg = softroce_cfg()
    engine = Engine(n.host, Journal(n.host, cfg.network))
    assert engine.apply(plan_for(n, cfg)).ok
    result = engine.revert()
    assert result.ok
    assert "clsact" in n.kernel.qdiscs["eth0"]  # not ours: stays
    assert n.kernel.tc_filters[("eth0", "egress")] == {}  # our filter: gone
    assert not n.host.exists("/sys/class/infiniband/rxe_eth0")
    assert n.host.exists("/sys/module/rdma_rxe")  # modules are never unloaded


def test_revert_keeps_an_rxe_link_in_use_and_an_adopted_one(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.netdev("eth1", virtio=True, ipv4=["192.168.78.11/24"])
    n.tree.module("rdma_rxe")
    n.tree.rdma("rxe0", netdev="eth1", software=True)  # made by someone else
    cfg = make_config(nics={"interfaceNames": ["eth0", "eth1"]}, transport={"mode": "softroce"})
    engine = Engine(n.host, Journal(n.host, cfg.network))
    assert engine.apply(plan_for(n, cfg)).ok
    uv = next(
        u
        for u in n.host.listdir("/sys/class/infiniband_verbs")
        if n.host.read_opt(f"/sys/class/infiniband_verbs/{u}/ibdev") == "rxe_eth0"
    )
    n.tree.process(4242, "ib_write_bw", [f"/dev/infiniband/{uv}"])
    result = engine.revert()
    assert [name for name, _ in result.errors] == ["rxe-link on rxe_eth0"]
    assert "held open by 4242 (ib_write_bw)" in result.errors[0][1]
    assert n.host.exists("/sys/class/infiniband/rxe_eth0")
    assert n.host.exists("/sys/class/infiniband/rxe0")  # adopted: never deleted
    assert len(Journal(n.host, cfg.network)) == 1  # the failed undo stays journaled


def test_changed_config_keeps_the_original_snapshot(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = softroce_cfg()
    Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg))
    cfg2 = softroce_cfg(qos={"data": {"dscp": 34, "priority": 4}}, transport={"mtu": 1400})
    engine = Engine(n.host, Journal(n.host, cfg.network))
    assert engine.apply(plan_for(n, cfg2)).ok
    assert n.host.read(f"{CM}/rxe_eth0/ports/1/default_roce_tos") == "136"
    assert n.host.read("/sys/class/net/eth0/mtu") == "1400"
    assert engine.revert().ok
    assert n.host.read("/sys/class/net/eth0/mtu") == "1500"


def test_dropped_knob_is_undone_on_the_next_apply(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = softroce_cfg()
    engine = Engine(n.host, Journal(n.host, cfg.network))
    assert engine.apply(plan_for(n, cfg)).ok
    assert n.kernel.tc_filters[("eth0", "egress")]
    assert engine.apply(plan_for(n, cfg, skip_knobs={"dscp-mark"})).ok
    assert n.kernel.tc_filters.get(("eth0", "egress"), {}) == {}
    assert n.host.exists("/sys/class/infiniband/rxe_eth0")


def test_blocked_plan_applies_nothing(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = softroce_cfg(qos={"onUnsupported": "error"})
    n.kernel.calls.clear()
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg))
    assert not result.ok and "onUnsupported is error" in result.error
    assert n.kernel.mutating() == []
