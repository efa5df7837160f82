"""One operator per network (issue 16 #16): two releases of the chart in two namespaces
each elect a leader in their own Lease, and both would reconcile every network (two
agent DaemonSets per node fighting over the NIC, two status writers, two taint
managers). So a network is claimed: the first leader to reconcile it records its Lease
in the annotation `metaroce.io/operator` (`<namespace>/<lease>`, written with the
network's resourceVersion, so of two leaders racing one wins), and every other operator
leaves that network alone: no children, status, taints or cleanup, and it says so
(a log line and a Warning Event once per term, the metric
`metaroce_operator_foreign_networks`).

A claim passes only when the claimant's Lease no longer exists: its release was
uninstalled (the namespace and the Lease in it are deleted). An expired Lease is an
operator that is down, not gone; taking over then would run a second DaemonSet beside
its agents. To hand a network over by hand: `kubectl annotate metaroceneworks <name>
metaroce.io/operator-`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metaroce_api import constants as c

CLAIM_ANNOTATION = f"{c.GROUP}/operator"


def claimant(body: Mapping[str, Any]) -> str | None:
    """The Lease (`namespace/name`) of the operator that claimed the network, if any."""
    value = ((body.get("metadata") or {}).get("annotations") or {}).get(CLAIM_ANNOTATION)
    return str(value) if value else None


def split_claim(claim: str) -> tuple[str, str] | None:
    """(namespace, name) of a claim's Lease; None when it is not `namespace/name`."""
    namespace, _, name = claim.partition("/")
    return (namespace, name) if namespace and name and "/" not in name else None


def claim_patch(body: Mapping[str, Any], mine: str) -> dict[str, Any]:
    """A merge patch that claims the network, valid only against the version read (the
    resourceVersion makes a concurrent claim by another leader fail with 409)."""
    meta = body.get("metadata") or {}
    return {
        "metadata": {
            "resourceVersion": meta.get("resourceVersion"),
            "annotations": {CLAIM_ANNOTATION: mine},
        }
    }


def kopf_prefix(namespace: str, default_namespace: str) -> str:
    """The prefix of kopf's annotations on networks: per operator namespace, so the
    bookkeeping of one release (its last-handled configuration) never makes another's
    kopf skip a change; the default namespace keeps the historical `operator.<group>`."""
    base = f"operator.{c.GROUP}"
    return base if namespace == default_namespace else f"{namespace}.{base}"
