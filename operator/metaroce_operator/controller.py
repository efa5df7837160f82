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
- node pass (periodic): garbage-collects NodeStates of nodes and networks that are gone,
  re-checks NIC conflicts between networks (resuming a held rollout once its conflict
  is gone), sets and clears probe taints.
- NIC conflicts: a network that conflicts with an older one is held: its children are
  not applied (no DaemonSet onto the contested NICs) until the conflict is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import defaultdict
from collections.abc import Coroutine, Mapping
from typing import Any

from metaroce_api import InvalidObject, MetaRoceNetwork, parse_duration, validate_network
from metaroce_api import constants as c
from metaroce_api.failpoints import failpoint
from metaroce_api.podnet import (
    BLOCK_ANNOTATION_PREFIX,
    NAD_API_VERSION,
    NAD_CRD,
    NAD_PLURAL,
    block_annotation,
)
from metaroce_operator import cleanup, events, metrics, probes, taints, upgrade
from metaroce_operator.apply import ApplyFailed, apply_children
from metaroce_operator.claim import CLAIM_ANNOTATION, claim_patch, claimant, split_claim
from metaroce_operator.conflicts import (
    Conflict,
    created_order,
    find_conflicts,
    holding_conflicts,
    selector_matches,
)
from metaroce_operator.drift import daemonset_drift, rbac_drift
from metaroce_operator.images import image_refusal
from metaroce_operator.informer import Informer
from metaroce_operator.kube import KINDS, ApiError, Kube, NotLeader
from metaroce_operator.nodelabels import orphaned_labels, plan_labels
from metaroce_operator.observed import (
    DaemonSetView,
    NodeReport,
    NodeView,
    parse_time,
)
from metaroce_operator.podblocks import plan_blocks, too_small_message
from metaroce_operator.probekey import ensure_probe_key, probe_key_secret
from metaroce_operator.render import RenderContext, config_generation, render_network
from metaroce_operator.render.common import (
    agent_config,
    anchor_kind,
    child_name,
    config_hash,
    selector_labels,
)
from metaroce_operator.render.nad import wants_nad
from metaroce_operator.render.podpolicy import policy_name
from metaroce_operator.settings import OperatorSettings
from metaroce_operator.state import Applied, Store
from metaroce_operator.status import (
    CONFIGURED_PHASES,
    BatchLoop,
    CleanupView,
    EventSpec,
    Observed,
    compute_status,
    invalid_status,
    now_utc,
    parse_status,
    rollout_settled,
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
OS_LABEL = "kubernetes.io/os"
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
        self._kick = asyncio.Event()
        self.nodestates = Informer(
            self.kube, NODESTATE, lambda t, body: self.on_event(c.NODESTATE_KIND, t, body)
        )
        self.store = Store(self.nodestates.synced)
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
            group.create_task(self._after_sync(self._node_pass_loop()), name="node pass")

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
            self._nodestate_event(event_type, body)
        elif kind == "DaemonSet":
            self._daemonset_event(event_type, body)
        elif kind in ("ConfigMap", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            self._child_event(kind, event_type, body)

    def _network_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        if event_type == "DELETED":
            self.store.forget_network(name)
            self.batch.forget(name)
            metrics.forget_network(name)
            self._spawn(self._delete_nodestates(name), f"delete NodeStates of {name}")
            if self.store.conflicts.held:
                self._kick.set()  # a held network may resume now
            return
        old = self.store.networks.get(name)
        if self.store.set_network(body):
            self.batch.mark(name)
            generation = (old or {}).get("metadata", {}).get("generation")
            if self.store.conflicts.held and generation != body["metadata"].get("generation"):
                self._kick.set()  # a changed spec may end the conflict holding another

    def _nodestate_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        was, report = self.store.reports.on_event(event_type, body)
        if was is not None:
            self.batch.mark(was)
        if report is not None:
            self.batch.mark(report.network, urgent=self._completes_rollout(report.network))

    def _completes_rollout(self, name: str) -> bool:
        """Whether the report just stored is the last one a rollout waited for, and the
        written status does not show that yet: then Ready is written at once rather than
        an interval later. Once per rollout, so still no status write per node event."""
        applied = self.store.children.applied.get(name)
        if applied is None or name in self.store.conflicts.held or not self.synced:
            return False  # before the first list, the status loop waits anyway
        ds = self.store.children.daemonsets.get(name)
        eligible = self.store.nodes.eligible.get(name)
        if ds is not None and ds.observed_current:
            desired = ds.desired
        elif eligible is not None:
            desired = len(eligible)
        else:
            return False
        if self.store.reports.count(name) < desired:  # the common case in a rollout: O(1)
            return False
        reports = self.store.reports.of(name)
        shown = (self.store.status_of(name) or {}).get("nodes") or {}
        if int(shown.get("configured") or 0) + int(shown.get("failed") or 0) >= desired:
            return False
        return rollout_settled(reports, applied.config_generation, desired, eligible)

    def _daemonset_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        network = (meta.get("labels") or {}).get(c.NETWORK_LABEL)
        if (
            not network
            or meta.get("namespace") != self.settings.render.namespace
            or meta.get("name") != child_name(network)
        ):
            return
        if event_type == "DELETED":
            self.store.children.daemonsets.pop(network, None)
            self._reconcile_later(network, "its DaemonSet was deleted")
        else:
            view = DaemonSetView.from_body(body, c.CONFIG_HASH_ANNOTATION)
            self.store.children.daemonsets[network] = view
            applied = self.store.children.applied.get(network)
            rendered = self.store.children.rendered.get(network, {}).get("DaemonSet")
            if applied is not None and view.template_hash != applied.config_hash:
                self._reconcile_later(network, "its DaemonSet's config hash was changed")
            elif applied is not None and rendered is not None:
                edited = daemonset_drift(rendered, body)
                if edited:
                    self._reconcile_later(
                        network, f"its DaemonSet was edited ({', '.join(edited)})"
                    )
        self.batch.mark(network)

    def _child_event(self, kind: str, event_type: str | None, body: dict[str, Any]) -> None:
        """Re-apply a child deleted (or a ConfigMap edited) behind the operator's back."""
        meta = body.get("metadata") or {}
        network = (meta.get("labels") or {}).get(c.NETWORK_LABEL)
        if not network or meta.get("name") != child_name(network):
            return
        if meta.get("namespace") not in (None, self.settings.render.namespace):
            return
        if event_type == "DELETED":
            self._reconcile_later(network, f"its {kind} was deleted")
        elif kind == "ConfigMap":
            applied = self.store.children.applied.get(network)
            digest = (meta.get("annotations") or {}).get(c.CONFIG_HASH_ANNOTATION)
            if applied is not None and digest != applied.config_hash:
                self._reconcile_later(network, "its ConfigMap was changed")
        elif kind in ("ClusterRole", "ClusterRoleBinding"):
            rendered = self.store.children.rendered.get(network, {}).get(kind)
            edited = rbac_drift(rendered, body) if rendered is not None else []
            if edited:
                self._reconcile_later(network, f"its {kind} was edited ({', '.join(edited)})")

    def _reconcile_later(self, name: str, why: str) -> None:
        body = self.store.networks.get(name)
        if body is None or cleanup.deleting(body) or not self.store.children.known(name):
            return
        log.info("re-applying the children of %s: %s", name, why)
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

    @property
    def lease_ref(self) -> str:
        return f"{self.settings.lease_namespace}/{self.settings.lease_name}"

    def _mine(self, body: Mapping[str, Any]) -> bool:
        return claimant(body) == self.lease_ref

    async def _claim(self, name: str, body: dict[str, Any]) -> bool:
        """Whether this operator may act on the network: it holds the claim, or takes it
        (unclaimed, or claimed by an operator whose Lease is gone)."""
        for _ in range(3):
            claim = claimant(body)
            if claim == self.lease_ref:
                self._not_foreign(name)
                return True
            if claim is not None and not await self._claimant_gone(claim):
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

    async def _claimant_gone(self, claim: str) -> bool:
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
        if self.store.claims.foreign.get(name) == claim:
            return
        self.store.claims.foreign[name] = claim
        metrics.FOREIGN_NETWORKS.set(len(self.store.claims.foreign))
        message = (
            f"network {name} is managed by the operator of lease {claim}; this operator "
            f"(lease {self.lease_ref}) leaves it alone. Run one operator per cluster, or, "
            f"if that operator is gone for good, remove the claim: kubectl annotate "
            f"{c.NETWORK_PLURAL} {name} {CLAIM_ANNOTATION}-"
        )
        log.warning("%s", message)
        spec = EventSpec("Warning", "ClaimedByAnotherOperator", message)
        await events.post(self.kube, body, spec, self.settings.identity)

    def _not_foreign(self, name: str) -> None:
        if self.store.claims.foreign.pop(name, None) is not None:
            metrics.FOREIGN_NETWORKS.set(len(self.store.claims.foreign))

    async def _take_over_gone_claims(self) -> None:
        """Node pass: reconcile a foreign network whose claimant's Lease is gone."""
        for name, claim in list(self.store.claims.foreign.items()):
            if await self._claimant_gone(claim):
                log.info("%s: its operator (lease %s) is gone; taking it over", name, claim)
                self.store.claims.foreign.pop(name, None)
                self._spawn(self._reconcile_retrying(name), f"reconcile {name}")

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
        if not await self._claim(name, body):
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
        messages = tuple(conflict.held_message() for conflict in held)
        if self.store.conflicts.held.get(name) != messages:
            log.warning("%s: rollout held: %s", name, "; ".join(m for m in messages))
        self.store.conflicts.held[name] = messages
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
        namespace = failure.obj["metadata"].get("namespace")
        status = failure.error.status
        if status == 404 and namespace:
            self._fail(
                name,
                c.REASON_RENDER_FAILED,
                f"the agent namespace {namespace!r} does not exist: create it (labelled "
                "pod-security.kubernetes.io/enforce=privileged; the chart does) or start the "
                "operator with --namespace set to an existing one",
            )
        elif status in (400, 403, 422):
            self._fail(name, c.REASON_RENDER_FAILED, str(failure))
            if status != 403:  # 403 may be RBAC being fixed: keep retrying
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
        applied = self.store.children.applied.get(name)
        error = self.store.children.errors.get(name)
        if applied is None and error is None and name not in self.store.conflicts.held:
            return  # not reconciled in this term yet: a status from nothing would flap
        previous = parse_status(self.store.status_of(name))
        generation = int(body["metadata"].get("generation") or 0)
        try:
            network = validate_network(body)
        except InvalidObject as err:
            reason, message = error or (c.REASON_INVALID_SPEC, str(err))
            new = invalid_status(previous, generation, reason, message, now_utc())
        else:
            new = compute_status(self._observed(name, network, applied, error), previous, now_utc())
            self._track_unhealthy(name, network)
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

    def _observed(
        self,
        name: str,
        network: MetaRoceNetwork,
        applied: Applied | None,
        error: tuple[str, str] | None,
        cleanup_view: CleanupView | None = None,
    ) -> Observed:
        reports = self.store.reports.of(name)
        holds = self.store.upgrades.holds.get(name, ())
        conflicts = self.store.conflicts
        return Observed(
            network=network,
            applied_generation=applied.generation if applied else None,
            config_generation=applied.config_generation if applied else None,
            daemonset=self.store.children.daemonsets.get(name),
            reports=reports,
            verdicts=probes.judge(reports, network.spec.health.probe),
            eligible=self.store.nodes.eligible.get(name),
            conflicts=conflicts.blocking.get(name, ()),
            held=conflicts.held.get(name, ()),
            yielded=conflicts.yielded.get(name, ()),
            taint_note=self.store.taints.notes.get(name, ""),
            agent_update=upgrade.update_status(network.spec.agent.update_strategy.paused, holds),
            holding=upgrade.holding(holds),
            cleanup=cleanup_view,
            error=error,
            pod_network=self.store.nodes.pod_blocks.get(name),
        )

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
        unhealthy = self.store.taints.unhealthy
        if network.spec.health.action != "taint" and not unhealthy.get(name):
            return
        reports = self.store.reports.of(name)
        verdicts = probes.judge(reports, network.spec.health.probe)
        sick = frozenset(
            node
            for node, r in reports.items()
            if r.phase in CONFIGURED_PHASES and not verdicts[node].healthy
        )
        if unhealthy.replace(name, sick, frozenset()):
            self._kick.set()

    async def _flush_deleting(self, name: str, body: dict[str, Any]) -> None:
        if c.CLEANUP_FINALIZER not in cleanup.finalizers(body):
            return
        now = now_utc()
        reports = self.store.reports.of(name)
        nodes = self.store.nodes.names_or_none()
        view = cleanup.cleanup_view(body, reports, nodes, now, self.settings.cleanup_timeout)
        if view.pending and not view.timed_out:
            self._recheck_at(name, cleanup.seconds_left(body, now, self.settings.cleanup_timeout))
        try:
            network: MetaRoceNetwork | None = validate_network(body)
        except InvalidObject:
            network = None
        if network is not None and (view.pending or view.timed_out):
            previous = parse_status(self.store.status_of(name))
            observed = self._observed(
                name, network, self.store.children.applied.get(name), None, cleanup_view=view
            )
            new = compute_status(observed, previous, now)
            if not same_status(new, previous):
                await self._write_status(name, body, new, previous)
        if view.pending and not view.timed_out:
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

    # -- the node pass ----------------------------------------------------------------------

    async def _node_pass_loop(self) -> None:
        await asyncio.sleep(min(2.0, self.settings.housekeeping_interval))
        while True:
            try:
                await self.node_pass()
            except NotLeader:
                raise
            except Exception as err:
                metrics.ERRORS.labels(where="nodes").inc()
                log.warning("node pass failed: %s", err)
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.settings.housekeeping_interval)

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
        await self._take_over_gone_claims()
        labels = self.store.nodes.labels()
        for name, network in valid.items():
            eligible = frozenset(
                node
                for node, node_labels in labels.items()
                if node_labels.get(OS_LABEL) == "linux"
                and selector_matches(network.spec.node_selector, node_labels)
            )
            if self.store.nodes.eligible.get(name) != eligible:
                self.store.nodes.eligible[name] = eligible
                self.batch.mark(name)
        self._check_conflicts(valid, labels)
        await self._remove_orphaned_taints(known)
        await self._remove_orphaned_labels(known)
        await self._remove_orphaned_blocks(known)
        for name, network in valid.items():
            if self._mine(self.store.networks.get(name) or {}):
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
            self.batch.mark(name)
        held = upgrade.holding(holds)
        rendered = self.store.children.rendered_holding.get(name)
        if rendered is not None and rendered != bool(held):
            why = "a node holds off agent updates" if held else "no node holds agent updates"
            self._reconcile_later(name, why)
            return
        if not held or strategy.paused or not rendered:
            return
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
        asked = self.store.labels.revert_asked.setdefault(name, {})
        timed_out = {
            node for node, since in asked.items() if clock - since > self.settings.cleanup_timeout
        }
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
            if value == c.NODE_REVERT:
                asked.setdefault(node, clock)
                log.info("%s: node %s left the network: asked its agent to revert it", name, node)
            else:
                asked.pop(node, None)
                if value is None:
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
            self.batch.mark(name)

    async def _remove_orphaned_blocks(self, live_networks: set[str]) -> None:
        """Pod-block annotations of networks that are gone."""
        prefix = BLOCK_ANNOTATION_PREFIX + "/"
        for node, view in self.store.nodes.view().items():
            for key in view.annotations:
                if key.startswith(prefix) and key[len(prefix) :] not in live_networks:
                    await self._set_node_annotation(node, key, None)
                    log.info("removed the pod block %s of a deleted network from %s", key, node)

    async def _set_node_annotation(self, node: str, key: str, value: str | None) -> None:
        patch = {"metadata": {"annotations": {key: value}}}
        try:
            await self.kube.patch(NODE, node, patch)
        except ApiError as err:
            if err.status != 404:  # a node deleted meanwhile has no annotation to keep
                raise

    async def _set_node_label(self, node: str, label: str, value: str | None) -> None:
        patch = {"metadata": {"labels": {label: value}}}
        try:
            await self.kube.patch(NODE, node, patch)
        except ApiError as err:
            if err.status != 404:  # a node deleted meanwhile has no label to keep
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
        held = self.store.conflicts.held
        for name in valid:
            blocking: list[str] = []
            yielded: list[str] = []
            holding: list[str] = []
            for conflict in found.get(name, []):
                if order[conflict.other] < order[name]:
                    holding.append(conflict.held_message())
                    if name not in held:  # rolled out before the conflict arose
                        blocking.append(conflict.message())
                elif conflict.other in held:
                    yielded.append(conflict.yielded_message())
                else:
                    blocking.append(conflict.message())
            if name in held:
                if not holding:
                    log.info("%s: its NIC conflict is gone; resuming the rollout", name)
                    self._spawn(self._reconcile_retrying(name), f"reconcile {name}")
                elif held.replace(name, tuple(holding), ()):
                    self.batch.mark(name)
            if self.store.conflicts.blocking.replace(name, tuple(blocking), ()):
                self.batch.mark(name)
                for message in blocking:
                    log.warning("%s: NIC conflict: %s", name, message)
            if self.store.conflicts.yielded.replace(name, tuple(yielded), ()):
                self.batch.mark(name)

    async def _collect_garbage(self, live_networks: set[str]) -> None:
        nodes = self.store.nodes.view()
        now = now_utc()
        doomed: list[NodeReport] = []
        for network, by_node in self.store.reports.every():
            for node, report in by_node.items():
                gone = node not in nodes or network not in live_networks
                age = (now - report.created).total_seconds() if report.created else 1e9
                if gone and age >= self.settings.nodestate_grace:
                    doomed.append(report)
        for report in doomed:
            why = "node" if report.node not in nodes else "network"
            if await self.kube.delete(NODESTATE, report.name, uid=report.uid or None):
                log.info("deleted NodeState %s: its %s no longer exists", report.name, why)

    async def _collect_orphaned_children(self, live: set[str]) -> None:
        """Delete the anchor ClusterRole of a network that is gone (its finalizer removed
        by hand, or the operator down while it went): the garbage collector then takes
        the agents and the rest. Children owned by a network are the collector's."""
        selector = f"{c.MANAGED_BY_LABEL}={c.MANAGED_BY},{c.COMPONENT_LABEL}={c.COMPONENT_AGENT}"
        now = now_utc()
        for role in await self.kube.list_items(CLUSTERROLE, label_selector=selector, cached=True):
            meta = role.get("metadata") or {}
            network = (meta.get("labels") or {}).get(c.NETWORK_LABEL, "")
            owners = {ref.get("kind") for ref in meta.get("ownerReferences") or []}
            if not network or network in live or c.NETWORK_KIND in owners:
                continue  # a network's own children are the garbage collector's
            created = parse_time(meta.get("creationTimestamp"))
            if created and (now - created).total_seconds() < self.settings.nodestate_grace:
                continue  # its network may be too new for the list
            if await self.kube.delete(CLUSTERROLE, meta["name"], uid=meta.get("uid")):
                log.info("deleted the agents of network %s, which no longer exists", network)

    async def _delete_nodestates(self, network: str) -> None:
        """One request for all of them (agents label their NodeStates); an unlabelled
        straggler is collected by the node pass once its network is gone."""
        await self.kube.delete_collection(NODESTATE, label_selector=f"{c.NETWORK_LABEL}={network}")
        log.info("deleted the NodeStates of %s", network)

    async def _taints(self, name: str, network: MetaRoceNetwork, live: set[str]) -> None:
        health = network.spec.health
        reports = self.store.reports.of(name)
        verdicts = probes.judge(reports, health.probe)
        sick = {
            node
            for node, r in reports.items()
            if r.phase in CONFIGURED_PHASES and not verdicts[node].healthy
        }
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
            self.batch.mark(name)
