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

import logging
from collections.abc import Mapping
from typing import Any

from metaroce_api import constants as c
from metaroce_operator import events, metrics
from metaroce_operator.kube import KINDS, ApiError, Kube
from metaroce_operator.state import Store
from metaroce_operator.status import EventSpec

log = logging.getLogger("metaroce.operator.claim")
CLAIM_ANNOTATION = f"{c.GROUP}/operator"
NETWORK = KINDS[(c.API_VERSION, c.NETWORK_KIND)]
LEASE = KINDS[("coordination.k8s.io/v1", "Lease")]


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


class Claimer:
    """The leader's side of the claim: takes or respects it, and owns the table of
    networks claimed by another operator (`store.claims`)."""

    def __init__(self, kube: Kube, store: Store, lease_ref: str, identity: str) -> None:
        self.kube = kube
        self.store = store
        self.lease_ref = lease_ref
        """This operator's Lease, `namespace/name`."""
        self.identity = identity

    def mine(self, body: Mapping[str, Any]) -> bool:
        return claimant(body) == self.lease_ref

    async def claim(self, name: str, body: dict[str, Any]) -> bool:
        """Whether this operator may act on the network: it holds the claim, or takes it
        (unclaimed, or claimed by an operator whose Lease is gone)."""
        for _ in range(3):
            claim = claimant(body)
            if claim == self.lease_ref:
                self._not_foreign(name)
                return True
            if claim is not None and not await self.claimant_gone(claim):
                await self._foreign(name, body, claim)
                return False
            try:
                result = await self.kube.patch(NETWORK, name, claim_patch(body, self.lease_ref))
            except ApiError as err:
                if err.status != 409:
                    raise
                fresh = await self.kube.get_or_none(NETWORK, name)  # another leader raced us
                if fresh is None:
                    return False
                body = fresh
                continue
            if claim is None:
                log.info("%s: claimed by this operator (lease %s)", name, self.lease_ref)
            else:
                log.warning(
                    "%s: took it over from the operator of lease %s, which no longer exists",
                    name, claim,
                )  # fmt: skip
            self.store.set_network(result)
            self._not_foreign(name)
            return True
        return False

    async def claimant_gone(self, claim: str) -> bool:
        """Whether the claimant's Lease no longer exists (its release is uninstalled). An
        expired Lease is an operator that is down, not gone: its agents still run."""
        where = split_claim(claim)
        if where is None:
            return False  # not a Lease reference: a person must look (see `_foreign`)
        try:
            await self.kube.get(LEASE, where[1], where[0])
        except ApiError as err:
            if err.status == 404:
                return True
            if err.status == 403:  # a lease name the chart's RBAC does not cover
                log.debug("cannot read the claimant's lease %s: %s", claim, err)
                return False
            raise
        return False

    async def _foreign(self, name: str, body: dict[str, Any], claim: str) -> None:
        foreign = self.store.claims.foreign
        if foreign.get(name) == claim:
            return
        foreign[name] = claim
        metrics.FOREIGN_NETWORKS.set(len(foreign))
        message = (
            f"network {name} is managed by the operator of lease {claim}; this operator "
            f"(lease {self.lease_ref}) leaves it alone. Run one operator per cluster, or, "
            f"if that operator is gone for good, remove the claim: kubectl annotate "
            f"{c.NETWORK_PLURAL} {name} {CLAIM_ANNOTATION}-"
        )
        log.warning("%s", message)
        spec = EventSpec("Warning", "ClaimedByAnotherOperator", message)
        await events.post(self.kube, body, spec, self.identity)

    def _not_foreign(self, name: str) -> None:
        if self.store.claims.foreign.pop(name, None) is not None:
            metrics.FOREIGN_NETWORKS.set(len(self.store.claims.foreign))

    async def take_over_gone(self) -> list[str]:
        """The foreign networks whose claimant's Lease is gone, forgotten as foreign (the
        caller reconciles them, which takes the claim)."""
        gone: list[str] = []
        for name, claim in list(self.store.claims.foreign.items()):
            if await self.claimant_gone(claim):
                log.info("%s: its operator (lease %s) is gone; taking it over", name, claim)
                self.store.claims.foreign.pop(name, None)
                gone.append(name)
        return gone
