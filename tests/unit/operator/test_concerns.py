"""The leader's decisions, one concern at a time, without a cluster (issue 16, structure):
which child event calls for a re-apply, when a rollout's last report came in, which held
network may resume, which NodeStates and anchors are orphans, what a deleting network's
finalizer waits for, which nodes are sick, when a revert timed out, what a failed apply
shows, and the upgrade policy's next step. The controller only does the I/O for them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from operator_testlib import network, network_body

from metaroce_api import constants as c
from metaroce_operator import cleanup, upgrade
from metaroce_operator.apply import ApplyFailed, failure_status
from metaroce_operator.conflicts import Conflict
from metaroce_operator.kube import ApiError
from metaroce_operator.observed import NodeView
from metaroce_operator.probes import Verdict
from metaroce_operator.render.common import child_name
from metaroce_operator.state import Applied, NotSynced, Store, sick_nodes

NS = "metaroce-system"
NOW = datetime(2026, 12, 3, 4, 0, tzinfo=UTC)


def stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def nodestate(
    network: str, node: str, created: datetime = NOW - timedelta(hours=1), **status: Any
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{network}.{node}",
            "uid": f"uid-{network}-{node}",
            "creationTimestamp": stamp(created),
        },
        "spec": {"node": node, "network": network},
        "status": {"phase": "Ready", "configGeneration": 1, **status},
    }


def child(kind: str, network: str, namespace: str | None = NS, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": child_name(network), "labels": {c.NETWORK_LABEL: network}}
    if namespace is not None:
        meta["namespace"] = namespace
    return {"kind": kind, "metadata": meta, **extra}


def daemonset(network: str, digest: str, **status: Any) -> dict[str, Any]:
    template = {"metadata": {"annotations": {c.CONFIG_HASH_ANNOTATION: digest}}, "spec": {}}
    return child("DaemonSet", network, spec={"template": template}, status=status)


def listed_store(*reports: dict[str, Any]) -> Store:
    store = Store()
    for body in reports:
        store.reports.on_event(None, body)
    store.reports.listed.set()
    return store


# --- children: drift and deletion ---------------------------------------------------------


def test_a_deleted_or_rehashed_daemonset_is_reapplied_and_others_are_not_ours() -> None:
    children = Store().children
    children.applied["net"] = Applied(1, 1, "h1")
    event = children.on_daemonset("MODIFIED", daemonset("net", "h1"), NS)
    assert (event.network, event.reapply, event.status) == ("net", "", True)
    assert children.daemonsets["net"].template_hash == "h1"
    event = children.on_daemonset("MODIFIED", daemonset("net", "edited"), NS)
    assert event.reapply == "its DaemonSet's config hash was changed"
    event = children.on_daemonset("DELETED", daemonset("net", "h1"), NS)
    assert event.reapply == "its DaemonSet was deleted" and "net" not in children.daemonsets
    # another namespace, another name, no label: not the operator's
    assert children.on_daemonset("MODIFIED", daemonset("net", "h1"), "other").network is None
    renamed = daemonset("net", "h1")
    renamed["metadata"]["name"] = "someone-else"
    assert children.on_daemonset("DELETED", renamed, NS).network is None


def test_a_daemonset_edited_on_an_owned_field_is_reapplied() -> None:
    children = Store().children
    children.applied["net"] = Applied(1, 1, "h1")
    rendered = daemonset("net", "h1")
    rendered["spec"]["template"]["spec"] = {"containers": [{"name": "agent", "image": "a:1"}]}
    children.rendered["net"] = {"DaemonSet": rendered}
    edited = daemonset("net", "h1")
    edited["spec"]["template"]["spec"] = {"containers": [{"name": "agent", "image": "evil:1"}]}
    event = children.on_daemonset("MODIFIED", edited, NS)
    assert event.reapply.startswith("its DaemonSet was edited (") and "image" in event.reapply
    # not applied in this term: nothing to judge against (the reconcile will apply)
    assert Store().children.on_daemonset("MODIFIED", edited, NS).reapply == ""


def test_configmaps_and_rbac_edited_or_deleted_are_reapplied() -> None:
    children = Store().children
    children.applied["net"] = Applied(1, 1, "h1")
    ok = child("ConfigMap", "net")
    ok["metadata"]["annotations"] = {c.CONFIG_HASH_ANNOTATION: "h1"}
    assert children.on_child("ConfigMap", "MODIFIED", ok, NS).reapply == ""
    ok["metadata"]["annotations"] = {c.CONFIG_HASH_ANNOTATION: "changed"}
    assert children.on_child("ConfigMap", "MODIFIED", ok, NS).reapply == (
        "its ConfigMap was changed"
    )
    sa = child("ServiceAccount", "net")
    assert children.on_child("ServiceAccount", "DELETED", sa, NS).reapply == (
        "its ServiceAccount was deleted"
    )
    assert children.on_child("ServiceAccount", "MODIFIED", sa, NS).reapply == ""
    role = child("ClusterRole", "net", namespace=None, rules=[{"verbs": ["get"]}])
    children.rendered["net"] = {"ClusterRole": role}
    wider = child("ClusterRole", "net", namespace=None, rules=[{"verbs": ["*"]}])
    event = children.on_child("ClusterRole", "MODIFIED", wider, NS)
    assert event.reapply.startswith("its ClusterRole was edited") and not event.status
    assert children.on_child("ClusterRole", "MODIFIED", role, NS).reapply == ""
    # a namespaced child elsewhere is not the operator's
    assert children.on_child("ServiceAccount", "DELETED", child("x", "net", "default"), NS) == (
        type(event)()
    )


# --- status: the last report of a rollout ------------------------------------------------


def test_the_last_report_of_a_rollout_is_urgent_once() -> None:
    store = listed_store(nodestate("net", "a"))
    assert not store.completes_rollout("net")  # not applied in this term
    store.children.applied["net"] = Applied(1, 1, "h1")
    store.nodes.eligible["net"] = frozenset({"a", "b"})
    assert not store.completes_rollout("net")  # b has not reported
    store.reports.on_event("ADDED", nodestate("net", "b", phase="Failed"))
    assert store.completes_rollout("net")  # configured or failed: every answer is in
    store.wrote_status({"metadata": {"name": "net"}, "status": {"nodes": {"configured": 2}}})
    assert not store.completes_rollout("net")  # the status shows it already
    store.conflicts.held["net"] = ("held",)
    assert not store.completes_rollout("net")


def test_reports_are_gated_in_every_decision_that_reads_them() -> None:
    store = Store()
    store.reports.on_event(None, nodestate("net", "a"))
    store.children.applied["net"] = Applied(1, 1, "h1")
    store.nodes.eligible["net"] = frozenset({"a"})
    assert not store.completes_rollout("net")  # before the first list: the loop waits
    with pytest.raises(NotSynced):
        store.reports.orphans({}, set(), NOW, 0)
    with pytest.raises(NotSynced):
        store.observed("net", network())


def test_observed_gathers_every_concern() -> None:
    store = listed_store(nodestate("net", "a"))
    store.children.applied["net"] = Applied(3, 2, "h")
    store.conflicts.blocking["net"] = ("b",)
    store.conflicts.yielded["net"] = ("y",)
    store.taints.notes["net"] = "capped"
    obs = store.observed("net", network(), ("Reason", "msg"))
    assert (obs.applied_generation, obs.config_generation) == (3, 2)
    assert set(obs.reports) == {"a"} and obs.verdicts["a"].healthy
    assert (obs.conflicts, obs.yielded, obs.taint_note) == (("b",), ("y",), "capped")
    assert obs.error == ("Reason", "msg") and obs.cleanup is None


# --- nodes and garbage ---------------------------------------------------------------------


def test_eligible_nodes_are_the_linux_nodes_the_selector_matches() -> None:
    store = Store()
    with pytest.raises(NotSynced):
        store.nodes.select("net", network().spec.node_selector)
    linux = {"kubernetes.io/os": "linux"}
    store.nodes.listed(
        [
            NodeView("a", {**linux, "rdma": "yes"}),
            NodeView("b", {**linux}),
            NodeView("w", {"kubernetes.io/os": "windows", "rdma": "yes"}),
        ]
    )
    selector = network(nodeSelector={"matchLabels": {"rdma": "yes"}}).spec.node_selector
    assert store.nodes.select("net", selector)
    assert store.nodes.eligible["net"] == {"a"}
    assert not store.nodes.select("net", selector)  # unchanged: no status recomputed


def test_nodestates_of_gone_nodes_and_networks_are_orphans_after_a_grace() -> None:
    store = listed_store(
        nodestate("live", "a"),
        nodestate("live", "gone-node"),
        nodestate("gone-net", "a"),
        nodestate("gone-net", "b", created=NOW - timedelta(seconds=5)),  # too new to judge
    )
    nodes = {"a": object(), "b": object()}
    found = {(r.name, why) for r, why in store.reports.orphans(nodes, {"live"}, NOW, 60)}
    assert found == {("live.gone-node", "node"), ("gone-net.a", "network")}


def test_anchor_roles_of_gone_networks_are_orphans_unless_a_network_owns_them() -> None:
    def role(network: str, age: float, owner: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": child_name(network),
            "uid": f"uid-{network}",
            "labels": {c.NETWORK_LABEL: network},
            "creationTimestamp": stamp(NOW - timedelta(seconds=age)),
        }
        if owner:
            meta["ownerReferences"] = [{"kind": owner}]
        return {"metadata": meta}

    roles = [role("live", 600), role("gone", 600), role("new", 1), role("owned", 600, "X")]
    roles[3]["metadata"]["ownerReferences"] = [{"kind": c.NETWORK_KIND}]
    found = cleanup.orphaned_anchors(roles, {"live"}, NOW, 30)
    assert found == [(child_name("gone"), "uid-gone", "gone")]


# --- conflicts -----------------------------------------------------------------------------


def conflict(network: str, other: str) -> Conflict:
    return Conflict(network, other, ("n1",), "both select eth1", observed=True)


ORDER = {"old": ("2026-01-01", "old"), "new": ("2026-02-01", "new")}


def test_a_conflict_with_an_older_network_holds_and_a_held_newer_one_is_yielded() -> None:
    conflicts = Store().conflicts
    assert conflicts.hold("new", [conflict("new", "old")]) is not None
    assert conflicts.hold("new", [conflict("new", "old")]) is None  # same: not logged again
    found = {"new": [conflict("new", "old")], "old": [conflict("old", "new")]}
    verdict = conflicts.judge(["old", "new"], found, ORDER)
    assert verdict.resume == [] and verdict.new_blocking == []
    assert verdict.changed == {"old"}
    assert conflicts.yielded["old"] and not conflicts.blocking.get("old")
    # the conflict goes: the held network resumes
    verdict = conflicts.judge(["old", "new"], {}, ORDER)
    assert verdict.resume == ["new"] and verdict.changed == {"old"}


def test_a_conflict_arising_after_both_rolled_out_blocks_ready() -> None:
    conflicts = Store().conflicts
    found = {"new": [conflict("new", "old")], "old": [conflict("old", "new")]}
    verdict = conflicts.judge(["old", "new"], found, ORDER)
    assert verdict.changed == {"old", "new"} and {n for n, _ in verdict.new_blocking} == {
        "old",
        "new",
    }
    assert conflicts.judge(["old", "new"], found, ORDER).changed == set()  # logged once


# --- cleanup -------------------------------------------------------------------------------


def deleting(finalizer: bool = True, since: float = 10) -> dict[str, Any]:
    body = network_body("net", cleanupOnDelete=True)
    body["metadata"]["deletionTimestamp"] = stamp(NOW - timedelta(seconds=since))
    body["metadata"]["finalizers"] = [c.CLEANUP_FINALIZER] if finalizer else []
    return body


def test_the_finalizer_waits_for_every_existing_node_then_times_out() -> None:
    store = listed_store(nodestate("net", "a"), nodestate("net", "b", reverted=True))
    reports = store.reports.of("net")
    assert cleanup.decide(deleting(finalizer=False), reports, {"a", "b"}, NOW, 60) is None
    waiting = cleanup.decide(deleting(), reports, {"a", "b"}, NOW, 60)
    assert waiting is not None and waiting.view.pending == ("a",)
    assert not waiting.release and waiting.shows and waiting.recheck_in == 50
    gone = cleanup.decide(deleting(), reports, {"b"}, NOW, 60)  # node a no longer exists
    assert gone is not None and gone.release and not gone.shows
    late = cleanup.decide(deleting(since=61), reports, {"a", "b"}, NOW, 60)
    assert late is not None and late.release and late.view.timed_out and late.shows
    assert late.recheck_in is None


# --- taints, labels, upgrades, apply failures ------------------------------------------


def test_sick_nodes_are_configured_nodes_with_failing_probes() -> None:
    store = listed_store(
        nodestate("net", "ok"), nodestate("net", "sick"), nodestate("net", "new", phase="Pending")
    )
    verdicts = {n: Verdict(n == "ok") for n in ("ok", "sick", "new")}
    sick = sick_nodes(store.reports.of("net"), verdicts)
    assert sick == {"sick"}
    taints = store.taints
    assert not taints.track("net", "condition", sick)  # a network that never taints
    assert taints.track("net", "taint", sick) and not taints.track("net", "taint", sick)
    assert taints.track("net", "condition", frozenset())  # switched off: cleared once


def test_a_revert_asked_too_long_ago_times_out() -> None:
    labels = Store().labels
    labels.labelled("net", "a", c.NODE_REVERT, 100.0)
    labels.labelled("net", "a", c.NODE_REVERT, 150.0)  # asked again: the first time counts
    labels.labelled("net", "b", c.NODE_REVERT, 180.0)
    assert labels.timed_out("net", 201.0, 100) == {"a"}
    labels.labelled("net", "a", c.NODE_SELECTED, 202.0)  # back in the network
    assert labels.timed_out("net", 1000.0, 100) == {"b"}
    assert labels.timed_out("other", 1000.0, 100) == frozenset()


def test_the_upgrade_policy_reapplies_when_a_hold_comes_or_goes_and_replaces_while_held() -> None:
    assert upgrade.next_step(frozenset({"a"}), False, False) == "reapply"
    assert upgrade.next_step(frozenset(), True, False) == "reapply"
    assert upgrade.next_step(frozenset({"a"}), True, False) == "replace"
    assert upgrade.next_step(frozenset({"a"}), True, True) is None  # paused
    assert upgrade.next_step(frozenset({"a"}), None, False) is None  # not applied yet
    assert upgrade.next_step(frozenset(), False, False) is None


def test_a_failed_apply_says_what_to_fix_and_whether_retrying_helps() -> None:
    obj = {"kind": "DaemonSet", "metadata": {"name": "d", "namespace": "agents"}}

    def fail(status: int) -> ApplyFailed:
        return ApplyFailed(obj, ApiError("PATCH", "/apis/apps/v1", status, "nope"))

    missing = failure_status(fail(404))
    assert missing is not None and "'agents' does not exist" in missing[1] and not missing[2]
    assert failure_status(fail(422)) == (c.REASON_RENDER_FAILED, str(fail(422)), True)
    forbidden = failure_status(fail(403))
    assert forbidden is not None and not forbidden[2]  # RBAC may be being fixed
    assert failure_status(fail(500)) is None and failure_status(fail(409)) is None


def test_forgetting_a_network_also_forgets_what_the_decisions_kept() -> None:
    async def main() -> None:
        store = listed_store(nodestate("net", "a"))
        store.children.on_daemonset("ADDED", daemonset("net", "h"), NS)
        store.labels.labelled("net", "a", c.NODE_REVERT, 1.0)
        store.taints.track("net", "taint", frozenset({"a"}))
        store.conflicts.hold("net", [conflict("net", "old")])
        store.forget_network("net")
        assert not store.children.daemonsets and not store.labels.revert_asked
        assert not store.taints.unhealthy and not store.conflicts.held

    asyncio.run(main())


def test_a_status_is_computed_once_the_network_was_handled_in_this_term() -> None:
    store = listed_store(nodestate("net", "a"))
    body = network_body("net")
    assert store.next_status("net", body, NOW) is None  # a status from nothing would flap
    store.children.applied["net"] = Applied(1, 1, "h")
    first = store.next_status("net", body, NOW)
    assert first is not None and first.network is not None and first.previous is None
    assert {cond.type for cond in first.new.conditions or []} >= {c.CONDITION_READY}

    held = listed_store()
    held.conflicts.held["net"] = ("held by old",)
    update = held.next_status("net", body, NOW)
    assert update is not None and update.network is not None  # held: shown, not applied

    bad = dict(body, spec={**body["spec"], "transport": {"mode": "carrier-pigeon"}})
    store.wrote_status({"metadata": {"name": "net"}, "status": first.new.to_api()})
    invalid = store.next_status("net", bad, NOW)
    assert invalid is not None and invalid.network is None and invalid.previous is not None
    ready = next(cond for cond in invalid.new.conditions or [] if cond.type == "Ready")
    assert (ready.status, ready.reason) == ("False", c.REASON_INVALID_SPEC)
