"""Status aggregation: counts, conditions with actionable reasons, no churn, events."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from operator_testlib import network

from metaroce_api import MetaRoceNetworkStatus
from metaroce_api import constants as c
from metaroce_operator.observed import DaemonSetView, NodeReport, PeerResult
from metaroce_operator.probes import judge
from metaroce_operator.status import (
    CleanupView,
    Observed,
    compute_status,
    invalid_status,
    rollout_settled,
    same_status,
    transition_events,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DONE = DaemonSetView(
    generation=1, observed_generation=1, desired=3, current=3, updated=3, available=3, ready=3
)


def report(node: str, phase: str = "Ready", gen: int = 1, **kw: Any) -> NodeReport:
    return NodeReport(
        name=f"net.{node}",
        network="net",
        node=node,
        phase=phase,
        config_generation=gen,
        transport="rocev2",
        **kw,
    )


def observed(reports: list[NodeReport], ds: DaemonSetView | None = DONE, **kw: Any) -> Observed:
    net = kw.pop("net", None) or network()
    by_node = {r.node: r for r in reports}
    return Observed(
        network=net,
        applied_generation=kw.pop("applied", 1),
        config_generation=kw.pop("config_gen", 1),
        daemonset=ds,
        reports=by_node,
        verdicts=judge(by_node, net.spec.health.probe),
        **kw,
    )


def cond(status: MetaRoceNetworkStatus, ctype: str) -> tuple[str, str]:
    found = next(x for x in status.conditions or [] if x.type == ctype)
    return found.status, found.reason


def test_all_nodes_configured_is_ready() -> None:
    s = compute_status(observed([report("a"), report("b"), report("c")]), None, T0)
    assert s.observed_generation == 1
    assert s.nodes is not None
    assert (s.nodes.desired, s.nodes.configured, s.nodes.healthy, s.nodes.failed) == (3, 3, 3, 0)
    assert s.nodes.summary == "3/3"
    assert cond(s, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    assert cond(s, c.CONDITION_PROGRESSING) == ("False", c.REASON_RECONCILED)
    assert cond(s, c.CONDITION_DEGRADED) == ("False", c.REASON_AS_EXPECTED)
    assert s.transport is not None and s.transport.active == "rocev2"
    assert s.failing_nodes is None


def test_missing_reports_mean_waiting_for_nodes() -> None:
    s = compute_status(observed([report("a")]), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_WAITING_FOR_NODES)
    assert cond(s, c.CONDITION_PROGRESSING) == ("True", c.REASON_WAITING_FOR_NODES)


def test_reports_of_an_older_config_do_not_count() -> None:
    s = compute_status(observed([report("a"), report("b"), report("c", gen=0)]), None, T0)
    assert s.nodes is not None and s.nodes.configured == 2
    assert cond(s, c.CONDITION_READY)[0] == "False"


def test_desired_is_estimated_until_the_daemonset_controller_reports() -> None:
    fresh = DaemonSetView(generation=1)
    s = compute_status(observed([report("a")], ds=fresh, eligible=frozenset("abc")), None, T0)
    assert s.nodes is not None and s.nodes.summary == "1/3"
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_ROLLING_OUT)


def test_rollout_in_progress() -> None:
    rolling = replace(DONE, updated=1, available=2)
    s = compute_status(observed([], ds=rolling), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_ROLLING_OUT)
    assert cond(s, c.CONDITION_PROGRESSING) == ("True", c.REASON_ROLLING_OUT)
    s = compute_status(observed([], ds=None), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_ROLLING_OUT)


def test_no_matching_nodes() -> None:
    s = compute_status(observed([], ds=replace(DONE, desired=0, updated=0, available=0)), None, T0)
    status, reason = cond(s, c.CONDITION_READY)
    assert (status, reason) == ("False", c.REASON_NO_MATCHING_NODES)
    message = next(x for x in s.conditions or [] if x.type == c.CONDITION_READY).message
    assert "nodeSelector" in message


def test_failing_node_degrades_with_its_error() -> None:
    bad = report("b", phase="Failed", error="apply pfc on ens1f0: dcb: Operation not supported")
    s = compute_status(observed([report("a"), bad, report("c")]), None, T0)
    assert s.nodes is not None and (s.nodes.configured, s.nodes.failed) == (2, 1)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NODES_FAILED)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_NODES_FAILED)
    assert s.failing_nodes is not None
    (failing,) = s.failing_nodes
    assert failing.node == "b" and "Operation not supported" in failing.message
    degraded = next(x for x in s.conditions or [] if x.type == c.CONDITION_DEGRADED)
    assert "b: apply pfc on ens1f0" in degraded.message


def test_a_node_with_an_unfinished_rollback_or_revert_is_failed_not_configured() -> None:
    """Issue 15: an agent whose rollback (or revert) failed reports Degraded, as a node
    that runs its config with a problem does; the Ready condition's reason tells them
    apart, and the first never counts as configured, whatever generation it reports."""
    half = report(
        "b",
        phase="Degraded",
        ready_reason=c.NODESTATE_REASON_ROLLBACK_INCOMPLETE,
        error="apply roce-tos: failpoint; rollback incomplete (retrying)",
    )
    gone = report("c", phase="Degraded", gen=0, ready_reason=c.NODESTATE_REASON_REVERT_INCOMPLETE)
    s = compute_status(observed([report("a"), half, gone]), None, T0)
    assert s.nodes is not None
    assert (s.nodes.configured, s.nodes.healthy, s.nodes.failed) == (1, 1, 2)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NODES_FAILED)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_NODES_FAILED)
    assert s.failing_nodes is not None
    reasons = {f.node: f.reason for f in s.failing_nodes}
    assert reasons == {"b": "AgentRollbackIncomplete", "c": "AgentRevertIncomplete"}
    # both are final answers of the rollout; a Degraded node with another reason is
    # configured (and unhealthy) as before
    assert rollout_settled({r.node: r for r in (report("a"), half, gone)}, 1, 3, None)
    other = report("b", phase="Degraded", ready_reason=c.NODESTATE_REASON_DEGRADED)
    s = compute_status(observed([report("a"), other, report("c")]), None, T0)
    assert s.nodes is not None and (s.nodes.configured, s.nodes.failed) == (3, 0)


def test_failing_nodes_are_capped_at_ten() -> None:
    reports = [report(f"n{i:02}", phase="Failed", error="boom") for i in range(25)]
    ds = replace(DONE, desired=25, updated=25, available=25)
    s = compute_status(observed(reports, ds=ds), None, T0)
    assert s.nodes is not None and s.nodes.failed == 25
    assert s.failing_nodes is not None and len(s.failing_nodes) == 10


def test_probe_failures_judged_from_peers() -> None:
    # c is unreachable from a and b; c sees a and b failing too (it is the broken one).
    def peers(node: str, *bad: str) -> tuple[PeerResult, ...]:
        return tuple(PeerResult(p, p not in bad) for p in "abc" if p != node)

    reports = [
        report("a", peers=peers("a", "c")),
        report("b", peers=peers("b", "c")),
        report("c", peers=peers("c", "a", "b"), probe_healthy=False),
    ]
    s = compute_status(observed(reports), None, T0)
    assert s.nodes is not None and (s.nodes.configured, s.nodes.healthy) == (3, 2)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NODES_UNHEALTHY)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_NODES_UNHEALTHY)
    assert s.failing_nodes is not None and [f.node for f in s.failing_nodes] == ["c"]


def test_lossy_on_go_back_n_warns_but_stays_ready() -> None:
    net = network(transport={"mode": "softroce"}, qos={"profile": "lossy"})
    s = compute_status(observed([report("a"), report("b"), report("c")], net=net), None, T0)
    assert cond(s, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    status, reason = cond(s, c.CONDITION_DEGRADED)
    assert (status, reason) == ("True", c.REASON_LOSSY_ON_GO_BACK_N)
    message = next(x for x in s.conditions or [] if x.type == c.CONDITION_DEGRADED).message
    assert "0.21" in message and "metaroce" in message
    lossless = network(transport={"mode": "softroce"})
    s2 = compute_status(observed([report("a"), report("b"), report("c")], net=lossless), None, T0)
    assert cond(s2, c.CONDITION_DEGRADED)[0] == "False"


def test_lossy_on_auto_warns_once_nodes_report_go_back_n() -> None:
    net = network(qos={"profile": "lossy"})
    s = compute_status(observed([], net=net), None, T0)
    assert cond(s, c.CONDITION_DEGRADED)[0] == "False"
    s = compute_status(observed([report("a")], net=net), None, T0)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_LOSSY_ON_GO_BACK_N)


def test_conflict_and_cleanup_and_error() -> None:
    s = compute_status(
        observed([report("a")], conflicts=["network 'x' can select the same NICs"]), None, T0
    )
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NIC_CONFLICT)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_NIC_CONFLICT)
    view = CleanupView(pending=("b", "c"), timed_out=True, timeout_seconds=300)
    s = compute_status(observed([report("a")], cleanup=view), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_CLEANING_UP)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_CLEANUP_TIMED_OUT)
    degraded = next(x for x in s.conditions or [] if x.type == c.CONDITION_DEGRADED)
    assert "b, c" in degraded.message
    s = compute_status(
        observed([], error=(c.REASON_RENDER_FAILED, "namespace x missing")), None, T0
    )
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_RENDER_FAILED)


def test_same_observations_give_an_equal_status_and_keep_transition_times() -> None:
    obs = observed([report("a"), report("b"), report("c")])
    first = compute_status(obs, None, T0)
    later = compute_status(obs, first, T0 + timedelta(minutes=5))
    assert same_status(first, later)
    # Round trip through the API's JSON form (what the next event brings back).
    stored = MetaRoceNetworkStatus.model_validate(first.to_api())
    assert same_status(compute_status(obs, stored, T0 + timedelta(hours=1)), stored)
    # A change moves only the transition time of the condition that changed.
    worse = compute_status(observed([report("a"), report("b")]), first, T0 + timedelta(minutes=9))
    times = {x.type: x.last_transition_time for x in worse.conditions or []}
    assert times[c.CONDITION_READY] == T0 + timedelta(minutes=9)
    assert times[c.CONDITION_DEGRADED] == T0


def test_events_only_on_transitions() -> None:
    ready = compute_status(observed([report("a"), report("b"), report("c")]), None, T0)
    waiting = compute_status(observed([report("a")]), None, T0)
    assert [e.reason for e in transition_events(None, waiting)] == []
    assert [(e.type, e.reason) for e in transition_events(waiting, ready)] == [
        ("Normal", c.REASON_RECONCILED)
    ]
    assert transition_events(ready, ready) == []
    failed = compute_status(
        observed([report("a"), report("b", phase="Failed"), report("c")]), ready, T0
    )
    assert [(e.type, e.reason) for e in transition_events(ready, failed)] == [
        ("Warning", c.REASON_NODES_FAILED)
    ]
    assert [e.reason for e in transition_events(failed, ready)] == [
        c.REASON_RECONCILED,
        "Recovered",
    ]


def test_lossy_event_once_per_generation() -> None:
    net = network(transport={"mode": "rocev2"}, qos={"profile": "lossy"})
    first = compute_status(observed([report("a")], net=net), None, T0)
    events = transition_events(None, first)
    assert [e.reason for e in events] == [c.REASON_LOSSY_ON_GO_BACK_N]
    again = compute_status(observed([report("a"), report("b")], net=net), first, T0)
    assert transition_events(first, again) == []
    net2 = network(generation=2, transport={"mode": "rocev2"}, qos={"profile": "lossy"})
    bumped = compute_status(
        observed([report("a", gen=2)], net=net2, applied=2, config_gen=2), again, T0
    )
    assert c.REASON_LOSSY_ON_GO_BACK_N in [e.reason for e in transition_events(again, bumped)]


def test_invalid_status_names_the_problem() -> None:
    s = invalid_status(None, 4, c.REASON_INVALID_SPEC, "spec.qos.ecn: fix it", T0)
    assert s.observed_generation == 4
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_INVALID_SPEC)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_INVALID_SPEC)


def test_a_held_network_says_why_and_the_older_one_stays_ready() -> None:
    held = "rollout held: network 'x' can select the same NICs on 1 node(s) (a): ..."
    s = compute_status(observed([], ds=None, applied=None, held=[held]), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NIC_CONFLICT)
    assert cond(s, c.CONDITION_PROGRESSING) == ("False", c.REASON_NIC_CONFLICT)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_NIC_CONFLICT)
    ready = next(x for x in s.conditions or [] if x.type == c.CONDITION_READY)
    assert ready.message == held
    assert s.observed_generation == 1  # seen, and deliberately not rolled out
    yielded = "network 'y' can select ...: 'y' was created later: its rollout is held"
    s = compute_status(
        observed([report("a"), report("b"), report("c")], yielded=[yielded]), None, T0
    )
    assert cond(s, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_NIC_CONFLICT)


def test_rollout_settled_counts_final_answers_for_the_current_config() -> None:
    reports = {r.node: r for r in (report("a"), report("b", "Failed"), report("c", gen=0))}
    assert not rollout_settled(reports, 1, 3, None)
    reports["c"] = report("c")
    assert rollout_settled(reports, 1, 3, None)
    assert not rollout_settled(reports, 1, 3, frozenset({"a", "b"}))
    assert not rollout_settled(reports, 1, 4, None)
    assert not rollout_settled(reports, None, 3, None)


def test_ready_threshold_from_the_spec_issue_16_10() -> None:
    """One failed node out of any number made Ready False; spec.health.readyFraction
    sets how many must be healthy (default 1.0: every node, as before)."""
    bad = report("b", phase="Failed", error="apply pfc: EOPNOTSUPP")
    nodes = [report("a"), bad, report("c")]
    s = compute_status(observed(nodes), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NODES_FAILED)  # the default
    lenient = network(health={"readyFraction": 0.6})
    s = compute_status(observed(nodes, net=lenient), None, T0)
    assert cond(s, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    ready = next(x for x in s.conditions or [] if x.type == c.CONDITION_READY)
    assert "2 of 3" in ready.message and "readyFraction" in ready.message
    assert cond(s, c.CONDITION_DEGRADED) == ("True", c.REASON_NODES_FAILED)  # still said
    strict = network(health={"readyFraction": 0.9})
    s = compute_status(observed(nodes, net=strict), None, T0)
    assert cond(s, c.CONDITION_READY)[0] == "False"


def test_a_daemonset_edit_that_keeps_the_config_does_not_flap_ready() -> None:
    """A node that starts (or stops) holding off agent updates switches the DaemonSet to
    OnDelete (and back): a new DaemonSet generation with the same agent config. Until the
    DaemonSet controller observes it, the reports still prove every node configured:
    Ready stays True (it went False, RollingOut, for that moment)."""
    nodes = [report("a"), report("b"), report("c")]
    before = compute_status(observed(nodes, eligible=frozenset("abc")), None, T0)
    assert cond(before, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    edited = replace(DONE, generation=2)  # observed_generation still 1
    later = T0 + timedelta(seconds=5)
    s = compute_status(observed(nodes, ds=edited, eligible=frozenset("abc")), before, later)
    assert cond(s, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    ready = [x for x in s.conditions or [] if x.type == c.CONDITION_READY]
    assert ready == [x for x in before.conditions or [] if x.type == c.CONDITION_READY]
    assert transition_events(before, s) == []  # no Ready (or Degraded) Event
    # Not knowing which nodes are eligible, it cannot judge: rolling out, as before.
    s = compute_status(observed(nodes, ds=edited), before, later)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_ROLLING_OUT)
    # A new agent config is not proven by reports of the old one.
    s = compute_status(observed(nodes, ds=edited, eligible=frozenset("abc"), config_gen=2),
                       before, later)  # fmt: skip
    assert cond(s, c.CONDITION_READY)[0] == "False"


def test_a_node_holding_off_the_update_on_its_older_config_keeps_ready() -> None:
    """A node that holds off agent updates (a job runs there) still serves the network on
    its older config: Ready stays True, saying so; Progressing says the rollout waits; the
    node counts only count nodes on the current config."""
    rolling = DaemonSetView(
        generation=2, observed_generation=2, desired=3, current=3, updated=2, available=3, ready=3
    )
    nodes = [report("a", gen=2), report("b", gen=2), report("c", gen=1)]
    held = observed(nodes, ds=rolling, applied=2, config_gen=2, holding=frozenset({"c"}))
    s = compute_status(held, None, T0)
    assert cond(s, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    ready = next(x for x in s.conditions or [] if x.type == c.CONDITION_READY)
    assert "1 of them hold off the agent update" in ready.message
    assert cond(s, c.CONDITION_PROGRESSING)[0] == "True"
    assert s.nodes is not None and (s.nodes.configured, s.nodes.healthy) == (2, 2)
    # The same node not holding: it is simply not updated yet.
    s = compute_status(replace(held, holding=frozenset()), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_ROLLING_OUT)
    # A holding node that does not serve (its agent failed) does not count.
    failed = [*nodes[:2], report("c", phase="Failed", gen=1, error="apply: boom")]
    s = compute_status(replace(held, reports={r.node: r for r in failed}), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NODES_FAILED)


def test_a_paused_network_on_its_older_config_keeps_ready() -> None:
    """A pause holds every node (no agent is replaced): after a config change the nodes
    still serve the config their agents run, so Ready stays True, as for a node holding
    by label; Progressing says the rollout waits, and the node counts count only nodes on
    the current config. Unpaused, the same nodes are merely not updated yet."""
    paused_net = network(agent={"updateStrategy": {"paused": True}})
    on_delete = DaemonSetView(
        generation=2, observed_generation=2, desired=3, current=3, updated=0, available=3, ready=3
    )
    nodes = [report(n, gen=1) for n in "abc"]
    obs = observed(nodes, ds=on_delete, applied=2, config_gen=2, net=paused_net,
                   eligible=frozenset("abc"))  # fmt: skip
    s = compute_status(obs, None, T0)
    assert cond(s, c.CONDITION_READY) == ("True", c.REASON_RECONCILED)
    ready = next(x for x in s.conditions or [] if x.type == c.CONDITION_READY)
    assert "3 of them on an older config while agent updates are paused" in ready.message
    assert cond(s, c.CONDITION_PROGRESSING) == ("True", c.REASON_ROLLING_OUT)
    assert s.nodes is not None and (s.nodes.configured, s.nodes.healthy) == (0, 0)
    # A node whose agent failed does not serve, paused or not.
    failed = [*nodes[:2], report("c", phase="Failed", gen=1, error="apply: boom")]
    s = compute_status(replace(obs, reports={r.node: r for r in failed}), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_NODES_FAILED)
    # Not paused: the same reports are a rollout in progress.
    s = compute_status(replace(obs, network=network()), None, T0)
    assert cond(s, c.CONDITION_READY) == ("False", c.REASON_ROLLING_OUT)
