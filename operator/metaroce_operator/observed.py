"""Compact, immutable views of what the operator watches (NodeStates, DaemonSets, Nodes).

The watch bodies are reduced to these at event time, so the in-memory store of a
1,000-node network holds small tuples, and the pure functions (status, taints,
conflicts) take plain values that unit tests build by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from metaroce_api import MetaRoceNodeStateStatus, ProbeSpec
from metaroce_api.constants import CONDITION_READY, NODESTATE_ERROR_STEP_RETRY


@dataclass(frozen=True)
class PeerResult:
    """One probe result of a node against a peer."""

    peer: str
    reachable: bool
    latency_p99_us: float | None = None
    loss_fraction: float | None = None

    def failed(self, probe: ProbeSpec) -> bool:
        """Whether this result fails the network's thresholds."""
        if not self.reachable:
            return True
        if self.loss_fraction is not None and self.loss_fraction > probe.max_loss_fraction:
            return True
        return (
            self.latency_p99_us is not None and self.latency_p99_us > probe.max_latency_microseconds
        )


@dataclass(frozen=True)
class ReportedNic:
    """One NIC an agent reports, with the attributes NIC selectors match on."""

    netdev: str
    driver: str | None = None
    vendor_id: str | None = None
    device_id: str | None = None
    rdma_device: str | None = None


@dataclass(frozen=True)
class NodeReport:
    """The parts of one MetaRoceNodeState the operator acts on."""

    name: str
    """Object name of the NodeState."""
    network: str
    node: str
    uid: str = ""
    phase: str = "Pending"
    config_generation: int | None = None
    error: str = ""
    """The newest agent error, `step: message`, other than the note of when a failed pass
    is retried (which says when, not what failed)."""
    probe_healthy: bool | None = None
    peers: tuple[PeerResult, ...] = ()
    reverted: bool = False
    ready_reason: str = ""
    """The reason of the NodeState's Ready condition (`NODESTATE_REASON_*`): tells a
    rollback or revert the agent has not finished from a node that is Degraded but runs
    its config."""
    transport: str = "none"
    netdevs: tuple[str, ...] = ()
    nics: tuple[ReportedNic, ...] = ()
    created: datetime | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> NodeReport | None:
        """The report of a NodeState body, or None if it names no network/node."""
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        network, node = spec.get("network"), spec.get("node")
        if not isinstance(network, str) or not isinstance(node, str):
            return None
        created = parse_time(meta.get("creationTimestamp"))
        base = cls(
            name=str(meta.get("name", "")),
            network=network,
            node=node,
            uid=str(meta.get("uid", "")),
            created=created,
        )
        raw = body.get("status")
        if not raw:
            return base
        try:
            status = MetaRoceNodeStateStatus.model_validate(raw)
        except ValidationError as err:
            return _replace(
                base,
                phase="Failed",
                error=f"report: the NodeState status does not parse ({err.error_count()} errors)",
            )
        error = ""
        told = [e for e in status.errors or [] if e.step != NODESTATE_ERROR_STEP_RETRY]
        if told:
            error = f"{told[-1].step}: {told[-1].message}"
        peers: tuple[PeerResult, ...] = ()
        probe_healthy = None
        if status.probe is not None:
            probe_healthy = status.probe.healthy
            peers = tuple(
                PeerResult(
                    p.node,
                    p.reachable,
                    p.latency_p99_microseconds,
                    p.loss_fraction,
                )
                for p in status.probe.peers or []
            )
        return _replace(
            base,
            phase=status.phase,
            config_generation=status.config_generation,
            error=error,
            probe_healthy=probe_healthy,
            peers=peers,
            reverted=status.reverted,
            ready_reason=next(
                (c.reason for c in status.conditions or [] if c.type == CONDITION_READY), ""
            ),
            transport=status.transport.mode if status.transport else "none",
            netdevs=tuple(sorted(d.netdev for d in status.inventory or [])),
            nics=tuple(
                ReportedNic(d.netdev, d.driver, d.vendor_id, d.device_id, d.rdma_device)
                for d in sorted(status.inventory or [], key=lambda d: d.netdev)
            ),
        )


def _replace(report: NodeReport, **changes: Any) -> NodeReport:
    from dataclasses import replace

    return replace(report, **changes)


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass(frozen=True)
class DaemonSetView:
    """The rollout state of a network's agent DaemonSet."""

    generation: int = 0
    observed_generation: int = 0
    desired: int = 0
    current: int = 0
    updated: int = 0
    available: int = 0
    ready: int = 0
    template_hash: str = ""

    @classmethod
    def from_body(cls, body: Mapping[str, Any], hash_annotation: str) -> DaemonSetView:
        meta = body.get("metadata") or {}
        status = body.get("status") or {}
        template_meta = ((body.get("spec") or {}).get("template") or {}).get("metadata") or {}
        return cls(
            generation=int(meta.get("generation") or 0),
            observed_generation=int(status.get("observedGeneration") or 0),
            desired=int(status.get("desiredNumberScheduled") or 0),
            current=int(status.get("currentNumberScheduled") or 0),
            updated=int(status.get("updatedNumberScheduled") or 0),
            available=int(status.get("numberAvailable") or 0),
            ready=int(status.get("numberReady") or 0),
            template_hash=str((template_meta.get("annotations") or {}).get(hash_annotation, "")),
        )

    @property
    def observed_current(self) -> bool:
        """The DaemonSet controller has seen the latest spec."""
        return self.observed_generation >= self.generation > 0

    @property
    def rolled_out(self) -> bool:
        return (
            self.observed_current
            and self.updated >= self.desired
            and self.available >= self.desired
        )


@dataclass(frozen=True)
class NodeView:
    """A Node as the node pass needs it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    resource_version: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> NodeView:
        meta = body.get("metadata") or {}
        return cls(
            name=str(meta.get("name", "")),
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
            taints=tuple((body.get("spec") or {}).get("taints") or ()),
            resource_version=str(meta.get("resourceVersion", "")),
        )
