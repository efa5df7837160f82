"""The agents' upgrade policy (issue 16 #17): pause with OnDelete, nodes that hold off
updates by label with a deadline, the operator replacing the other nodes' agents
maxUnavailable at a time, all shown in status.

On b6733c0 (and until this fix) the DaemonSet is always RollingUpdate: a spec change
restarts the agent under a running job, and nothing can pause a rollout."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from operator_testlib import network, network_body

from metaroce_api import InvalidObject, validate_network
from metaroce_api import constants as c
from metaroce_operator import upgrade
from metaroce_operator.render import render_network
from metaroce_operator.settings import RenderSettings

NOW = datetime(2026, 12, 1, 18, 0, 0, tzinfo=UTC)
DAY = timedelta(hours=24)


def _strategy(settings: RenderSettings, holding: bool = False, **spec: Any) -> dict[str, Any]:
    objs = render_network(network("net", **spec), settings, nodes_holding=holding)
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    return dict(ds["spec"]["updateStrategy"])


def test_a_paused_network_s_agents_are_replaced_by_no_one_issue_16_17(
    settings: RenderSettings,
) -> None:
    assert _strategy(settings)["type"] == "RollingUpdate"
    paused = _strategy(settings, agent={"updateStrategy": {"paused": True}})
    assert paused == {"type": "OnDelete"}
    assert _strategy(settings, holding=True) == {"type": "OnDelete"}


def test_hold_labels_are_judged_against_the_deadline_and_max_hold_issue_16_17() -> None:
    soon = (NOW + timedelta(hours=2)).strftime(c.UPDATE_HOLD_FORMAT)
    past = (NOW - timedelta(minutes=1)).strftime(c.UPDATE_HOLD_FORMAT)
    far = (NOW + timedelta(hours=30)).strftime(c.UPDATE_HOLD_FORMAT)
    labels = {
        "a": {c.UPDATE_HOLD_LABEL: soon},
        "b": {c.UPDATE_HOLD_LABEL: past},
        "c": {c.UPDATE_HOLD_LABEL: far},
        "d": {c.UPDATE_HOLD_LABEL: "tonight"},
        "e": {},
        "other": {c.UPDATE_HOLD_LABEL: soon},  # not the network's node
    }
    holds = {h.node: h for h in upgrade.read_holds("abcde", labels, NOW, DAY)}
    assert set(holds) == {"a", "b", "c", "d"}
    assert holds["a"].state == "holding"
    assert holds["a"].until == NOW + timedelta(hours=2)
    assert holds["b"].state == "expired"
    assert holds["c"].state == "refused"
    assert "spec.agent.updateStrategy.maxHold (24h)" in holds["c"].message
    assert holds["d"].state == "refused"
    assert "tonight" in holds["d"].message and "YYYYMMDDTHHMMSSZ" in holds["d"].message
    assert upgrade.holding(holds.values()) == {"a"}
    assert upgrade.strategy(False, holds.values()) == "OnDelete"
    assert upgrade.strategy(False, [holds["b"], holds["c"]]) == "RollingUpdate"

    status = upgrade.update_status(False, tuple(holds.values()))
    assert status.strategy == "OnDelete" and status.holding == 1
    assert status.held_nodes is not None
    assert [h.node for h in status.held_nodes] == ["a", "c", "d", "b"]  # holding first
    assert status.held_nodes[0].until == "2026-12-01T20:00:00Z"


def _pod(node: str, revision: str, ready_for: float | None = 60) -> upgrade.AgentPod:
    since = None if ready_for is None else NOW - timedelta(seconds=ready_for)
    return upgrade.AgentPod(f"agent-{node}", node, revision, since)


def test_outdated_agents_off_held_nodes_are_replaced_within_budget_issue_16_17() -> None:
    nodes = ["n1", "n2", "n3", "n4"]
    pods = [_pod(n, "old") for n in nodes]
    held = frozenset({"n2"})
    assert upgrade.pods_to_replace(pods, "new", nodes, held, 1, NOW, 15) == ["agent-n1"]
    assert upgrade.pods_to_replace(pods, "new", nodes, held, 5, NOW, 15) == [
        "agent-n1",
        "agent-n3",
        "agent-n4",
    ]
    # n1 is being replaced (its new agent not available for minReadySeconds yet): no
    # budget left at maxUnavailable 1 ...
    replacing = [_pod("n1", "new", ready_for=5), *pods[1:]]
    assert upgrade.pods_to_replace(replacing, "new", nodes, held, 1, NOW, 15) == []
    # ... until it has been ready long enough.
    done = [_pod("n1", "new", ready_for=20), *pods[1:]]
    assert upgrade.pods_to_replace(done, "new", nodes, held, 1, NOW, 15) == ["agent-n3"]
    # A node without an agent at all counts as unavailable too.
    assert upgrade.pods_to_replace(pods[1:], "new", nodes, held, 1, NOW, 15) == []
    # The held node is never replaced.
    updated = [_pod(n, "new") for n in ("n1", "n3", "n4")] + [_pod("n2", "old")]
    assert upgrade.pods_to_replace(updated, "new", nodes, held, 4, NOW, 15) == []


def test_max_unavailable_percentages_round_up() -> None:
    assert upgrade.scaled_max_unavailable(2, 10) == 2
    assert upgrade.scaled_max_unavailable("10%", 15) == 2
    assert upgrade.scaled_max_unavailable("10%", 3) == 1


def test_the_current_revision_is_the_daemonset_s_newest() -> None:
    def rev(number: int, digest: str, owner: str = "ds-uid") -> dict[str, Any]:
        return {
            "revision": number,
            "metadata": {
                "labels": {upgrade.REVISION_LABEL: digest},
                "ownerReferences": [{"uid": owner}],
            },
        }

    revisions = [rev(1, "aaa"), rev(3, "ccc"), rev(2, "bbb"), rev(9, "zzz", owner="other")]
    assert upgrade.current_revision(revisions, "ds-uid") == "ccc"
    assert upgrade.current_revision([], "ds-uid") is None


def test_a_pod_is_read_from_its_body() -> None:
    body = {
        "metadata": {"name": "p", "labels": {upgrade.REVISION_LABEL: "h1"}},
        "spec": {"nodeName": "n1"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T17:59:00Z"}
            ]
        },
    }
    pod = upgrade.AgentPod.from_body(body)
    assert (pod.name, pod.node, pod.revision) == ("p", "n1", "h1")
    assert pod.available(NOW, 15) and not pod.available(NOW, 120)
    going = {**body, "metadata": {**body["metadata"], "deletionTimestamp": "x"}}
    assert not upgrade.AgentPod.from_body(going).available(NOW, 0)


@pytest.mark.parametrize("value", ["200h", "30s"])
def test_max_hold_is_validated_naming_field_value_and_fix(value: str) -> None:
    body = network_body("net", agent={"updateStrategy": {"maxHold": value}})
    with pytest.raises(InvalidObject) as err:
        validate_network(body)
    text = str(err.value)
    assert "spec.agent.updateStrategy.maxHold" in text
    assert "between 1m and 168h" in text and "24h" in text and repr(value) in text


def test_holds_and_a_pause_show_in_status_issue_16_17() -> None:
    from dataclasses import replace

    from metaroce_operator.observed import DaemonSetView
    from metaroce_operator.status import Observed, compute_status

    ds = DaemonSetView(
        generation=2, observed_generation=2, desired=3, current=3, updated=2, available=3, ready=3
    )
    soon = (NOW + timedelta(hours=1)).strftime(c.UPDATE_HOLD_FORMAT)
    holds = upgrade.read_holds(["a"], {"a": {c.UPDATE_HOLD_LABEL: soon}}, NOW, DAY)
    obs = Observed(
        network=network("net", generation=2),
        applied_generation=2,
        config_generation=2,
        daemonset=ds,
        agent_update=upgrade.update_status(False, holds),
    )
    status = compute_status(obs, None, NOW)
    assert status.agent_update is not None and status.agent_update.holding == 1
    progressing = next(x for x in status.conditions or [] if x.type == c.CONDITION_PROGRESSING)
    assert "1 node(s) hold off agent updates" in progressing.message
    paused = compute_status(replace(obs, agent_update=upgrade.update_status(True, ())), None, NOW)
    assert paused.agent_update is not None and paused.agent_update.paused
    progressing = next(x for x in paused.conditions or [] if x.type == c.CONDITION_PROGRESSING)
    assert "paused" in progressing.message
    # Nothing to show: no field (no status churn for networks that use neither).
    plain = compute_status(replace(obs, agent_update=upgrade.update_status(False, ())), None, NOW)
    assert plain.agent_update is None
