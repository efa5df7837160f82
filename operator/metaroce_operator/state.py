"""What the leader knows, one object per concern, each owning its state and its gate.

Issue 16 (structure): the controller kept eleven parallel dicts and cleared them by hand
when a network went, and nothing said which state could be read when. Findings 1 (a
cleanup decided before the NodeStates were listed), 2 (taints managed for live networks
only), 7 and 8 came from that. Here each concern owns its tables:

- `PerNetwork` tables are forgotten with their network by `Store.forget_network`, which
  finds them itself (`tables`): a table added later cannot be left out of the clearing.
- Observed state that the first list of its kind must complete has a gate: `Reports`
  (the NodeState informer's first list) and `Nodes` (the node pass's first list) raise
  `NotSynced` when read before it, so "no report" cannot be read as "nothing configured"
  or "every node reverted".
- `Children` is the term's own gate: a network it has not applied in this leadership
  term has no status yet and no drift to repair.

Each object also makes the decisions that need its state and no I/O (which child event
calls for a re-apply, which held network may resume, which NodeStates are orphans, when
a rollout's last report came in), so they are tested without a cluster
(tests/unit/operator/test_concerns.py); the controller does the I/O and wires them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from metaroce_api import (
    InvalidObject,
    LabelSelector,
    MetaRoceNetwork,
    MetaRoceNetworkStatus,
    validate_network,
)
from metaroce_api import constants as c
from metaroce_operator import probes, upgrade
from metaroce_operator.conflicts import Conflict, selector_matches
from metaroce_operator.drift import daemonset_drift, rbac_drift
from metaroce_operator.freshness import NetworkBodies
from metaroce_operator.observed import DaemonSetView, NodeReport, NodeView, ReportedNic
from metaroce_operator.render.common import child_name
from metaroce_operator.status import (
    CONFIGURED_PHASES,
    CleanupView,
    Observed,
    compute_status,
    invalid_status,
    parse_status,
    rollout_settled,
)

V = TypeVar("V")
OS_LABEL = "kubernetes.io/os"


class NotSynced(RuntimeError):
    """Observed state was read before the first list of its kind was complete."""


class PerNetwork(dict[str, V]):
    """One concern's state, by network name: forgotten with the network (see `Store`).

    `on_forget` releases what a value holds (a timer) when its network is forgotten."""

    def __init__(self, on_forget: Callable[[V], None] | None = None) -> None:
        super().__init__()
        self.on_forget = on_forget

    def forget(self, name: str) -> None:
        value = self.pop(name, None)
        if value is not None and self.on_forget is not None:
            self.on_forget(value)

    def replace(self, name: str, value: V, empty: V) -> bool:
        """Set `name`'s value; whether it changed (`empty` stands for no value)."""
        if self.get(name, empty) == value:
            return False
        self[name] = value
        return True


def tables(concern: object) -> list[PerNetwork[Any]]:
    """The per-network tables a concern owns."""
    fields = getattr(concern, "__dict__", {})
    return [v for v in fields.values() if isinstance(v, PerNetwork)]


class Reports:
    """The agents' NodeState reports (from the informer), by network and node.

    Not per network: a report outlives its network until the node pass deletes its
    NodeState. Readable only once the informer's first list is in."""

    def __init__(self, listed: asyncio.Event) -> None:
        self.listed = listed
        self._by_network: dict[str, dict[str, NodeReport]] = {}
        self._keys: dict[str, tuple[str, str]] = {}
        """NodeState name -> (network, node) it was stored under."""

    @property
    def synced(self) -> bool:
        return self.listed.is_set()

    def _gate(self) -> None:
        if not self.synced:
            raise NotSynced("the NodeStates are not listed yet")

    def on_event(
        self, event_type: str | None, body: Mapping[str, Any]
    ) -> tuple[str | None, NodeReport | None]:
        """Store one watch event: (the network a previous report was removed from, the
        report stored). Ungated: the first list itself comes through here."""
        name = (body.get("metadata") or {}).get("name", "")
        old = self._keys.pop(name, None)
        if old is not None:
            self._by_network.get(old[0], {}).pop(old[1], None)
        if event_type == "DELETED":
            return (old[0] if old else None), None
        report = NodeReport.from_body(dict(body))
        if report is not None:
            self._by_network.setdefault(report.network, {})[report.node] = report
            self._keys[name] = (report.network, report.node)
        return (old[0] if old else None), report

    def of(self, network: str) -> Mapping[str, NodeReport]:
        """The network's reports, by node."""
        self._gate()
        return self._by_network.get(network, {})

    def count(self, network: str) -> int:
        """How many reports the network has (ungated: a cheap pre-check only)."""
        return len(self._by_network.get(network, {}))

    def every(self) -> Iterator[tuple[str, Mapping[str, NodeReport]]]:
        """(network, its reports by node), for every network with reports."""
        self._gate()
        return iter(list(self._by_network.items()))

    def orphans(
        self, nodes: Mapping[str, object], live_networks: Set[str], now: datetime, grace: float
    ) -> list[tuple[NodeReport, str]]:
        """(report, "node" or "network") for each NodeState whose node or network no longer
        exists and which is older than `grace` seconds (a fresh one may belong to a node
        or network too new for the lists)."""
        doomed: list[tuple[NodeReport, str]] = []
        for network, by_node in self.every():
            for node, report in by_node.items():
                gone = node not in nodes or network not in live_networks
                age = (now - report.created).total_seconds() if report.created else 1e9
                if gone and age >= grace:
                    doomed.append((report, "node" if node not in nodes else "network"))
        return doomed

    def netdevs(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """network -> node -> the netdevs its agent reports."""
        self._gate()
        return {
            network: {node: r.netdevs for node, r in by_node.items() if r.netdevs}
            for network, by_node in self._by_network.items()
        }

    def nics(self) -> dict[str, dict[str, tuple[ReportedNic, ...]]]:
        """network -> node -> the NICs its agent reports, with their attributes."""
        self._gate()
        return {
            network: {node: r.nics for node, r in by_node.items() if r.nics}
            for network, by_node in self._by_network.items()
        }


class Nodes:
    """The cluster's nodes as of the last node pass, and which each network selects."""

    def __init__(self) -> None:
        self._view: dict[str, NodeView] | None = None
        self.eligible: PerNetwork[frozenset[str]] = PerNetwork()
        """network -> the Linux nodes its nodeSelector matches."""
        self.pod_blocks: PerNetwork[tuple[str, str]] = PerNetwork()
        """network -> (reason, message) when nodes got no block of podNetwork.subnet."""

    def listed(self, nodes: list[NodeView]) -> None:
        self._view = {v.name: v for v in nodes}

    @property
    def synced(self) -> bool:
        return self._view is not None

    def view(self) -> dict[str, NodeView]:
        if self._view is None:
            raise NotSynced("the nodes are not listed yet")
        return self._view

    def names_or_none(self) -> set[str] | None:
        """The node names, or None before the first list (cleanup then waits for the
        reports alone: see cleanup.cleanup_view)."""
        return set(self._view) if self._view is not None else None

    def labels(self) -> dict[str, Mapping[str, str]]:
        return {node: view.labels for node, view in self.view().items()}

    def select(self, name: str, selector: LabelSelector) -> bool:
        """Keep the Linux nodes `selector` matches as the network's eligible nodes;
        whether they changed."""
        eligible = frozenset(
            node
            for node, view in self.view().items()
            if view.labels.get(OS_LABEL) == "linux" and selector_matches(selector, view.labels)
        )
        if self.eligible.get(name) == eligible:
            return False
        self.eligible[name] = eligible
        return True


@dataclass(frozen=True)
class Applied:
    generation: int
    config_generation: int
    config_hash: str


@dataclass(frozen=True)
class ChildEvent:
    """What a watched child's event means for its network."""

    network: str | None = None
    """The network it belongs to (None: not one of the operator's children)."""
    reapply: str = ""
    """Why the network's children must be applied again ('': no need)."""
    status: bool = False
    """Whether the network's status may change (the DaemonSet's rollout counts)."""


def _network_of(
    body: Mapping[str, Any], namespace: str, cluster_scoped_ok: bool = False
) -> str | None:
    """The network a child belongs to: labelled so, named so, in the agents' namespace
    (or cluster-scoped, where `cluster_scoped_ok`)."""
    meta = body.get("metadata") or {}
    network = (meta.get("labels") or {}).get(c.NETWORK_LABEL)
    if not network or meta.get("name") != child_name(network):
        return None
    allowed = (None, namespace) if cluster_scoped_ok else (namespace,)
    return str(network) if meta.get("namespace") in allowed else None


class Children:
    """What this leadership term applied for each network, and how the DaemonSet is.

    The gate: a network not applied in this term (`known`) gets no status computed from
    nothing and no drift repair."""

    def __init__(self) -> None:
        self.applied: PerNetwork[Applied] = PerNetwork()
        self.errors: PerNetwork[tuple[str, str]] = PerNetwork()
        """network -> (reason, message) of an invalid spec or a failed render/apply."""
        self.rendered: PerNetwork[dict[str, dict[str, Any]]] = PerNetwork()
        """network -> kind -> the child last applied (what drift is judged against)."""
        self.rendered_holding: PerNetwork[bool] = PerNetwork()
        """network -> whether its DaemonSet was last applied as `OnDelete` for a hold."""
        self.daemonsets: PerNetwork[DaemonSetView] = PerNetwork()
        """network -> its DaemonSet as last watched."""
        self.policies_checked: PerNetwork[bool] = PerNetwork()
        """Webhook admission mode: networks whose leftover pod policies (from a run in
        policy mode) this process has deleted, once per network."""

    def known(self, name: str) -> bool:
        return name in self.applied

    def on_daemonset(
        self, event_type: str | None, body: Mapping[str, Any], namespace: str
    ) -> ChildEvent:
        """Keep a watched DaemonSet; whether the change calls for a re-apply (deleted,
        its config hash or its owned fields edited: see drift.py)."""
        network = _network_of(body, namespace)
        if network is None:
            return ChildEvent()
        if event_type == "DELETED":
            self.daemonsets.pop(network, None)
            return ChildEvent(network, "its DaemonSet was deleted", status=True)
        view = DaemonSetView.from_body(dict(body), c.CONFIG_HASH_ANNOTATION)
        self.daemonsets[network] = view
        applied = self.applied.get(network)
        rendered = self.rendered.get(network, {}).get("DaemonSet")
        why = ""
        if applied is not None and view.template_hash != applied.config_hash:
            why = "its DaemonSet's config hash was changed"
        elif applied is not None and rendered is not None:
            edited = daemonset_drift(rendered, body)
            if edited:
                why = f"its DaemonSet was edited ({', '.join(edited)})"
        return ChildEvent(network, why, status=True)

    def on_child(
        self, kind: str, event_type: str | None, body: Mapping[str, Any], namespace: str
    ) -> ChildEvent:
        """Whether a watched ConfigMap, ServiceAccount or RBAC object was deleted or
        edited behind the operator's back (a re-apply restores it)."""
        network = _network_of(body, namespace, cluster_scoped_ok=True)
        if network is None:
            return ChildEvent()
        meta = body.get("metadata") or {}
        why = ""
        if event_type == "DELETED":
            why = f"its {kind} was deleted"
        elif kind == "ConfigMap":
            applied = self.applied.get(network)
            digest = (meta.get("annotations") or {}).get(c.CONFIG_HASH_ANNOTATION)
            if applied is not None and digest != applied.config_hash:
                why = "its ConfigMap was changed"
        elif kind in ("ClusterRole", "ClusterRoleBinding"):
            rendered = self.rendered.get(network, {}).get(kind)
            edited = rbac_drift(rendered, body) if rendered is not None else []
            if edited:
                why = f"its {kind} was edited ({', '.join(edited)})"
        return ChildEvent(network, why)

    def record(
        self,
        name: str,
        applied: Applied,
        drift_checked: Mapping[str, dict[str, Any]],
        holding: bool,
    ) -> None:
        self.rendered[name] = dict(drift_checked)
        self.applied[name] = applied
        self.rendered_holding[name] = holding
        self.errors.pop(name, None)


class Conflicts:
    """NIC conflicts between networks (judged from the agents' reports, see conflicts.py)."""

    def __init__(self) -> None:
        self.blocking: PerNetwork[tuple[str, ...]] = PerNetwork()
        """Conflicts that keep the network from Ready."""
        self.yielded: PerNetwork[tuple[str, ...]] = PerNetwork()
        """Conflicts with newer networks whose rollout is held."""
        self.held: PerNetwork[tuple[str, ...]] = PerNetwork()
        """Networks whose rollout waits for a NIC conflict with an older network to go."""

    def judge(
        self,
        valid: Iterable[str],
        found: Mapping[str, Iterable[Conflict]],
        order: Mapping[str, tuple[str, str]],
    ) -> ConflictVerdict:
        """Sort each valid network's conflicts (`found`, see conflicts.find_conflicts)
        by age: a conflict with an older network holds this one's rollout (or blocks its
        Ready when it rolled out before the conflict arose); one with a newer network
        that is held is yielded (Degraded, still Ready); any other blocks. A held network
        with no conflict left with an older one may resume."""
        verdict = ConflictVerdict()
        for name in valid:
            blocking: list[str] = []
            yielded: list[str] = []
            holding: list[str] = []
            for conflict in found.get(name, []):
                if order[conflict.other] < order[name]:
                    holding.append(conflict.held_message())
                    if name not in self.held:  # rolled out before the conflict arose
                        blocking.append(conflict.message())
                elif conflict.other in self.held:
                    yielded.append(conflict.yielded_message())
                else:
                    blocking.append(conflict.message())
            if name in self.held:
                if not holding:
                    verdict.resume.append(name)
                elif self.held.replace(name, tuple(holding), ()):
                    verdict.changed.add(name)
            if self.blocking.replace(name, tuple(blocking), ()):
                verdict.changed.add(name)
                verdict.new_blocking.extend((name, message) for message in blocking)
            if self.yielded.replace(name, tuple(yielded), ()):
                verdict.changed.add(name)
        return verdict

    def hold(self, name: str, held: Iterable[Conflict]) -> tuple[str, ...] | None:
        """Hold the network's rollout for these conflicts; the messages when they are
        new (to log), else None."""
        messages = tuple(conflict.held_message() for conflict in held)
        new = self.held.get(name) != messages
        self.held[name] = messages
        return messages if new else None


@dataclass
class ConflictVerdict:
    """What a re-check of the NIC conflicts found (see `Conflicts.judge`)."""

    resume: list[str] = field(default_factory=list)
    """Held networks whose conflicts with older networks are gone: reconcile them."""
    changed: set[str] = field(default_factory=set)
    """Networks whose conflicts changed: their status may."""
    new_blocking: list[tuple[str, str]] = field(default_factory=list)
    """(network, message) of the blocking conflicts just found (to log)."""


class Taints:
    """The probe taints' bookkeeping (the taints themselves are on the Nodes)."""

    def __init__(self) -> None:
        self.notes: PerNetwork[str] = PerNetwork()
        """network -> what the taint cap held back (shown in status)."""
        self.unhealthy: PerNetwork[frozenset[str]] = PerNetwork()
        """network -> the probe-failing nodes last seen (a change wakes the node pass)."""

    def track(self, name: str, action: str, sick: frozenset[str]) -> bool:
        """Keep the probe-failing nodes of a network that taints (or did); whether they
        changed (the node pass then runs early)."""
        if action != "taint" and not self.unhealthy.get(name):
            return False
        return self.unhealthy.replace(name, sick, frozenset())


def sick_nodes(
    reports: Mapping[str, NodeReport], verdicts: Mapping[str, probes.Verdict]
) -> frozenset[str]:
    """Configured nodes whose probes say unhealthy (a node not configured is not judged)."""
    return frozenset(
        node
        for node, r in reports.items()
        if r.phase in CONFIGURED_PHASES and not verdicts[node].healthy
    )


class Upgrades:
    """The upgrade policy's state (upgrade.py)."""

    def __init__(self) -> None:
        self.holds: PerNetwork[tuple[upgrade.Hold, ...]] = PerNetwork()
        """network -> its nodes' holds of agent updates."""


class Claims:
    """Networks claimed by another operator (see claim.py)."""

    def __init__(self) -> None:
        self.foreign: PerNetwork[str] = PerNetwork()
        """network -> the claimant's Lease."""


class NodeLabels:
    """The network's node label (nodelabels.py): when a node was asked to revert."""

    def __init__(self) -> None:
        self.revert_asked: PerNetwork[dict[str, float]] = PerNetwork()
        """network -> node -> when its label asked the agent to revert (monotonic)."""

    def timed_out(self, name: str, clock: float, timeout: float) -> frozenset[str]:
        """Nodes asked to revert more than `timeout` seconds ago (let go)."""
        asked = self.revert_asked.get(name, {})
        return frozenset(node for node, since in asked.items() if clock - since > timeout)

    def labelled(self, name: str, node: str, value: str | None, clock: float) -> None:
        """Note a label just set: `revert` starts the node's clock, anything else ends it."""
        asked = self.revert_asked.setdefault(name, {})
        if value == c.NODE_REVERT:
            asked.setdefault(node, clock)
        else:
            asked.pop(node, None)


class Cleanup:
    """The cleanup finalizer's wait: one re-check timer per deleting network."""

    def __init__(self) -> None:
        self.timers: PerNetwork[asyncio.TimerHandle] = PerNetwork(
            on_forget=lambda timer: timer.cancel()
        )

    def recheck_at(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        self.timers.forget(name)
        self.timers[name] = asyncio.get_running_loop().call_later(delay, callback)

    def close(self) -> None:
        for name in list(self.timers):
            self.timers.forget(name)


@dataclass(frozen=True)
class StatusUpdate:
    new: MetaRoceNetworkStatus
    previous: MetaRoceNetworkStatus | None
    network: MetaRoceNetwork | None
    """The validated network (None: its spec is invalid)."""


class Store:
    """Everything the leader knows, by concern."""

    def __init__(self, nodestates_listed: asyncio.Event | None = None) -> None:
        self.bodies = NetworkBodies()
        self.networks: dict[str, dict[str, Any]] = self.bodies.bodies
        self.reports = Reports(nodestates_listed or asyncio.Event())
        self.nodes = Nodes()
        self.children = Children()
        self.conflicts = Conflicts()
        self.taints = Taints()
        self.upgrades = Upgrades()
        self.claims = Claims()
        self.labels = NodeLabels()
        self.cleanup = Cleanup()

    def concerns(self) -> list[object]:
        return [v for v in vars(self).values() if tables(v)]

    def set_network(self, body: dict[str, Any]) -> bool:
        """Keep the newest body (see `freshness`: resourceVersions are never compared)."""
        return self.bodies.from_watch(body)

    def wrote_status(self, body: dict[str, Any]) -> None:
        """Keep the response of the leader's own status write."""
        self.bodies.from_write(body)

    def status_of(self, name: str) -> dict[str, Any] | None:
        """The network's status as the leader last knows it (its own write until the
        watch echoes it)."""
        return self.bodies.status(name)

    def observed(
        self,
        name: str,
        network: MetaRoceNetwork,
        error: tuple[str, str] | None = None,
        cleanup: CleanupView | None = None,
    ) -> Observed:
        """Everything the network's status is computed from (see status.compute_status)."""
        applied = self.children.applied.get(name)
        reports = self.reports.of(name)
        holds = self.upgrades.holds.get(name, ())
        return Observed(
            network=network,
            applied_generation=applied.generation if applied else None,
            config_generation=applied.config_generation if applied else None,
            daemonset=self.children.daemonsets.get(name),
            reports=reports,
            verdicts=probes.judge(reports, network.spec.health.probe),
            eligible=self.nodes.eligible.get(name),
            conflicts=self.conflicts.blocking.get(name, ()),
            held=self.conflicts.held.get(name, ()),
            yielded=self.conflicts.yielded.get(name, ()),
            taint_note=self.taints.notes.get(name, ""),
            agent_update=upgrade.update_status(network.spec.agent.update_strategy.paused, holds),
            holding=upgrade.holding(holds),
            cleanup=cleanup,
            error=error,
            pod_network=self.nodes.pod_blocks.get(name),
        )

    def next_status(self, name: str, body: Mapping[str, Any], now: datetime) -> StatusUpdate | None:
        """The status a live network should show now, beside the one it shows; None
        while it was not reconciled in this term (a status from nothing would flap)."""
        error = self.children.errors.get(name)
        if not self.children.known(name) and error is None and name not in self.conflicts.held:
            return None
        previous = parse_status(self.status_of(name))
        try:
            network = validate_network(dict(body))
        except InvalidObject as err:
            generation = int((body.get("metadata") or {}).get("generation") or 0)
            reason, message = error or (c.REASON_INVALID_SPEC, str(err))
            new = invalid_status(previous, generation, reason, message, now)
            return StatusUpdate(new, previous, None)
        return StatusUpdate(
            compute_status(self.observed(name, network, error), previous, now), previous, network
        )

    def completes_rollout(self, name: str) -> bool:
        """Whether the report just stored is the last one a rollout waited for, and the
        written status does not show that yet: then Ready is written at once rather than
        an interval later. Once per rollout, so still no status write per node event."""
        applied = self.children.applied.get(name)
        if applied is None or name in self.conflicts.held or not self.reports.synced:
            return False  # before the first list, the status loop waits anyway
        ds = self.children.daemonsets.get(name)
        eligible = self.nodes.eligible.get(name)
        if ds is not None and ds.observed_current:
            desired = ds.desired
        elif eligible is not None:
            desired = len(eligible)
        else:
            return False
        if self.reports.count(name) < desired:  # the common case in a rollout: O(1)
            return False
        reports = self.reports.of(name)
        shown = (self.status_of(name) or {}).get("nodes") or {}
        if int(shown.get("configured") or 0) + int(shown.get("failed") or 0) >= desired:
            return False
        return rollout_settled(reports, applied.config_generation, desired, eligible)

    def forget_network(self, name: str) -> None:
        """Drop everything kept for a deleted network (not its reports: the node pass
        deletes its NodeStates, and they go with their watch events)."""
        self.bodies.forget(name)
        for concern in self.concerns():
            for table in tables(concern):
                table.forget(name)
