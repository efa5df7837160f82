"""cleanupOnDelete: the finalizer that keeps a deleted network until its nodes reverted.

Only then does the operator hold a finalizer: agents see the deletion (they watch their
network), undo their settings and report `reverted: true` in their NodeState; when every
NodeState of a node that still exists says so, the finalizer goes and garbage collection
removes the children. Nodes that do not answer within the timeout are named in a
Degraded condition and an Event, and the finalizer is released anyway: a network must
not be undeletable because a node is down.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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


async def set_finalizer(kube: Kube, name: str, present: bool, field_manager: str) -> None:
    """Add or drop the cleanup finalizer with server-side apply (only our entry is touched)."""
    meta: dict[str, Any] = {"name": name}
    if present:
        meta["finalizers"] = [c.CLEANUP_FINALIZER]
    await kube.apply(
        {"apiVersion": c.API_VERSION, "kind": c.NETWORK_KIND, "metadata": meta},
        field_manager=field_manager,
    )
