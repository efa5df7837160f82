"""The leader's work: reconcile networks, aggregate their status, and the node pass.

One `Controller` lives for one leadership term, on the main event loop. kopf (on its own
thread, see `kopfrun`) feeds it network events and calls `reconcile`; its own
`Informer`s feed it NodeStates and the children. Everything it writes goes through a
`Kube` view whose write gate closes the moment the lease is lost. What it knows is kept
in `state`, one object per concern (children, reports, nodes, conflicts, taints,
upgrades, claims, node labels, cleanup): each owns its tables, which are forgotten with
their network, and the observed ones refuse to be read before their first list
(`state.NotSynced`).

- reconcile: validate, render, server-side apply every child (ConfigMap before the
  DaemonSet), the cleanup finalizer; deterministic, so a restart re-applies no-ops.
- status: watch events only mark a network dirty; `BatchLoop` computes its status at
  most once per interval and writes only when it differs (idle = no writes).
- node pass (periodic, `nodepass.NodePass`): garbage-collects NodeStates of nodes and
  networks that are gone, re-checks NIC conflicts between networks (resuming a held
  rollout once its conflict is gone), sets node labels and probe taints.
- the claim (one operator per network): `claim.Claimer`.

The decisions that need no I/O are the concerns' own (`state`, and plain functions in
`cleanup`, `upgrade`, `apply`); this module and `nodepass` do their I/O.
- NIC conflicts: a network that conflicts with an older one is held: its children are
  not applied (no DaemonSet onto the contested NICs) until the conflict is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Coroutine, Mapping
from typing import Any

from metaroce_api import InvalidObject, MetaRoceNetwork, validate_network
from metaroce_api import constants as c
from metaroce_api.failpoints import failpoint
from metaroce_api.podnet import NAD_API_VERSION, NAD_CRD, NAD_PLURAL
from metaroce_operator import cleanup, events, metrics, probes, upgrade
from metaroce_operator.apply import ApplyFailed, apply_children, failure_status
from metaroce_operator.claim import Claimer
from metaroce_operator.conflicts import (
    Conflict,
    created_order,
    holding_conflicts,
)
from metaroce_operator.images import image_refusal
from metaroce_operator.informer import Informer
from metaroce_operator.kube import KINDS, ApiError, Kube, NotLeader
from metaroce_operator.nodepass import NodePass
from metaroce_operator.observed import (
    NodeView,
)
from metaroce_operator.probekey import ensure_probe_key, probe_key_secret
from metaroce_operator.render import RenderContext, config_generation, render_network
from metaroce_operator.render.common import (
    agent_config,
    anchor_kind,
    child_name,
    config_hash,
)
from metaroce_operator.render.nad import wants_nad
from metaroce_operator.render.podpolicy import policy_name
from metaroce_operator.settings import OperatorSettings
from metaroce_operator.state import Applied, Store, sick_nodes
from metaroce_operator.status import (
    BatchLoop,
    compute_status,
    now_utc,
    parse_status,
    same_status,
    transition_events,
)

log = logging.getLogger("metaroce.operator.controller")

NETWORK = KINDS[(c.API_VERSION, c.NETWORK_KIND)]
LEASE = KINDS[("coordination.k8s.io/v1", "Lease")]
NODESTATE = KINDS[(c.API_VERSION, c.NODESTATE_KIND)]
CONFIGMAP = KINDS[("v1", "ConfigMap")]
CLUSTERROLE = KINDS[("rbac.authorization.k8s.io/v1", "ClusterRole")]
CLUSTERROLEBINDING = KINDS[("rbac.authorization.k8s.io/v1", "ClusterRoleBinding")]
NAMESPACE = KINDS[("v1", "Namespace")]
NODE = KINDS[("v1", "Node")]
POD = KINDS[("v1", "Pod")]
DAEMONSET = KINDS[("apps/v1", "DaemonSet")]
CONTROLLER_REVISION = KINDS[("apps/v1", "ControllerRevision")]
POD_POLICY = KINDS[("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicy")]
POD_POLICY_BINDING = KINDS[("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicyBinding")]
DRIFT_CHECKED = ("DaemonSet", "ClusterRole", "ClusterRoleBinding")
"""Children whose owned fields are compared with each watch event (see `drift`)."""
WATCHED_CHILDREN = (
    DAEMONSET,
    CONFIGMAP,
    KINDS[("v1", "ServiceAccount")],
    CLUSTERROLE,
    CLUSTERROLEBINDING,
)
"""Children watched for drift and for the DaemonSet's rollout (labelled as ours)."""
CHILD_KINDS = frozenset(kind.kind for kind in WATCHED_CHILDREN)


def _after_child(kind: str) -> None:
    """Failpoints (see metaroce_api.failpoints) after each child applied: any child, and
    the ConfigMap and DaemonSet by name (the restart tests kill there)."""
    failpoint("rollout.after_child")  # between child kinds (the fault tier)
    if kind == "ConfigMap":
        failpoint("rollout.after_configmap")
    elif kind == "DaemonSet":
        failpoint("rollout.after_daemonset")


class PermanentFailure(Exception):
    """The spec cannot be reconciled as it is; retrying will not help until it changes."""


class MultusMissing(Exception):
    """The network's pods need Multus, whose CRD is not served: nothing is applied, and
    kopf retries (Multus may be installed any time)."""


class Controller:
    def __init__(self, kube: Kube, settings: OperatorSettings) -> None:
        self.kube = kube
        self.settings = settings
        self.batch = BatchLoop(self.flush, settings.status_interval, on_error=self._flush_error)
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        """Per network, kept for the term (a lock forgotten while held would not exclude)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self.nodestates = Informer(
            self.kube, NODESTATE, lambda t, body: self.on_event(c.NODESTATE_KIND, t, body)
        )
        self.store = Store(self.nodestates.synced)
        self.claims = Claimer(
            self.kube,
            self.store,
            f"{settings.lease_namespace}/{settings.lease_name}",
            settings.identity,
        )
        self.nodepass = NodePass(
            self.kube,
            settings,
            self.store,
            self.claims,
            mark=self.batch.mark,
            reconcile_later=self._reconcile_later,
            reconcile_soon=self._reconcile_soon,
        )
        # The children, on this loop and this client like the NodeStates (kopf watched
        # them before, on its thread, as an event pump that wrote nothing).
        self.children = [
            Informer(
                self.kube,
                kind,
                functools.partial(self.on_event, kind.kind),
                namespace=settings.render.namespace if kind.namespaced else None,
                label_selector=f"{c.MANAGED_BY_LABEL}={c.MANAGED_BY}",
                failpoint_name=f"informer.{kind.plural}.before_list",
            )
            for kind in WATCHED_CHILDREN
        ]

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        """Whether the NodeState informer's first list is complete. Until then the store
        knows no report, and "no report" must not be read as "nothing configured" or
        "every node reverted": status, cleanup, conflicts, taints and the garbage
        collection of NodeStates all wait for it."""
        return self.store.reports.synced

    async def run(self) -> None:
        """The NodeState and children watches, then (once the NodeStates' first list is
        in) the status loop and the node pass, until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.nodestates.run(), name="NodeState watch")
            for informer in self.children:
                group.create_task(informer.run(), name=f"{informer.kind.kind} watch")
            group.create_task(self._after_sync(self.batch.run()), name="status batching")
            group.create_task(self._after_sync(self.nodepass.run()), name="node pass")

    async def _after_sync(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await self._wait_synced()
        except BaseException:
            work.close()
            raise
        await work

    async def _wait_synced(self) -> None:
        waited = 0.0
        while not self.synced:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.nodestates.synced.wait(), 30.0)
            if not self.synced:
                waited += 30.0
                log.warning(
                    "the NodeStates are not listed yet (%.0f s): status, cleanup, taints and "
                    "NIC conflicts wait for them (see the watch errors above)",
                    waited,
                )

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.store.cleanup.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, NotLeader):
            metrics.ERRORS.labels(where="background").inc()
            log.error("%s failed: %s", task.get_name(), exc)

    def _flush_error(self, name: str, exc: BaseException) -> None:
        if isinstance(exc, NotLeader):
            return
        metrics.ERRORS.labels(where="status").inc()
        log.warning("status of %s: %s (retrying)", name, exc)

    # -- watch events (called on the main loop, in order) ---------------------------------

    def on_event(self, kind: str, event_type: str | None, body: dict[str, Any]) -> None:
        if kind == c.NETWORK_KIND:
            self._network_event(event_type, body)
        elif kind == c.NODESTATE_KIND:
            was, report = self.store.reports.on_event(event_type, body)
            if was is not None:
                self.batch.mark(was)
            if report is not None:
                urgent = self.store.completes_rollout(report.network)
                self.batch.mark(report.network, urgent=urgent)
        elif kind in CHILD_KINDS:
            children, namespace = self.store.children, self.settings.render.namespace
            if kind == "DaemonSet":
                event = children.on_daemonset(event_type, body, namespace)
            else:
                event = children.on_child(kind, event_type, body, namespace)
            if event.network is not None and event.reapply:
                self._reconcile_later(event.network, event.reapply)
            if event.network is not None and event.status:
                self.batch.mark(event.network)

    def _network_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        if event_type == "DELETED":
            self.store.forget_network(name)
            self.batch.forget(name)
            metrics.forget_network(name)
            self._spawn(self.nodepass.delete_nodestates(name), f"delete NodeStates of {name}")
            if self.store.conflicts.held:
                self.nodepass.kick.set()  # a held network may resume now
            return
        old = self.store.networks.get(name)
        if self.store.set_network(body):
            self.batch.mark(name)
            generation = (old or {}).get("metadata", {}).get("generation")
            if self.store.conflicts.held and generation != body["metadata"].get("generation"):
                self.nodepass.kick.set()  # a changed spec may end the conflict holding another

    def _reconcile_later(self, name: str, why: str) -> None:
        body = self.store.networks.get(name)
        if body is None or cleanup.deleting(body) or not self.store.children.known(name):
            return
        log.info("re-applying the children of %s: %s", name, why)
        self._spawn(self._reconcile_retrying(name), f"reconcile {name}")

    def _reconcile_soon(self, name: str) -> None:
        self._spawn(self._reconcile_retrying(name), f"reconcile {name}")

    async def _reconcile_retrying(self, name: str) -> None:
        for attempt in range(5):
            # Fresh from the apiserver: a DaemonSet deleted by garbage collection may be
            # seen before its network's own DELETED event.
            body = await self.kube.get_or_none(NETWORK, name)
            if body is None or cleanup.deleting(body):
                return
            try:
                await self.reconcile(body)
                return
            except (PermanentFailure, NotLeader):
                return
            except Exception as err:
                log.warning("reconcile of %s failed (%s), retrying", name, err)
                await asyncio.sleep(2.0 * (attempt + 1))

    # -- the claim (one operator per network, see `claim`) ---------------------------------

    def _mine(self, body: Mapping[str, Any]) -> bool:
        return self.claims.mine(body)

    # -- reconcile ------------------------------------------------------------------------

    async def reconcile(self, body: dict[str, Any]) -> None:
        """Render and apply the children of one network (idempotent)."""
        name = body["metadata"]["name"]
        await self._wait_synced()  # NIC conflicts are judged from the reported netdevs too
        async with self._locks[name]:
            if cleanup.deleting(body):
                return
            loop = asyncio.get_running_loop()
            started = loop.time()
            result = "error"
            try:
                await self._reconcile(name, body)
                result = "success"
            except PermanentFailure:
                result = "invalid"
                raise
            except NotLeader:
                result = "not-leader"
                raise
            finally:
                metrics.RECONCILES.labels(network=name, result=result).inc()
                metrics.RECONCILE_SECONDS.observe(loop.time() - started)
                if result == "error":
                    metrics.ERRORS.labels(where="reconcile").inc()

    async def _reconcile(self, name: str, body: dict[str, Any]) -> None:
        self.store.set_network(body)
        if not await self.claims.claim(name, body):
            return  # another operator's network: no children, status, taints or cleanup
        try:
            network = validate_network(body)
        except InvalidObject as err:
            self._fail(name, c.REASON_INVALID_SPEC, str(err))
            raise PermanentFailure(str(err)) from None
        refusal = image_refusal(network, self.settings.render.allowed_agent_images)
        if refusal:
            self._fail(name, c.REASON_AGENT_IMAGE_NOT_ALLOWED, refusal)
            raise PermanentFailure(refusal)
        if wants_nad(network) and not await self._multus_served():
            pod_network = network.spec.attachment.pod_network
            assert pod_network is not None
            message = (
                f"spec.attachment.podNetwork.mode {pod_network.mode} needs Multus, and its "
                f"NetworkAttachmentDefinition CRD ({NAD_CRD}) is not served: install Multus "
                "(thin plugin, v4) with its CRD, or set podNetwork.mode: hostNetwork; nothing "
                "of this network is applied until then"
            )
            self._fail(name, c.REASON_MULTUS_MISSING, message)
            raise MultusMissing(message)
        generation = network.metadata.generation or 0
        held = await self._holding_conflicts(name, network)
        if held:
            await self._hold(name, body, held)
            return
        if self.store.conflicts.held.pop(name, None) is not None:
            log.info("%s: its NIC conflict is gone; rolling out", name)
        namespace = self.settings.render.namespace
        digest = config_hash(agent_config(network))
        existing = await self.kube.get_or_none(CONFIGMAP, child_name(name), namespace)
        config_gen = config_generation(digest, generation, existing)
        wants = cleanup.wants_finalizer(body)
        has = c.CLEANUP_FINALIZER in cleanup.finalizers(body)
        if wants and not has:
            # First: a child that exists without it would be collected unreverted if the
            # network were deleted before the finalizer came.
            await cleanup.set_finalizer(self.kube, name, True, c.FIELD_MANAGER)
            failpoint("rollout.after_finalizer")
        holding = bool(upgrade.holding(self.store.upgrades.holds.get(name, ())))
        children = render_network(
            network, self.settings.render, config_generation=config_gen, nodes_holding=holding
        )
        if network.spec.cleanup_on_delete and network.metadata.uid:
            # The anchor (the ClusterRole, or the ClusterRoleBinding with the chart's shared
            # ClusterRole) owns the other children and the namespace owns it (see
            # render.common.anchor_references): apply it first, then the rest with its uid.
            ns = await self.kube.get_or_none(NAMESPACE, namespace)
            ns_uid = str(((ns or {}).get("metadata") or {}).get("uid") or "") or None
            anchored = functools.partial(
                render_network,
                network,
                self.settings.render,
                config_generation=config_gen,
                namespace_uid=ns_uid,
                nodes_holding=holding,
            )
            role = await self._apply(name, anchored()[:1])
            anchor_uid = str(role[0]["metadata"]["uid"])
            failpoint("rollout.after_anchor")
            children = anchored(anchor_uid=anchor_uid)
            await self._ensure_probe_key(
                name, RenderContext.build(network, self.settings.render, config_gen,
                                          anchor_uid, ns_uid)
            )  # fmt: skip
            await self._apply(name, children[1:])
        else:
            await self._ensure_probe_key(
                name, RenderContext.build(network, self.settings.render, config_gen)
            )
            await self._apply(name, children)
        failpoint("rollout.after_children")  # applied, not yet known as applied (no status)
        await self._drop_leftover_policies(name)
        if has and not wants:
            await cleanup.set_finalizer(self.kube, name, False, c.FIELD_MANAGER)
        self.store.children.record(
            name,
            Applied(generation, config_gen, digest),
            {str(o["kind"]): o for o in children if o["kind"] in DRIFT_CHECKED},
            holding,
        )
        log.info(
            "applied the children of %s (generation %d, agent config of generation %d)",
            name,
            generation,
            config_gen,
        )
        self.batch.mark(name)

    async def _multus_served(self) -> bool:
        """Whether Multus's NetworkAttachmentDefinition kind is served (API discovery,
        which every authenticated client may read)."""
        try:
            doc = await self.kube.request("GET", f"/apis/{NAD_API_VERSION}")
        except ApiError as err:
            if err.status in (404, 503):
                return False
            raise
        return any(r.get("name") == NAD_PLURAL for r in doc.get("resources") or [])

    async def _drop_leftover_policies(self, name: str) -> None:
        """Webhook mode: delete the network's pod admission policy left by a run in policy
        mode, so the webhook and a policy never both mutate a pod (once per network)."""
        checked = self.store.children.policies_checked
        if self.settings.render.admission_mode != "webhook" or name in checked:
            return
        for kind in (POD_POLICY_BINDING, POD_POLICY):
            try:
                if await self.kube.delete(kind, policy_name(name)):
                    log.info("deleted %s of %s: the operator runs in webhook mode", kind.kind, name)
            except ApiError as err:
                if err.status != 403:
                    raise
                # An install whose RBAC predates the policy mode has none to leave behind.
                log.debug("cannot check for a leftover %s of %s: %s", kind.kind, name, err)
        checked[name] = True

    async def _apply(self, name: str, children: list[dict[str, Any]]) -> list[dict[str, Any]]:
        try:
            return await apply_children(self.kube, children, after=_after_child)
        except ApplyFailed as err:
            self._apply_failed(name, err)
            raise

    async def _ensure_probe_key(self, name: str, ctx: RenderContext) -> None:
        """The network's probe-key Secret, before the DaemonSet that mounts it."""
        try:
            await ensure_probe_key(self.kube, ctx)
        except ApiError as err:
            failure = ApplyFailed(probe_key_secret(ctx), err)  # no data: nothing secret
            self._apply_failed(name, failure)
            raise failure from err

    async def _holding_conflicts(self, name: str, network: MetaRoceNetwork) -> list[Conflict]:
        """Conflicts with older networks, from a fresh list (a network created a moment
        ago counts; one being deleted still owns its NICs until it is gone)."""
        bodies = await self.kube.list_items(NETWORK)
        if len(bodies) < 2:
            return []
        networks: dict[str, MetaRoceNetwork] = {name: network}
        order = {name: created_order(self.store.networks.get(name) or {})}
        for other in bodies:
            other_name = other["metadata"]["name"]
            if other_name == name:
                order[name] = created_order(other)
                continue
            with contextlib.suppress(InvalidObject):
                networks[other_name] = validate_network(other)
                order[other_name] = created_order(other)
        nodes = await self.kube.list_items(NODE, cached=True)
        labels = {v.name: v.labels for v in map(NodeView.from_body, nodes)}
        reports = self.store.reports
        return holding_conflicts(name, networks, order, labels, reports.netdevs(), reports.nics())

    async def _hold(self, name: str, body: dict[str, Any], held: list[Conflict]) -> None:
        messages = self.store.conflicts.hold(name, held)
        if messages is not None:
            log.warning("%s: rollout held: %s", name, "; ".join(messages))
        self.store.children.errors.pop(name, None)
        has = c.CLEANUP_FINALIZER in cleanup.finalizers(body)
        if cleanup.wants_finalizer(body) != has:
            await cleanup.set_finalizer(
                self.kube, name, cleanup.wants_finalizer(body), c.FIELD_MANAGER
            )
        self.batch.mark(name)

    def _fail(self, name: str, reason: str, message: str) -> None:
        self.store.children.errors[name] = (reason, message)
        self.batch.mark(name)

    def _apply_failed(self, name: str, failure: ApplyFailed) -> None:
        shown = failure_status(failure)
        if shown is None:
            return  # retried quietly
        reason, message, permanent = shown
        self._fail(name, reason, message)
        if permanent:
            raise PermanentFailure(str(failure)) from failure

    # -- status -----------------------------------------------------------------------------

    async def flush(self, name: str) -> None:
        """Compute the status of one network and write it if it changed."""
        body = self.store.networks.get(name)
        if body is None or not self._mine(body):
            return
        if not self.synced:  # the batch loop starts after the sync; belt and braces
            self.batch.mark(name)
            return
        if cleanup.deleting(body):
            await self._flush_deleting(name, body)
            return
        update = self.store.next_status(name, body, now_utc())
        if update is None:
            return  # not reconciled in this term yet: a status from nothing would flap
        new, previous = update.new, update.previous
        if update.network is not None:
            self._track_unhealthy(name, update.network)
        if new.nodes is not None:
            metrics.set_network_nodes(
                name,
                {
                    "desired": new.nodes.desired,
                    "configured": new.nodes.configured,
                    "healthy": new.nodes.healthy,
                    "failed": new.nodes.failed,
                },
            )
        if not same_status(new, previous):
            await self._write_status(name, body, new, previous)

    async def _write_status(self, name: str, body: dict[str, Any], new: Any, previous: Any) -> None:
        failpoint("status.before_write")
        obj = {
            "apiVersion": c.API_VERSION,
            "kind": c.NETWORK_KIND,
            "metadata": {"name": name},
            "status": new.to_api(),
        }
        try:
            result = await self.kube.apply(obj, field_manager=c.FIELD_MANAGER, subresource="status")
        except ApiError as err:
            if err.status == 404:
                return  # deleted meanwhile
            raise
        self.store.wrote_status(result)
        metrics.STATUS_WRITES.labels(network=name).inc()
        for spec in transition_events(previous, new):
            await events.post(self.kube, body, spec, self.settings.identity)

    def _track_unhealthy(self, name: str, network: MetaRoceNetwork) -> None:
        """Wake the node pass early when the set of probe-failing nodes changed."""
        health = network.spec.health
        if health.action != "taint" and not self.store.taints.unhealthy.get(name):
            return
        reports = self.store.reports.of(name)
        sick = sick_nodes(reports, probes.judge(reports, health.probe))
        if self.store.taints.track(name, health.action, sick):
            self.nodepass.kick.set()

    async def _flush_deleting(self, name: str, body: dict[str, Any]) -> None:
        now = now_utc()
        timeout = self.settings.cleanup_timeout
        reports = self.store.reports.of(name)
        decision = cleanup.decide(body, reports, self.store.nodes.names_or_none(), now, timeout)
        if decision is None:
            return
        view = decision.view
        if decision.recheck_in is not None:
            self._recheck_at(name, decision.recheck_in)
        try:
            network: MetaRoceNetwork | None = validate_network(body)
        except InvalidObject:
            network = None
        if network is not None and decision.shows:
            previous = parse_status(self.store.status_of(name))
            new = compute_status(self.store.observed(name, network, cleanup=view), previous, now)
            if not same_status(new, previous):
                await self._write_status(name, body, new, previous)
        if not decision.release:
            failpoint("cleanup.waiting")  # nodes still to revert: the finalizer must stay
            return
        if view.timed_out:
            log.warning(
                "%s: %d node(s) did not report reverted in time, releasing anyway: %s",
                name,
                len(view.pending),
                ", ".join(view.pending[:10]),
            )
        else:
            log.info("%s: every node reported its settings reverted; releasing", name)
        # The agents go now (the anchor owns the other children, see
        # render.common.anchor_references), then the network.
        shared = self.settings.render.agent_cluster_role is not None
        anchor = CLUSTERROLEBINDING if shared else CLUSTERROLE
        failpoint("cleanup.before_anchor_delete")  # every node reverted (or timed out)
        if await self.kube.delete(anchor, child_name(name)):
            log.info(
                "%s: deleted its agents' %s; the rest is garbage-collected",
                name,
                anchor_kind(self.settings.render),
            )
        failpoint("cleanup.before_finalizer")  # the agents are going, the network stays
        await cleanup.set_finalizer(self.kube, name, False, c.FIELD_MANAGER)
        failpoint("cleanup.after_finalizer")  # gone: its NodeStates, labels, taints are orphans

    def _recheck_at(self, name: str, delay: float) -> None:
        self.store.cleanup.recheck_at(name, delay + 0.5, lambda: self.batch.mark(name))
