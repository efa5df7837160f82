"""Reading NodeState and DaemonSet bodies; the cleanup wait."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from metaroce_api import constants as c
from metaroce_api.examples import minimal_nodestate
from metaroce_operator.cleanup import cleanup_view, seconds_left, wants_finalizer
from metaroce_operator.observed import DaemonSetView, NodeReport

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_nodestate_report() -> None:
    body = minimal_nodestate("net", "node-a")
    body["metadata"].update({"uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"})
    body["status"] = {
        "phase": "Failed",
        "configGeneration": 4,
        "errors": [
            {"step": "discover", "message": "old"},
            {"step": "apply pfc", "message": "EOPNOTSUPP"},
        ],
        "probe": {"healthy": False, "peers": [{"node": "node-b", "reachable": False}]},
        "transport": {"mode": "softroce", "ready": True},
        "inventory": [{"netdev": "eth1"}],
        "reverted": True,
    }
    report = NodeReport.from_body(body)
    assert report is not None
    assert (report.network, report.node, report.phase, report.config_generation) == (
        "net",
        "node-a",
        "Failed",
        4,
    )
    assert report.error == "apply pfc: EOPNOTSUPP"
    assert report.probe_healthy is False and report.peers[0].peer == "node-b"
    assert report.transport == "softroce" and report.netdevs == ("eth1",) and report.reverted
    assert report.created == T0


def test_nodestate_report_carries_the_ready_reason() -> None:
    """What tells an unfinished rollback from a node Degraded but configured."""
    body = minimal_nodestate("net", "node-a")
    body["status"] = {
        "phase": "Degraded",
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": c.NODESTATE_REASON_ROLLBACK_INCOMPLETE,
                "message": "rollback incomplete (retrying with backoff): ...",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    report = NodeReport.from_body(body)
    assert report is not None and report.ready_reason == c.NODESTATE_REASON_ROLLBACK_INCOMPLETE
    body["status"] = {"phase": "Ready"}
    report = NodeReport.from_body(body)
    assert report is not None and report.ready_reason == ""


def test_a_failing_node_is_named_by_what_failed_not_by_the_retry_note() -> None:
    """An agent lists the failure first and the note of its next attempt last; the
    operator's failingNodes message is the newest error that says what failed (here the
    knob a rollback left), not when the agent tries again."""
    body = minimal_nodestate("net", "node-a")
    body["status"] = {
        "phase": "Degraded",
        "errors": [
            {
                "step": "apply roce-tos port1 on rxe_eth0",
                "message": "failpoint; rollback incomplete (retrying): dscp-mark on eth0 left off",
            },
            {"step": "rollback", "message": "restore dscp-mark on eth0: tc: busy"},
            {"step": c.NODESTATE_ERROR_STEP_RETRY, "message": "attempt 1 failed; next in 5 s"},
        ],
    }
    report = NodeReport.from_body(body)
    assert report is not None
    assert report.error == "rollback: restore dscp-mark on eth0: tc: busy"
    body["status"]["errors"] = body["status"]["errors"][-1:]
    report = NodeReport.from_body(body)
    assert report is not None and report.error == ""


def test_unparseable_status_counts_as_failed_report() -> None:
    body = minimal_nodestate("net", "node-a")
    body["status"] = {"phase": "Exploded"}
    report = NodeReport.from_body(body)
    assert report is not None and report.phase == "Failed" and "does not parse" in report.error
    assert NodeReport.from_body({"metadata": {"name": "x"}}) is None


def test_daemonset_view() -> None:
    body: dict[str, Any] = {
        "metadata": {"generation": 2},
        "spec": {"template": {"metadata": {"annotations": {c.CONFIG_HASH_ANNOTATION: "h"}}}},
        "status": {
            "observedGeneration": 2,
            "desiredNumberScheduled": 3,
            "updatedNumberScheduled": 3,
            "numberAvailable": 3,
        },
    }
    view = DaemonSetView.from_body(body, c.CONFIG_HASH_ANNOTATION)
    assert view.observed_current and view.rolled_out and view.template_hash == "h"
    body["status"]["observedGeneration"] = 1
    assert not DaemonSetView.from_body(body, c.CONFIG_HASH_ANNOTATION).rolled_out


def test_cleanup_waits_for_existing_nodes_until_the_timeout() -> None:
    body = {
        "metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"cleanupOnDelete": True},
    }
    reports = {
        "a": NodeReport(name="n.a", network="n", node="a", reverted=True),
        "b": NodeReport(name="n.b", network="n", node="b"),
        "gone": NodeReport(name="n.gone", network="n", node="gone"),
    }
    view = cleanup_view(body, reports, {"a", "b"}, T0 + timedelta(seconds=10), 60)
    assert view.pending == ("b",) and not view.timed_out
    assert seconds_left(body, T0 + timedelta(seconds=10), 60) == 50
    view = cleanup_view(body, reports, {"a", "b"}, T0 + timedelta(seconds=61), 60)
    assert view.timed_out
    assert not wants_finalizer(body)
    assert wants_finalizer({"metadata": {}, "spec": {"cleanupOnDelete": True}})
