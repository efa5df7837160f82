"""Taint decisions: capped, churn-free, only our own taints removed."""

from __future__ import annotations

from metaroce_api import constants as c
from metaroce_operator.observed import NodeView
from metaroce_operator.taints import _taints_with, max_tainted, plan_taints


def nodes(tainted: dict[str, str] | None = None, count: int = 20) -> dict[str, NodeView]:
    tainted = tainted or {}
    out = {}
    for i in range(count):
        name = f"n{i:02}"
        taints: tuple[dict[str, str], ...] = ()
        if name in tainted:
            taints = (
                {"key": c.UNHEALTHY_TAINT_KEY, "value": tainted[name], "effect": "NoSchedule"},
            )
        out[name] = NodeView(name, taints=taints)
    return out


def test_cap_limits_new_taints() -> None:
    all_nodes = nodes()
    plan = plan_taints("net", "taint", 0.1, all_nodes, {"n03", "n01", "n07", "n09"}, all_nodes)
    assert plan.cap == 2
    assert plan.add == ("n01", "n03")
    assert plan.held_back == ("n07", "n09")
    assert "2 unhealthy node(s) were not tainted" in plan.note(0.1, 20)


def test_existing_taints_stay_while_unhealthy_and_go_when_healed() -> None:
    all_nodes = nodes({"n05": "net", "n06": "net"})
    plan = plan_taints("net", "taint", 0.1, all_nodes, {"n05", "n01"}, all_nodes)
    assert plan.remove == ("n06",)
    assert plan.add == ("n01",)  # n05 keeps its taint: no churn


def test_other_networks_taints_count_toward_the_cap_and_are_left_alone() -> None:
    all_nodes = nodes({"n00": "other", "n01": "other"})
    plan = plan_taints("net", "taint", 0.1, all_nodes, {"n00", "n02"}, all_nodes)
    assert plan.add == () and plan.remove == ()
    assert plan.held_back == ("n02",)


def test_action_condition_removes_our_taints_only() -> None:
    all_nodes = nodes({"n00": "net", "n01": "other"})
    plan = plan_taints("net", "condition", 0.5, all_nodes, {"n00", "n02"}, all_nodes)
    assert plan.add == () and plan.remove == ("n00",)


def test_lowered_cap_removes_excess() -> None:
    all_nodes = nodes({"n00": "net", "n01": "net", "n02": "net"})
    plan = plan_taints("net", "taint", 0.05, all_nodes, {"n00", "n01", "n02"}, all_nodes)
    assert plan.cap == 1
    assert plan.remove == ("n01", "n02")


def test_max_tainted_is_robust_to_float_error() -> None:
    assert max_tainted(0.29, 100) == 29
    assert max_tainted(0.1, 9) == 0
    assert max_tainted(1.0, 7) == 7


def test_taint_list_edit_keeps_foreign_taints() -> None:
    body = {"spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}}
    added = _taints_with(body, "net", True)
    assert {"key": c.UNHEALTHY_TAINT_KEY, "value": "net", "effect": "NoSchedule"} in added
    assert {"key": "gpu", "effect": "NoSchedule"} in added
    assert _taints_with({"spec": {"taints": added}}, "net", False) == [
        {"key": "gpu", "effect": "NoSchedule"}
    ]
    assert _taints_with({"spec": {"taints": added}}, "other", False) == added


def test_taints_of_networks_that_no_longer_exist_are_orphans() -> None:
    from metaroce_operator.taints import orphaned_taints

    all_nodes = nodes({"n01": "gone", "n02": "live", "n03": "gone"})
    assert orphaned_taints(all_nodes, {"live"}) == {"n01": "gone", "n03": "gone"}
    assert orphaned_taints(all_nodes, {"live", "gone"}) == {}


def test_a_deleted_network_s_taint_does_not_count_toward_another_s_cap() -> None:
    all_nodes = nodes({"n01": "gone"}, count=10)
    # cap = 10% of 10 = 1: the dead network's taint must not take the only slot
    plan = plan_taints("net", "taint", 0.1, all_nodes, {"n05"}, all_nodes, live={"net"})
    assert plan.add == ("n05",) and not plan.held_back
