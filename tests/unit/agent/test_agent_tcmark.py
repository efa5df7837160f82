"""The agent's egress marking filters (RoCEv2's port 4791 and the MetaRoCE port range)
are one step class parametrized by pref and port match (`EgressMarkStep`): both keep the
same contract over the fake tc, checked here side by side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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
    "metaroce-dst-ipv6": TcPortRangeMarkStep(
        "eth0", match="dst", first=21000, last=21999, dscp=26, family="ipv6"
    ),
    "metaroce-src-ipv6": TcPortRangeMarkStep(
        "eth0", match="src", first=21000, last=21999, dscp=26, family="ipv6"
    ),
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
    shift = 20 if getattr(step, "family", "ipv4") == "ipv6" else 16
    entry["options"]["actions"][0]["keys"][0]["val"] = f"{0x88 << shift:x}"  # DSCP 34 by hand
    skbedit = next(a for a in entry["options"]["actions"] if a["kind"] == "skbedit")
    skbedit["priority"] = ":5"
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


def test_the_metaroce_range_is_marked_for_ipv6_endpoints_too(node: Callable[..., Node]) -> None:
    """The port-range filters were IPv4 only (`protocol ip`): an endpoint on an IPv6
    address sent unmarked packets. IPv6 has prefs of its own (a pref holds filters of
    one protocol), its own step ids, and rewrites the traffic class (no checksum)."""
    n = node(softroce_node)
    ClsactStep("eth0").apply(n.host)
    v4 = [STEPS["metaroce-dst"], STEPS["metaroce-src"]]
    v6 = [STEPS["metaroce-dst-ipv6"], STEPS["metaroce-src-ipv6"]]
    assert len({s.id for s in v4 + v6}) == 4 and len({s.pref for s in v4 + v6}) == 4
    assert [s.id for s in v4] == ["tc-mark-ports:eth0:dst", "tc-mark-ports:eth0:src"]
    for s in v4 + v6:
        s.apply(n.host)
    assert all(s.verify(n.host) is None for s in v4 + v6)
    table = n.kernel.tc_filters[("eth0", "egress")]
    assert {table[s.pref]["protocol"] for s in v6} == {"ipv6"}
    assert " ".join(v6[1].command()) == (
        "tc filter replace dev eth0 egress protocol ipv6 pref 4795 handle 0x4d52 flower "
        "ip_proto udp src_port 21000-21999 action pedit ex munge ip6 traffic_class set 0x68 "
        "retain 0xfc pipe action skbedit priority 3"
    )
    # read back from the IPv6 pedit key (traffic class at bits 20-27)
    entry: dict[str, Any] = table[v6[0].pref]
    assert entry["options"]["actions"][0]["keys"][0]["val"] == f"{0x68 << 20:x}"
    entry["options"]["actions"][0]["keys"][0]["val"] = f"{0x88 << 20:x}"
    assert "sets tos 0x88, want 0x68" in (v6[0].verify(n.host) or "")
    # an IPv4 filter of ours at an IPv6 pref is not taken for the IPv6 one
    entry["protocol"] = "ip"
    assert "matches protocol ip, want ipv6" in (v6[0].verify(n.host) or "")
    # undo removes only its own filter
    v6[1].undo(n.host, None)
    assert v6[1].pref not in table and all(s.verify(n.host) is None for s in v4)


GUEST_FILTERS = (Path(__file__).parent / "guest_tc_filters.json").read_text()
"""`tc -j filter show dev eth0 egress` on a SoftRoCE guest (Debian 12, kernel 6.1.0-57,
iproute2 6.1.0) after the four MetaRoCE port-range commands, 2026-12-02."""


class _Shows:
    """A runner that answers `tc -j filter show` with what a guest printed."""

    def run(self, argv: Any, *, check: bool = True, timeout: float = 60.0) -> Any:
        from metaroce_agent.host import CommandResult

        return CommandResult(tuple(argv), 0, GUEST_FILTERS)


def test_the_four_port_range_filters_verify_against_a_real_kernel(tmp_path: Any) -> None:
    from fakes import FixtureHost

    host = FixtureHost(tmp_path, runner=_Shows())  # type: ignore[arg-type]
    steps = [
        TcPortRangeMarkStep("eth0", match=m, first=21000, last=21999, dscp=26, family=f)
        for f in ("ipv4", "ipv6")
        for m in ("dst", "src")
    ]
    assert [s.verify(host) for s in steps] == [None] * 4
    wrong = TcPortRangeMarkStep("eth0", match="dst", first=21000, last=21999, dscp=34)
    assert "sets tos 0x68, want 0x88" in (wrong.verify(host) or "")
