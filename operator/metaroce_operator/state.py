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

The objects hold state and its bookkeeping only; the controller does the I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from metaroce_operator import upgrade
from metaroce_operator.freshness import NetworkBodies
from metaroce_operator.observed import DaemonSetView, NodeReport, NodeView, ReportedNic

V = TypeVar("V")


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


@dataclass(frozen=True)
class Applied:
    generation: int
    config_generation: int
    config_hash: str


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


class Taints:
    """The probe taints' bookkeeping (the taints themselves are on the Nodes)."""

    def __init__(self) -> None:
        self.notes: PerNetwork[str] = PerNetwork()
        """network -> what the taint cap held back (shown in status)."""
        self.unhealthy: PerNetwork[frozenset[str]] = PerNetwork()
        """network -> the probe-failing nodes last seen (a change wakes the node pass)."""


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

    def forget_network(self, name: str) -> None:
        """Drop everything kept for a deleted network (not its reports: the node pass
        deletes its NodeStates, and they go with their watch events)."""
        self.bodies.forget(name)
        for concern in self.concerns():
            for table in tables(concern):
                table.forget(name)
