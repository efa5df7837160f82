"""The leader's node pass: what is decided over all nodes rather than per event.

Periodic (`housekeeping_interval`), and early when kicked (a held network may resume, the
probe-failing nodes changed): it lists the nodes (the `Nodes` gate opens with the first
list), garbage-collects NodeStates of nodes and networks that are gone and the agents of
networks that are gone, re-checks NIC conflicts between networks (resuming a held
rollout once its conflict is gone), takes over networks whose claimant is gone, and,
per network this operator holds, sets its node labels and probe taints and runs the
upgrade policy. The decisions are the concerns' (see `state`); this does their I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from metaroce_api import InvalidObject, MetaRoceNetwork, parse_duration, validate_network
from metaroce_api import constants as c
from metaroce_api.failpoints import failpoint
from metaroce_api.podnet import (
    BLOCK_ANNOTATION_PREFIX,
    NAD_API_VERSION,
    NAD_KIND,
    block_annotation,
    nad_name,
)
from metaroce_operator import cleanup, metrics, probes, taints, upgrade
from metaroce_operator.claim import Claimer
from metaroce_operator.conflicts import created_order, find_conflicts
from metaroce_operator.kube import KINDS, ApiError, Kube, NotLeader
from metaroce_operator.nodelabels import orphaned_labels, plan_labels
from metaroce_operator.observed import NodeView
from metaroce_operator.podblocks import plan_blocks, too_small_message
from metaroce_operator.render.common import child_name, selector_labels
from metaroce_operator.render.nad import wants_nad
from metaroce_operator.settings import OperatorSettings
from metaroce_operator.state import Store, sick_nodes
from metaroce_operator.status import now_utc

log = logging.getLogger("metaroce.operator.nodepass")

NETWORK = KINDS[(c.API_VERSION, c.NETWORK_KIND)]
NODESTATE = KINDS[(c.API_VERSION, c.NODESTATE_KIND)]
NODE = KINDS[("v1", "Node")]
POD = KINDS[("v1", "Pod")]
CLUSTERROLE = KINDS[("rbac.authorization.k8s.io/v1", "ClusterRole")]
DAEMONSET = KINDS[("apps/v1", "DaemonSet")]
CONTROLLER_REVISION = KINDS[("apps/v1", "ControllerRevision")]
NAD = KINDS[(NAD_API_VERSION, NAD_KIND)]


class NodePass:
    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        store: Store,
        claims: Claimer,
        *,
        mark: Callable[[str], None],
        reconcile_later: Callable[[str, str], None],
        reconcile_soon: Callable[[str], None],
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.store = store
        self.claims = claims
        self.mark = mark
        """Recompute the network's status (the status batching)."""
        self.reconcile_later = reconcile_later
        """Re-apply a network's children (if known in this term), saying why."""
        self.reconcile_soon = reconcile_soon
        """Reconcile a network now (a held one resuming, one taken over)."""
        self.kick = asyncio.Event()
        """Set to run the next pass now rather than at the interval."""

    async def run(self) -> None:
        """Pass now (soon after the term starts), then every housekeeping interval or when
        kicked, until cancelled."""
        await asyncio.sleep(min(2.0, self.settings.housekeeping_interval))
        while True:
            try:
                await self.node_pass()
            except NotLeader:
                raise
            except Exception as err:
                metrics.ERRORS.labels(where="nodes").inc()
                log.warning("node pass failed: %s", err)
            self.kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.kick.wait(), self.settings.housekeeping_interval)

    async def node_pass(self) -> None:
        node_bodies = await self.kube.list_items(NODE, cached=True)
        self.store.nodes.listed([NodeView.from_body(b) for b in node_bodies])
        live_networks = {
            b["metadata"]["name"] for b in await self.kube.list_items(NETWORK, cached=True)
        }
        await self._collect_garbage(live_networks)
        # Known from the list or from a watch event: a network created a moment ago may be
        # missing from the (watch-cache) list; its children and fresh taints are no orphans.
        known = live_networks | set(self.store.networks)
        await self._collect_orphaned_children(known)
        valid: dict[str, MetaRoceNetwork] = {}
        for name, body in self.store.networks.items():
            if cleanup.deleting(body):
                continue
            with contextlib.suppress(InvalidObject):
                valid[name] = validate_network(body)
        for name in await self.claims.take_over_gone():
            self.reconcile_soon(name)
        labels = self.store.nodes.labels()
        for name, network in valid.items():
            if self.store.nodes.select(name, network.spec.node_selector):
                self.mark(name)
        self._check_conflicts(valid, labels)
        await self._remove_orphaned_taints(known)
        await self._remove_orphaned_labels(known)
        await self._remove_orphaned_blocks(known)
        for name, network in valid.items():
            if self.claims.mine(self.store.networks.get(name) or {}):
                await self._node_labels(name, network)
                await self._pod_blocks(name, network)
                await self._taints(name, network, known)
                await self._agent_updates(name, network, labels)

    async def _agent_updates(
        self, name: str, network: MetaRoceNetwork, labels: Mapping[str, Mapping[str, str]]
    ) -> None:
        """The upgrade policy (upgrade.py): read the nodes' holds; switch the DaemonSet
        between RollingUpdate and OnDelete as they come and go; while a node holds, replace
        the other nodes' outdated agents, maxUnavailable at a time."""
        strategy = network.spec.agent.update_strategy
        holds = upgrade.read_holds(
            self.store.nodes.eligible.get(name, frozenset()),
            labels,
            now_utc(),
            parse_duration(strategy.max_hold),
        )
        if self.store.upgrades.holds.replace(name, holds, ()):
            self.mark(name)
        held = upgrade.holding(holds)
        rendered = self.store.children.rendered_holding.get(name)
        step = upgrade.next_step(held, rendered, strategy.paused)
        if step == "reapply":
            why = "a node holds off agent updates" if held else "no node holds agent updates"
            self.reconcile_later(name, why)
        elif step == "replace":
            await self._replace_outdated_agents(name, network, held)

    async def _replace_outdated_agents(
        self, name: str, network: MetaRoceNetwork, held: frozenset[str]
    ) -> None:
        namespace = self.settings.render.namespace
        ds = await self.kube.get_or_none(DAEMONSET, child_name(name), namespace)
        if ds is None:
            return
        selector = ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))
        revisions = await self.kube.list_items(
            CONTROLLER_REVISION, namespace, label_selector=selector
        )
        revision = upgrade.current_revision(revisions, str(ds["metadata"]["uid"]))
        if revision is None:
            return
        pods = [
            upgrade.AgentPod.from_body(p)
            for p in await self.kube.list_items(POD, namespace, label_selector=selector)
        ]
        nodes = self.store.nodes.eligible.get(name, frozenset())
        strategy = network.spec.agent.update_strategy
        budget = upgrade.scaled_max_unavailable(strategy.max_unavailable, len(nodes))
        min_ready = float((ds.get("spec") or {}).get("minReadySeconds") or 0)
        for pod in upgrade.pods_to_replace(
            pods, revision, nodes, held, budget, now_utc(), min_ready
        ):
            if await self.kube.delete(POD, pod, namespace):
                log.info("%s: replaced the outdated agent %s (other nodes hold updates)", name, pod)

    async def _node_labels(self, name: str, network: MetaRoceNetwork) -> None:
        """The network's node label on the nodes it selects, and off those that left
        once their agent reverted them (with cleanupOnDelete; see nodelabels.py)."""
        label = c.node_label(name)
        labels = self.store.nodes.labels()
        phases = {node: r.phase for node, r in self.store.reports.of(name).items()}
        clock = time.monotonic()
        timed_out = self.store.labels.timed_out(name, clock, self.settings.cleanup_timeout)
        plan = plan_labels(
            label,
            self.store.nodes.eligible.get(name, frozenset()),
            labels,
            phases,
            network.spec.cleanup_on_delete,
            timed_out,
        )
        for node, value in plan.items():
            await self._set_node_label(node, label, value)
            failpoint("labels.after_set")
            self.store.labels.labelled(name, node, value, clock)
            if value == c.NODE_REVERT:
                log.info("%s: node %s left the network: asked its agent to revert it", name, node)
            elif value is None:
                why = "timed out reverting" if node in timed_out else "left the network"
                log.info("%s: node %s %s: its agent goes", name, node, why)

    async def _pod_blocks(self, name: str, network: MetaRoceNetwork) -> None:
        """Each node of the network its block of podNetwork.subnet, as the node annotation
        its agent reads (podblocks.py); a subnet too small for the nodes is Degraded."""
        key = block_annotation(name)
        view = self.store.nodes.view()
        current = {n: v.annotations[key] for n, v in view.items() if key in v.annotations}
        pod_network = network.spec.attachment.pod_network
        if pod_network is None or not wants_nad(network):
            for node in current:
                await self._set_node_annotation(node, key, None)
            self.store.nodes.pod_blocks.pop(name, None)
            return
        label = c.node_label(name)
        members = set(self.store.nodes.eligible.get(name, frozenset())) | {
            n for n, v in view.items() if label in v.labels
        }
        plan = plan_blocks(pod_network, members, current)
        for node, value in plan.changes.items():
            await self._set_node_annotation(node, key, value)
            if value is not None:
                log.info("%s: node %s gets the pod block %s", name, node, value)
        await self._nad_present(name)
        problem = None
        if plan.unassigned:
            problem = (
                c.REASON_POD_SUBNET_TOO_SMALL,
                too_small_message(pod_network, len(members), set(plan.unassigned)),
            )
        if self.store.nodes.pod_blocks.get(name) != problem:
            if problem is None:
                self.store.nodes.pod_blocks.pop(name, None)
            else:
                self.store.nodes.pod_blocks[name] = problem
                log.warning("%s: %s", name, problem[1])
            self.mark(name)

    async def _nad_present(self, name: str) -> None:
        """The network's NetworkAttachmentDefinition is a child no informer watches (its
        kind is served only where Multus is installed): one read per pass puts back one
        deleted by hand, as the informers do for the other children."""
        if not self.store.children.known(name):
            return  # not applied in this term yet: the reconcile makes it
        namespace = self.settings.render.namespace
        if await self.kube.get_or_none(NAD, nad_name(name), namespace) is None:
            self.reconcile_later(name, "its NetworkAttachmentDefinition is gone")

    async def _remove_orphaned_blocks(self, live_networks: set[str]) -> None:
        """Pod-block annotations of networks that are gone."""
        prefix = BLOCK_ANNOTATION_PREFIX + "/"
        for node, view in self.store.nodes.view().items():
            for key in view.annotations:
                if key.startswith(prefix) and key[len(prefix) :] not in live_networks:
                    await self._set_node_annotation(node, key, None)
                    log.info("removed the pod block %s of a deleted network from %s", key, node)

    async def _set_node_annotation(self, node: str, key: str, value: str | None) -> None:
        await self._patch_node_metadata(node, "annotations", key, value)

    async def _set_node_label(self, node: str, label: str, value: str | None) -> None:
        await self._patch_node_metadata(node, "labels", label, value)

    async def _patch_node_metadata(
        self, node: str, field: str, key: str, value: str | None
    ) -> None:
        """Set (or, with None, remove) one label or annotation of a node."""
        try:
            await self.kube.patch(NODE, node, {"metadata": {field: {key: value}}})
        except ApiError as err:
            if err.status != 404:  # a node deleted meanwhile has nothing to keep
                raise

    async def _remove_orphaned_labels(self, live_networks: set[str]) -> None:
        """Node labels of networks that are gone (after their agents, see nodelabels.py)."""
        labels = self.store.nodes.labels()
        live = {c.node_label(n) for n in live_networks}
        for node, gone in orphaned_labels(labels, live).items():
            for label in gone:
                await self._set_node_label(node, label, None)
                failpoint("labels.after_orphan_removed")
                log.info("removed the label %s of a deleted network from node %s", label, node)

    async def _remove_orphaned_taints(self, live_networks: set[str]) -> None:
        """Taints of networks that are gone (the network's own planning stops with it)."""
        orphaned = taints.orphaned_taints(self.store.nodes.view(), live_networks)
        for node, network in orphaned.items():
            failpoint("taints.before_orphan_removed")
            if await taints.set_taint(self.kube, node, network, False):
                log.info("removed the taint of deleted network %s from node %s", network, node)

    def _check_conflicts(
        self, valid: dict[str, MetaRoceNetwork], labels: Mapping[str, Mapping[str, str]]
    ) -> None:
        """Re-check NIC conflicts; resume the rollout of a held network whose conflicts
        with older networks are gone."""
        contenders = dict(valid)
        for name, body in self.store.networks.items():
            if name not in contenders and cleanup.deleting(body):
                with contextlib.suppress(InvalidObject):
                    contenders[name] = validate_network(body)  # owns its NICs until gone
        order = {name: created_order(self.store.networks.get(name) or {}) for name in contenders}
        reports = self.store.reports
        found = find_conflicts(contenders.values(), labels, reports.netdevs(), reports.nics())
        verdict = self.store.conflicts.judge(valid, found, order)
        for name in verdict.resume:
            log.info("%s: its NIC conflict is gone; resuming the rollout", name)
            self.reconcile_soon(name)
        for name, message in verdict.new_blocking:
            log.warning("%s: NIC conflict: %s", name, message)
        for name in verdict.changed:
            self.mark(name)

    async def _collect_garbage(self, live_networks: set[str]) -> None:
        nodes = self.store.nodes.view()
        grace = self.settings.nodestate_grace
        for report, why in self.store.reports.orphans(nodes, live_networks, now_utc(), grace):
            if await self.kube.delete(NODESTATE, report.name, uid=report.uid or None):
                log.info("deleted NodeState %s: its %s no longer exists", report.name, why)

    async def _collect_orphaned_children(self, live: set[str]) -> None:
        """Delete the anchor ClusterRole of a network that is gone (its finalizer removed
        by hand, or the operator down while it went): the garbage collector then takes
        the agents and the rest. Children owned by a network are the collector's."""
        selector = f"{c.MANAGED_BY_LABEL}={c.MANAGED_BY},{c.COMPONENT_LABEL}={c.COMPONENT_AGENT}"
        roles = await self.kube.list_items(CLUSTERROLE, label_selector=selector, cached=True)
        grace = self.settings.nodestate_grace
        for name, uid, network in cleanup.orphaned_anchors(roles, live, now_utc(), grace):
            if await self.kube.delete(CLUSTERROLE, name, uid=uid):
                log.info("deleted the agents of network %s, which no longer exists", network)

    async def delete_nodestates(self, network: str) -> None:
        """One request for all of them (agents label their NodeStates); an unlabelled
        straggler is collected by the node pass once its network is gone."""
        await self.kube.delete_collection(NODESTATE, label_selector=f"{c.NETWORK_LABEL}={network}")
        log.info("deleted the NodeStates of %s", network)

    async def _taints(self, name: str, network: MetaRoceNetwork, live: set[str]) -> None:
        health = network.spec.health
        reports = self.store.reports.of(name)
        sick = sick_nodes(reports, probes.judge(reports, health.probe))
        members = set(self.store.nodes.eligible.get(name) or reports)
        plan = taints.plan_taints(
            name,
            health.action,
            health.max_tainted_fraction,
            members,
            sick,
            self.store.nodes.view(),
            live=live,
        )
        if not plan.empty:
            changed = await taints.apply_plan(self.kube, name, plan)
            metrics.TAINT_CHANGES.labels(network=name).inc(changed)
        note = plan.note(health.max_tainted_fraction, len(members))
        if self.store.taints.notes.replace(name, note, ""):
            self.mark(name)
