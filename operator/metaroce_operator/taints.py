"""Node taints for nodes whose RDMA probes fail (spec.health.action: taint).

Only the leader taints, from the verdicts over ALL nodes' probe results (see `probes`),
and never more than `health.maxTaintedFraction` of the network's nodes: a broken switch
port or one bad peer must not make a whole network unschedulable. The taint's value is
the network's name, so each network only removes the taints it set.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from metaroce_api import constants as c
from metaroce_api.failpoints import failpoint
from metaroce_operator.kube import KINDS, MERGE_PATCH, ApiError, Kube
from metaroce_operator.observed import NodeView

log = logging.getLogger("metaroce.operator.taints")
NODE = KINDS[("v1", "Node")]


def _our_taint(node: NodeView) -> Mapping[str, Any] | None:
    return next(
        (
            t
            for t in node.taints
            if t.get("key") == c.UNHEALTHY_TAINT_KEY and t.get("effect") == c.UNHEALTHY_TAINT_EFFECT
        ),
        None,
    )


@dataclass(frozen=True)
class TaintPlan:
    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    held_back: tuple[str, ...] = ()
    """Unhealthy nodes left untainted because of the cap."""
    cap: int = 0

    @property
    def empty(self) -> bool:
        return not self.add and not self.remove

    def note(self, fraction: float, members: int) -> str:
        """A status sentence about the cap, or '' when it held nothing back."""
        if not self.held_back:
            return ""
        return (
            f"{len(self.held_back)} unhealthy node(s) were not tainted: at most {self.cap} "
            f"(health.maxTaintedFraction {fraction:g} of {members} nodes) may be"
        )


def max_tainted(fraction: float, members: int) -> int:
    """floor(fraction x members), robust to float error (0.29 x 100 is 28.999...)."""
    return int(fraction * members + 1e-9)


def orphaned_taints(nodes: Mapping[str, NodeView], live: Collection[str]) -> dict[str, str]:
    """node -> network, for our taints whose network no longer exists (pure).

    A network's taints are only planned while it exists; once it is deleted they would
    keep the node unschedulable for every pod, so the node pass removes these."""
    out: dict[str, str] = {}
    for name, view in nodes.items():
        taint = _our_taint(view)
        if taint is not None and str(taint.get("value", "")) not in live:
            out[name] = str(taint.get("value", ""))
    return out


def plan_taints(
    network: str,
    action: str,
    fraction: float,
    members: Collection[str],
    unhealthy: Collection[str],
    nodes: Mapping[str, NodeView],
    *,
    live: Collection[str] | None = None,
) -> TaintPlan:
    """Which nodes to taint and untaint (pure).

    Nodes tainted by this network stay tainted while unhealthy (no churn); new ones are
    added in name order until the cap; taints of other networks count toward the cap,
    those of networks not in `live` (deleted ones, when given) do not.
    """
    member_set, sick = set(members), set(unhealthy) & set(members)
    ours: set[str] = set()
    others: set[str] = set()
    for name, view in nodes.items():
        taint = _our_taint(view)
        if taint is None:
            continue
        owner = taint.get("value")
        if owner == network:
            ours.add(name)
        elif live is None or owner in live:
            others.add(name)
    if action != "taint":
        return TaintPlan(remove=tuple(sorted(ours)))
    cap = max_tainted(fraction, len(member_set))
    keep = sorted(ours & sick)
    remove = sorted(ours - sick)
    tainted = len(keep) + len(others & member_set)
    while tainted > cap and keep:
        remove.append(keep.pop())
        tainted -= 1
    room = max(cap - tainted, 0)
    candidates = sorted(sick - ours - others)
    return TaintPlan(
        add=tuple(candidates[:room]),
        remove=tuple(sorted(remove)),
        held_back=tuple(candidates[room:]),
        cap=cap,
    )


def _taints_with(node: Mapping[str, Any], network: str, tainted: bool) -> list[dict[str, Any]]:
    taints = [dict(t) for t in (node.get("spec") or {}).get("taints") or []]
    ours = [
        t
        for t in taints
        if t.get("key") == c.UNHEALTHY_TAINT_KEY and t.get("effect") == c.UNHEALTHY_TAINT_EFFECT
    ]
    if tainted and not ours:
        taints.append(
            {"key": c.UNHEALTHY_TAINT_KEY, "value": network, "effect": c.UNHEALTHY_TAINT_EFFECT}
        )
    if not tainted:
        taints = [t for t in taints if not (t in ours and t.get("value") == network)]
    return taints


async def set_taint(kube: Kube, node: str, network: str, tainted: bool) -> bool:
    """Add or remove this network's taint on `node` (optimistic concurrency, 3 tries).

    Returns whether the node was changed.
    """
    for _ in range(3):
        body = await kube.get_or_none(NODE, node)
        if body is None:
            return False
        current = (body.get("spec") or {}).get("taints") or []
        wanted = _taints_with(body, network, tainted)
        if wanted == current:
            return False
        patch = {
            "metadata": {"resourceVersion": body["metadata"]["resourceVersion"]},
            "spec": {"taints": wanted or None},
        }
        try:
            await kube.patch(NODE, node, patch, content_type=MERGE_PATCH)
        except ApiError as err:
            if err.status == 409:
                continue
            raise
        failpoint("taints.after_set" if tainted else "taints.after_remove")
        log.info("%s taint %s on node %s", "set" if tainted else "removed", network, node)
        return True
    log.warning("node %s kept changing; its taint is retried in the next node pass", node)
    return False


async def apply_plan(kube: Kube, network: str, plan: TaintPlan) -> int:
    """Carry out a plan; returns how many nodes changed."""
    changed = 0
    for node in plan.add:
        changed += await set_taint(kube, node, network, True)
    for node in plan.remove:
        changed += await set_taint(kube, node, network, False)
    return changed
