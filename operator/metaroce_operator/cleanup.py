"""cleanupOnDelete: the finalizer that keeps a deleted network until its nodes reverted.

Only then does the operator hold a finalizer: agents see the deletion (they watch their
network), undo their settings and report `reverted: true` in their NodeState; when every
NodeState of a node that still exists says so, the finalizer goes and garbage collection
removes the children. Nodes that do not answer within the timeout are named in a
Degraded condition and an Event, and the finalizer is released anyway: a network must
not be undeletable because a node is down.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from metaroce_api import constants as c
from metaroce_operator.kube import Kube
from metaroce_operator.observed import NodeReport, parse_time
from metaroce_operator.status import CleanupView


def finalizers(body: Mapping[str, Any]) -> list[str]:
    return list((body.get("metadata") or {}).get("finalizers") or [])


def deleting(body: Mapping[str, Any]) -> bool:
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


def wants_finalizer(body: Mapping[str, Any]) -> bool:
    return bool((body.get("spec") or {}).get("cleanupOnDelete")) and not deleting(body)


def cleanup_view(
    body: Mapping[str, Any],
    reports: Mapping[str, NodeReport],
    existing_nodes: Collection[str] | None,
    now: datetime,
    timeout: float,
) -> CleanupView:
    """Who still has to report `reverted` (nodes that no longer exist are not waited for)."""
    pending = tuple(
        sorted(
            node
            for node, report in reports.items()
            if not report.reverted and (existing_nodes is None or node in existing_nodes)
        )
    )
    since = parse_time((body.get("metadata") or {}).get("deletionTimestamp"))
    waited = (now - since).total_seconds() if since else 0.0
    return CleanupView(
        pending=pending, timed_out=bool(pending) and waited >= timeout, timeout_seconds=timeout
    )


def seconds_left(body: Mapping[str, Any], now: datetime, timeout: float) -> float:
    since = parse_time((body.get("metadata") or {}).get("deletionTimestamp"))
    return max(timeout - ((now - since).total_seconds() if since else 0.0), 0.0)


@dataclass(frozen=True)
class Decision:
    """What the cleanup finalizer of a deleting network calls for now."""

    view: CleanupView
    recheck_in: float | None
    """Seconds until the timeout, while nodes are still to revert (None: not waiting)."""

    @property
    def release(self) -> bool:
        """Every node reverted, or the rest timed out: the agents and the finalizer go."""
        return not self.view.pending or self.view.timed_out

    @property
    def shows(self) -> bool:
        """Whether the status has something to say (who is pending, or timed out)."""
        return bool(self.view.pending) or self.view.timed_out


def decide(
    body: Mapping[str, Any],
    reports: Mapping[str, NodeReport],
    existing_nodes: Collection[str] | None,
    now: datetime,
    timeout: float,
) -> Decision | None:
    """The finalizer's decision for a deleting network (None: it holds no finalizer)."""
    if c.CLEANUP_FINALIZER not in finalizers(body):
        return None
    view = cleanup_view(body, reports, existing_nodes, now, timeout)
    waiting = bool(view.pending) and not view.timed_out
    return Decision(view, seconds_left(body, now, timeout) if waiting else None)


def orphaned_anchors(
    roles: Iterable[Mapping[str, Any]], live: Collection[str], now: datetime, grace: float
) -> list[tuple[str, str | None, str]]:
    """(name, uid, network) of the agents' anchor ClusterRoles whose network is gone and
    which no network owns (a network's own children are the garbage collector's); one
    younger than `grace` seconds may belong to a network too new for the list."""
    out: list[tuple[str, str | None, str]] = []
    for role in roles:
        meta = role.get("metadata") or {}
        network = (meta.get("labels") or {}).get(c.NETWORK_LABEL, "")
        owners = {ref.get("kind") for ref in meta.get("ownerReferences") or []}
        if not network or network in live or c.NETWORK_KIND in owners:
            continue
        created = parse_time(meta.get("creationTimestamp"))
        if created and (now - created).total_seconds() < grace:
            continue
        out.append((str(meta["name"]), meta.get("uid"), str(network)))
    return out


async def set_finalizer(kube: Kube, name: str, present: bool, field_manager: str) -> None:
    """Add or drop the cleanup finalizer with server-side apply (only our entry is touched)."""
    meta: dict[str, Any] = {"name": name}
    if present:
        meta["finalizers"] = [c.CLEANUP_FINALIZER]
    await kube.apply(
        {"apiVersion": c.API_VERSION, "kind": c.NETWORK_KIND, "metadata": meta},
        field_manager=field_manager,
    )
