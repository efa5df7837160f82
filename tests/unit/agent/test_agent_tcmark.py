"""The agent's egress marking filters (RoCEv2's port 4791 and the MetaRoCE port range)
are one step class parametrized by pref and port match (`EgressMarkStep`): both keep the
same contract over the fake tc, checked here side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import Node
from fakes import softroce_node

from metaroce_agent.qos.tcmark import (
    FILTER_HANDLE,
    ClsactStep,
    EgressMarkStep,
    TcMarkStep,
    TcPortRangeMarkStep,
)
from metaroce_agent.steps import step_from_record

STEPS = {
    "rocev2": TcMarkStep("eth0", dscp=26, priority=3),
    "metaroce-dst": TcPortRangeMarkStep("eth0", match="dst", first=21000, last=21999, dscp=26),
    "metaroce-src": TcPortRangeMarkStep("eth0", match="src", first=21000, last=21999, dscp=26),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_apply_is_idempotent_verify_reads_back_undo_removes_only_its_filter(
    node: Callable[..., Node], name: str
) -> None:
    n = node(softroce_node)
    step = STEPS[name]
    ClsactStep("eth0").apply(n.host)
    assert f"marking filter (egress pref {step.pref}" in (step.verify(n.host) or "")
    step.apply(n.host)
    step.apply(n.host)
    table = n.kernel.tc_filters[("eth0", "egress")]
    assert list(table) == [step.pref]  # one filter, whatever the passes
    assert table[step.pref]["options"]["handle"] == FILTER_HANDLE  # type: ignore[index]
    assert step.verify(n.host) is None
    other = next(s for k, s in STEPS.items() if s.pref != step.pref)
    other.apply(n.host)
    step.undo(n.host, None)
    assert list(table) == [other.pref] and other.verify(n.host) is None


@pytest.mark.parametrize("name", list(STEPS))
def test_a_changed_marking_or_port_is_named(node: Callable[..., Node], name: str) -> None:
    n = node(softroce_node)
    step = STEPS[name]
    ClsactStep("eth0").apply(n.host)
    step.apply(n.host)
    entry: dict[str, Any] = n.kernel.tc_filters[("eth0", "egress")][step.pref]
    entry["options"]["actions"][0]["keys"][0]["val"] = f"{0x88 << 16:x}"  # DSCP 34 by hand
    entry["options"]["actions"][2]["priority"] = ":5"
    problem = step.verify(n.host) or ""
    assert step.what in problem and "sets tos 0x88, want 0x68" in problem, problem
    assert "sets priority 5, want 3" in problem
    step.apply(n.host)  # the drift pass repairs it
    assert step.verify(n.host) is None
    entry = n.kernel.tc_filters[("eth0", "egress")][step.pref]
    entry["options"]["keys"][step.port_key] = 4792
    assert "matches" in (step.verify(n.host) or "")


@pytest.mark.parametrize("name", list(STEPS))
def test_journal_records_rebuild_the_same_step(name: str) -> None:
    step = STEPS[name]
    again = step_from_record(step.record())
    assert again == step and type(again) is type(step) and again.id == step.id
    assert isinstance(again, EgressMarkStep)
    assert again.command() == step.command()


def test_the_commands_are_those_seen_working_on_the_guests() -> None:
    assert " ".join(STEPS["rocev2"].command()) == (
        "tc filter replace dev eth0 egress protocol ip pref 4791 handle 0x4d52 flower "
        "ip_proto udp dst_port 4791 action pedit ex munge ip dsfield set 0x68 retain 0xfc pipe "
        "action csum ip pipe action skbedit priority 3"
    )
    assert " ".join(STEPS["metaroce-src"].command()) == (
        "tc filter replace dev eth0 egress protocol ip pref 4793 handle 0x4d52 flower "
        "ip_proto udp src_port 21000-21999 action pedit ex munge ip dsfield set 0x68 "
        "retain 0xfc pipe action csum ip pipe action skbedit priority 3"
    )
