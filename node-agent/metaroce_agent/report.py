"""Report: build the `MetaRoceNodeState` status (pure) and write it only when it changed.

`build_status` turns what the agent knows (config, inventory, plan, the last apply and
drift results, probe summary, errors, revert) into the API's status model. The writer
sends it under the agent's field manager, skipping the write when nothing but timestamps
changed, so an idle node makes no API traffic. The NodeState CRD has no status
subresource (a report object written only by its agent, like NFD's NodeFeature), so the
first report is ONE create carrying spec (network and node), labels (`nodestate_labels`)
and status; later reports are a JSON merge patch of the object with `status` only (what
changed). An existing NodeState (agent restart, changed annotations, a failed write) is
taken over by one server-side apply that carries the status too, followed by a merge
patch only when the server still holds fields the new status does not have. With 1,000
agents starting together these writes share the control plane with the DaemonSet
rollout itself: one create per node instead of a create plus a status write, and a merge
patch (no structured merge of the request) for the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from metaroce_agent import __version__
from metaroce_agent.discover import Inventory
from metaroce_agent.engine import ApplyResult, verified_state_serving
from metaroce_agent.kube import KubeClient, KubeError, cluster_path
from metaroce_agent.plan import Plan
from metaroce_agent.steps import Step
from metaroce_agent.transport.base import select_gid
from metaroce_agent.transport.select import DRIVERS
from metaroce_api import (
    AgentConfig,
    AgentError,
    AppliedKnob,
    Condition,
    Device,
    MetaRoceNodeStateStatus,
    ProbeSummary,
    QosReport,
    SkippedKnob,
    TransportState,
    constants,
    nodestate_labels,
    nodestate_name,
)
from metaroce_api.nodestate import NodeStatePhase, TransportLibrary

log = logging.getLogger("metaroce.agent.report")

MAX_ERRORS = 16

# Condition reasons of a NodeState (shared with the operator and the docs).
REASON_APPLIED = constants.NODESTATE_REASON_APPLIED
REASON_DEGRADED = constants.NODESTATE_REASON_DEGRADED
REASON_APPLY_FAILED = constants.NODESTATE_REASON_APPLY_FAILED
REASON_PLAN_BLOCKED = constants.NODESTATE_REASON_PLAN_BLOCKED
REASON_REVERTED = constants.NODESTATE_REASON_REVERTED
REASON_PENDING = constants.NODESTATE_REASON_PENDING
REASON_ROLLBACK_INCOMPLETE = constants.NODESTATE_REASON_ROLLBACK_INCOMPLETE
REASON_REVERT_INCOMPLETE = constants.NODESTATE_REASON_REVERT_INCOMPLETE


def now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


@dataclass
class ErrorLog:
    """The latest errors (at most 16), each keeping the time it first appeared."""

    items: list[AgentError] = field(default_factory=list)

    def set(self, current: Sequence[tuple[str, str]], when: datetime | None = None) -> None:
        """Replace the list with `current` (step, message) pairs, keeping first-seen times."""
        seen = {(e.step, e.message): e.time for e in self.items}
        t = when or now()
        unique = list(dict.fromkeys((s[:128], m[:4096]) for s, m in current))
        self.items = [
            AgentError(step=s, message=m, time=seen.get((s, m), t)) for s, m in unique[-MAX_ERRORS:]
        ]


def inventory_devices(config: AgentConfig, inventory: Inventory, plan: Plan | None) -> list[Device]:
    """One entry per RDMA device port the network serves, plus selected netdevs without."""
    out: list[Device] = []
    selected = list(plan.netdevs) if plan else []
    served = list(plan.devices) if plan else []
    for nd_name in selected:
        nd = inventory.netdev(nd_name)
        if nd is None:
            continue
        mine = [d for d in served if d.netdev == nd_name]
        base: dict[str, Any] = {
            "netdev": nd.name,
            "pci_address": nd.pci_address,
            "vendor_id": nd.vendor_id,
            "device_id": nd.device_id,
            "driver": nd.driver,
            "numa_node": nd.numa_node,
            "link_speed_mbps": nd.speed_mbps,
            "mtu": nd.mtu,
        }
        if not mine:
            out.append(Device(**base))
            continue
        for td in mine:
            dev = inventory.rdma_device(td.rdma_device)
            port = dev.port(td.port) if dev else None
            gid = select_gid(config, port) if port else None
            out.append(
                Device(
                    **base,
                    rdma_device=td.rdma_device if dev else None,
                    rdma_kind=td.kind if dev and td.kind != "metaroce" else "none",
                    active_mtu=port.active_mtu if port else None,
                    port_state=port.state if port else None,
                    gid_index=gid.index if gid else None,
                    gid=gid.gid if gid else None,
                )
            )
    return out[:64]


def transport_state(
    config: AgentConfig, inventory: Inventory, plan: Plan | None, applied_ok: bool
) -> tuple[TransportState, list[tuple[str, str]]]:
    """The transport as it is now, and device problems (step, message)."""
    if plan is None or plan.mode == "none":
        return TransportState(mode="none", ready=False, message="no transport"), []
    problems: list[tuple[str, str]] = []
    usable = []
    driver = DRIVERS.get(plan.mode)
    for td in plan.devices:
        why = driver().served_problem(config, inventory, td) if driver else None
        if why is None:
            usable.append(td.name)
        else:
            problems.append((f"transport {plan.mode} on {td.name}", f"{td.name} {why}"))
    ready = applied_ok and bool(plan.devices) and not problems
    return (
        TransportState(
            mode=plan.mode,
            ready=ready,
            devices=sorted(set(usable)) or None,
            message=plan.transport_message[:1024],
            library=(
                TransportLibrary(
                    directory=plan.library.directory,
                    version=plan.library.version,
                    checksum=plan.library.checksum,
                )
                if plan.library
                else None
            ),
        ),
        problems,
    )


def build_status(
    *,
    config: AgentConfig,
    inventory: Inventory,
    plan: Plan | None,
    result: ApplyResult | None,
    errors: ErrorLog,
    drift_corrections: int,
    probe: ProbeSummary | None = None,
    reverted: bool = False,
    reverting: bool = False,
    previous: MetaRoceNodeStateStatus | None = None,
    last_applied: datetime | None = None,
    revert_left: Sequence[Step] | None = None,
) -> MetaRoceNodeStateStatus:
    """The NodeState status for the agent's current knowledge (pure).

    `revert_left`: after a revert that failed, the steps still applied (the journal's);
    None when no revert failed since the last apply pass."""
    phase: NodeStatePhase
    revert_failed = revert_left is not None and not reverted
    applied_ok = bool(result and result.ok) and not reverted and not revert_failed
    # a failed re-apply rolled back whole: the last verified state serves running jobs
    kept = not (reverted or reverting or revert_failed) and bool(
        verified_state_serving(result, plan)
    )
    transport, device_problems = transport_state(config, inventory, plan, applied_ok or kept)
    if reverted or reverting or revert_failed:
        device_problems = []  # the revert removes the devices it made on purpose
    errs = list(errors.items)
    if device_problems:
        extra = ErrorLog(list(errs))
        extra.set([(e.step, e.message) for e in errs] + device_problems)
        errs = extra.items

    still: Sequence[Step] = []
    if revert_left is not None:
        still = revert_left
    elif result is not None and not reverted:
        # after a failed pass, the last verified state it restored is what is in force
        still = result.applied if result.ok else result.in_force
    applied = [
        AppliedKnob(name=s.knob, device=s.device, value=s.value()[:256], method=s.method)
        for s in still
        if s.report and not reverted
    ]
    skipped = [
        SkippedKnob(name=s.knob, device=s.device, reason=s.reason[:1024])
        for s in (plan.skipped if plan else ())
    ]

    if reverted:
        phase, reason, msg = "Reverted", REASON_REVERTED, "node settings reverted (cleanupOnDelete)"
    elif reverting:
        phase, reason, msg = "Reverting", REASON_REVERTED, "reverting node settings"
    elif revert_failed:
        phase, reason = "Degraded", REASON_REVERT_INCOMPLETE
        msg = "revert incomplete (retrying): " + "; ".join(e.message for e in errs)
        msg = msg[:2000]
    elif plan is None or result is None:
        phase, reason, msg = "Pending", REASON_PENDING, "not applied yet"
    elif result.rollback_incomplete:
        phase, reason = "Degraded", REASON_ROLLBACK_INCOMPLETE
        where = result.failed_step.name if result.failed_step else "apply"
        left = ", ".join(s.name for s in result.left_off)
        msg = (
            f"rollback incomplete (retrying with backoff): {where} failed: {result.error}; "
            f"left off their last verified values: {left}; " + "; ".join(result.undo_errors)
        )[:2000]
    elif not plan.ok:
        phase, reason = "Failed", REASON_PLAN_BLOCKED
        msg = "; ".join(f"{e.where}: {e.message}" for e in plan.errors)
    elif not result.ok:
        phase, reason = "Failed", REASON_APPLY_FAILED
        where = result.failed_step.name if result.failed_step else "apply"
        msg = f"{where} failed: {result.error}; rolled back {len(result.rolled_back)} step(s)"
    elif device_problems or errs:
        phase, reason = "Degraded", REASON_DEGRADED
        msg = "; ".join(e.message for e in errs)[:2000]
    else:
        phase, reason = "Ready", REASON_APPLIED
        msg = (
            f"{len(applied)} knob(s) applied, {len(skipped)} skipped; "
            f"{transport.mode} on {', '.join(transport.devices or []) or 'nothing'}"
        )
    ready = "True" if phase == "Ready" else "False"
    condition = _condition(
        previous, constants.CONDITION_READY, ready, reason, msg[:32768], config.generation
    )
    return MetaRoceNodeStateStatus(
        phase=phase,
        config_generation=config.generation,
        agent_version=__version__,
        inventory=inventory_devices(config, inventory, plan) or None,
        qos=QosReport(applied=applied or None, skipped=skipped or None)
        if (applied or skipped)
        else None,
        transport=transport,
        probe=probe,
        errors=errs[-MAX_ERRORS:] or None,
        drift_corrections=drift_corrections,
        last_applied_time=last_applied,
        reverted=reverted,
        conditions=[condition],
    )


def _condition(
    previous: MetaRoceNodeStateStatus | None,
    ctype: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
) -> Condition:
    old = (
        next((c for c in (previous.conditions or []) if c.type == ctype), None)
        if previous
        else None
    )
    when = old.last_transition_time if old is not None and old.status == status else now()
    return Condition(
        type=ctype,
        status=status,  # type: ignore[arg-type]
        observed_generation=generation,
        last_transition_time=when,
        reason=reason,
        message=message,
    )


def change_key(status: MetaRoceNodeStateStatus) -> str:
    """A digest of the status without its clocks: equal keys mean nothing to write."""
    data = status.to_api()
    data.pop("lastAppliedTime", None)
    if isinstance(data.get("probe"), dict):
        data["probe"].pop("lastRunTime", None)
        for peer in data["probe"].get("peers") or []:
            for k in ("latencyP50Microseconds", "latencyP99Microseconds", "lossFraction"):
                peer.pop(k, None)
    for c in data.get("conditions") or []:
        c.pop("lastTransitionTime", None)
    for e in data.get("errors") or []:
        e.pop("time", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns `old` into `new` (objects recurse; anything
    else, lists included, is replaced whole; a key that went away is set to null)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


class NodeStateWriter:
    """Creates the agent's NodeState with its status, then merge-patches what changed."""

    def __init__(self, kube: KubeClient, network: str, node: str) -> None:
        self.kube = kube
        self.network = network
        self.node = node
        self.name = nodestate_name(network, node)
        self.collection = cluster_path(
            constants.GROUP, constants.VERSION, constants.NODESTATE_PLURAL
        )
        self.path = f"{self.collection}/{self.name}"
        self._last_key: str | None = None
        self._ensured = False
        self._exists = False
        self._server_status: dict[str, Any] = {}
        """The status on the server as far as we know: what the merge patch is made against."""
        self.writes = 0
        """Status writes made (reports that reached the server, however many requests)."""
        self.requests = 0
        """Write requests made (creates, take-overs and merge patches)."""
        self.annotations: dict[str, str] = {}

    def _object(self, status: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": self.name,
            "labels": nodestate_labels(self.network, self.node),
        }
        if self.annotations:
            meta["annotations"] = dict(self.annotations)
        return {
            "apiVersion": constants.API_VERSION,
            "kind": constants.NODESTATE_KIND,
            "metadata": meta,
            "spec": {"network": self.network, "node": self.node},
            "status": status,
        }

    def _ensure(self, status: dict[str, Any]) -> bool:
        """Create the NodeState with `status` (one request); when it exists (agent restart,
        changed annotations, or re-created after a failed write), take it over by
        server-side apply, with the status as well. True when the server now holds
        exactly `status`; False when a merge patch must still remove what the previous
        writer left (an apply keeps fields that other writes own)."""
        if not self._exists:
            self.requests += 1
            try:
                self.kube.create(
                    self.collection, self._object(status), constants.AGENT_FIELD_MANAGER
                )
            except KubeError as e:
                if e.status != 409:
                    raise
            else:
                self._server_status = status
                self._exists = self._ensured = True
                return True
        self.requests += 1
        body = self.kube.apply(self.path, self._object(status), constants.AGENT_FIELD_MANAGER)
        self._server_status = dict(body.get("status") or {})
        self._exists = self._ensured = True
        return not merge_patch(self._server_status, status)

    def set_annotation(self, key: str, value: str) -> None:
        if self.annotations.get(key) != value:
            self.annotations[key] = value
            self._ensured = False

    def write(self, status: MetaRoceNodeStateStatus, *, force: bool = False) -> bool:
        """Write the status if it differs from the last one written; True when written."""
        key = change_key(status)
        if not force and key == self._last_key and self._ensured:
            return False
        new = status.to_api()
        if not self._ensured and self._ensure(new):
            self._written(new, key, status)
            return True
        patch = merge_patch(self._server_status, new)
        if not patch and not force:
            self._last_key = key  # the server has it already
            return False
        self.requests += 1
        try:
            self.kube.merge_patch(self.path, {"status": patch}, constants.AGENT_FIELD_MANAGER)
        except KubeError as e:
            if e.status == 404:  # deleted under us: the next write re-creates it
                self._exists = self._ensured = False
            raise
        self._written(new, key, status)
        return True

    def _written(self, new: dict[str, Any], key: str, status: MetaRoceNodeStateStatus) -> None:
        self._server_status = new
        self._last_key = key
        self.writes += 1
        log.info("NodeState %s: phase %s written", self.name, status.phase)
