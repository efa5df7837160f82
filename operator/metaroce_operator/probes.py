"""Which nodes fail their RDMA probes, judged from the probe results of ALL nodes.

A single node's verdict on itself cannot tell "my peers are broken" from "I am broken",
and one bad node makes every node that probes it see failures. So a node is judged by
what its peers saw of it: unhealthy when more than half of the distinct peers that probed
it (two or more) report failure. With fewer observers the node's own verdict decides.
Result: one bad node is blamed alone; its probing partners stay healthy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from metaroce_api import ProbeSpec
from metaroce_operator.observed import NodeReport

MIN_OBSERVERS = 2


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    reason: str = ""


def judge(reports: Mapping[str, NodeReport], probe: ProbeSpec) -> dict[str, Verdict]:
    """Verdicts for every node in `reports` (keyed by node name)."""
    if not probe.enabled:
        return {node: Verdict(True) for node in reports}
    seen_by: dict[str, dict[str, bool]] = defaultdict(dict)
    for node, report in reports.items():
        for result in report.peers:
            if result.peer != node and result.peer in reports:
                seen_by[result.peer][node] = result.failed(probe)
    verdicts: dict[str, Verdict] = {}
    for node, report in reports.items():
        observers = seen_by.get(node, {})
        failing = sorted(o for o, failed in observers.items() if failed)
        if len(observers) >= MIN_OBSERVERS:
            if 2 * len(failing) > len(observers):
                verdicts[node] = Verdict(
                    False,
                    f"{len(failing)} of {len(observers)} peers probing it fail "
                    f"({', '.join(failing[:3])}{', ...' if len(failing) > 3 else ''})",
                )
            else:
                verdicts[node] = Verdict(True)
        elif report.probe_healthy is False:
            verdicts[node] = Verdict(False, "its own probes fail and too few peers probe it")
        else:
            verdicts[node] = Verdict(True)
    return verdicts
