"""The agents' upgrade policy (issue 16 #17), pure: on the DaemonSet's own machinery.

- `RollingUpdate` with `maxUnavailable` and `minReadySeconds` over a readiness that means
  "the node's plan is applied and verified" (the agent's /readyz): the usual case;
- `OnDelete` for a pause (`spec.agent.updateStrategy.paused`): no agent is replaced;
- `OnDelete` while a node holds off updates with the label
  `metaroce.io/hold-agent-update=<deadline>` (a job runs there): the operator then does
  what the DaemonSet controller would, for the other nodes only: it deletes outdated
  agent pods, at most `maxUnavailable` nodes without an available agent at a time, and
  the DaemonSet controller recreates them from the new template. A hold ends at its
  deadline, which may be at most `maxHold` ahead (so no node holds forever); once no node
  holds, the DaemonSet is back to `RollingUpdate` and updates the rest itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from metaroce_api import constants as c
from metaroce_api.network import AgentUpdateStatus, HeldNode

Strategy = Literal["RollingUpdate", "OnDelete"]
REVISION_LABEL = "controller-revision-hash"
"""The DaemonSet controller's label on its pods and ControllerRevisions."""
STATUS_LIMIT = 10


@dataclass(frozen=True)
class Hold:
    node: str
    until: datetime | None
    state: Literal["holding", "expired", "refused"]
    message: str = ""


def read_hold(node: str, value: str, now: datetime, max_hold: timedelta) -> Hold:
    """One node's hold label, judged against the network's maxHold."""
    label = f"{c.UPDATE_HOLD_LABEL}={value}"
    try:
        until = datetime.strptime(value, c.UPDATE_HOLD_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return Hold(
            node,
            None,
            "refused",
            f"{label} is not a deadline: write the UTC time the hold ends as "
            f"YYYYMMDDTHHMMSSZ, e.g. {(now + timedelta(hours=2)).strftime(c.UPDATE_HOLD_FORMAT)}",
        )
    if until <= now:
        return Hold(node, until, "expired", f"{label}: the deadline passed; the node is updated")
    if until - now > max_hold:
        return Hold(
            node,
            until,
            "refused",
            f"{label} is more than spec.agent.updateStrategy.maxHold ({_hours(max_hold)}) "
            f"ahead: write a deadline before {(now + max_hold).strftime(c.UPDATE_HOLD_FORMAT)}, "
            "or raise maxHold",
        )
    return Hold(node, until, "holding")


def read_holds(
    nodes: Iterable[str],
    labels: Mapping[str, Mapping[str, str]],
    now: datetime,
    max_hold: timedelta,
) -> tuple[Hold, ...]:
    """The holds of the network's nodes, sorted by node."""
    out = []
    for node in sorted(nodes):
        value = (labels.get(node) or {}).get(c.UPDATE_HOLD_LABEL)
        if value is not None:
            out.append(read_hold(node, value, now, max_hold))
    return tuple(out)


def holding(holds: Iterable[Hold]) -> frozenset[str]:
    return frozenset(h.node for h in holds if h.state == "holding")


def strategy(paused: bool, holds: Iterable[Hold]) -> Strategy:
    """The DaemonSet's update strategy type."""
    return "OnDelete" if paused or holding(holds) else "RollingUpdate"


def next_step(
    held: frozenset[str], rendered_holding: bool | None, paused: bool
) -> Literal["reapply", "replace", None]:
    """The upgrade policy's next step for a network, from the nodes that hold now and how
    its DaemonSet was last applied (None: not applied in this term): re-apply it when a
    hold came or went (`OnDelete` while any node holds), replace the other nodes'
    outdated agents while one holds, else nothing."""
    if rendered_holding is not None and rendered_holding != bool(held):
        return "reapply"
    if not held or paused or not rendered_holding:
        return None
    return "replace"


def scaled_max_unavailable(value: int | str, desired: int) -> int:
    """maxUnavailable as a count, percentages rounded up, as the DaemonSet controller does."""
    if isinstance(value, int):
        return max(1, value)
    return max(1, math.ceil(int(value.removesuffix("%")) * desired / 100))


@dataclass(frozen=True)
class AgentPod:
    name: str
    node: str
    revision: str
    ready_since: datetime | None
    """When its Ready condition turned True; None while not ready."""
    deleting: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> AgentPod:
        meta = body.get("metadata") or {}
        ready_since = None
        for cond in (body.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Ready" and cond.get("status") == "True":
                stamp = str(cond.get("lastTransitionTime") or "")
                try:
                    ready_since = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
                except ValueError:
                    ready_since = datetime.min.replace(tzinfo=UTC)  # ready, since unknown
        return cls(
            name=str(meta.get("name") or ""),
            node=str((body.get("spec") or {}).get("nodeName") or ""),
            revision=str((meta.get("labels") or {}).get(REVISION_LABEL) or ""),
            ready_since=ready_since,
            deleting=bool(meta.get("deletionTimestamp")),
        )

    def available(self, now: datetime, min_ready_seconds: float) -> bool:
        return (
            not self.deleting
            and self.ready_since is not None
            and (now - self.ready_since).total_seconds() >= min_ready_seconds
        )


def current_revision(revisions: Iterable[Mapping[str, Any]], daemonset_uid: str) -> str | None:
    """The hash of the DaemonSet's newest ControllerRevision (what its new pods get)."""
    best: tuple[int, str] | None = None
    for rev in revisions:
        meta = rev.get("metadata") or {}
        owners = {str(o.get("uid")) for o in meta.get("ownerReferences") or []}
        digest = (meta.get("labels") or {}).get(REVISION_LABEL)
        if daemonset_uid not in owners or not digest:
            continue
        number = int(rev.get("revision") or 0)
        if best is None or number > best[0]:
            best = (number, str(digest))
    return best[1] if best else None


def pods_to_replace(
    pods: Sequence[AgentPod],
    revision: str,
    nodes: Iterable[str],
    held: frozenset[str],
    max_unavailable: int,
    now: datetime,
    min_ready_seconds: float,
) -> list[str]:
    """Outdated agent pods to delete now, on nodes that do not hold: while fewer than
    `max_unavailable` of the network's `nodes` lack an available agent (a node without a
    pod, or whose pod is not ready for `min_ready_seconds` or is going, counts)."""
    wanted = set(nodes)
    available_nodes = {
        p.node for p in pods if p.node in wanted and p.available(now, min_ready_seconds)
    }
    budget = max_unavailable - (len(wanted) - len(available_nodes))
    if budget <= 0:
        return []
    outdated = sorted(
        (
            p
            for p in pods
            if p.node in wanted
            and p.node not in held
            and p.revision != revision
            and p.available(now, min_ready_seconds)
        ),
        key=lambda p: (p.node, p.name),
    )
    return [p.name for p in outdated[:budget]]


def update_status(paused: bool, holds: Sequence[Hold]) -> AgentUpdateStatus:
    order = {"holding": 0, "refused": 1, "expired": 2}
    shown = sorted(holds, key=lambda h: (order[h.state], h.node))[:STATUS_LIMIT]
    return AgentUpdateStatus(
        strategy=strategy(paused, holds),
        paused=paused,
        holding=len(holding(holds)),
        held_nodes=[
            HeldNode(
                node=h.node,
                until=h.until.strftime("%Y-%m-%dT%H:%M:%SZ") if h.until else "",
                state=h.state,
                message=h.message[:1024],
            )
            for h in shown
        ]
        or None,
    )


def _hours(span: timedelta) -> str:
    hours = span.total_seconds() / 3600
    return f"{hours:g}h" if hours >= 1 else f"{span.total_seconds() / 60:g}m"
