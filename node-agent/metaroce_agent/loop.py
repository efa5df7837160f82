"""The agent's main loop: discover -> plan -> apply -> verify -> report -> serve.

- At start and whenever the config file changes: a full pass (discover, probe the
  node's capabilities, plan, apply with rollback, discover again, report).
- A pass that fails (a step that failed and was rolled back to the last verified state,
  or a plan that cannot apply, such as no RDMA device yet) is tried again after a
  backoff that doubles from RETRY_BASE_SECONDS up to RETRY_MAX_SECONDS, and at once
  when the node's devices, ports, netdevs or addresses change (a driver or ib_uverbs
  loaded after the agent, looked at every POLL_SECONDS). Each attempt is reported (its
  number and the time to the next one). An attempt changes only what differs from the
  last verified state and restores it when it fails, and the backoff bounds how often
  that happens under running jobs.
- Every `driftInterval`: discover again, read every applied knob back and re-apply what
  someone changed (counted in `driftCorrections` and metrics); report if anything changed.
- A watch on the network object: when it is being deleted and `cleanupOnDelete` is set,
  revert everything the agent created and report `reverted: true`, then stay idle.
- SIGTERM (a rollout, an eviction, a node shutdown) stops the loop and leaves the node
  as it is: running jobs depend on it.
- The kubelet device plugin of the network (`AgentOptions.device_plugin_dir`) is fed
  after every pass, and within seconds of a port or address change
  (`deviceplugin.feed`): a device is advertised once it exists, and healthy only while
  its port is ACTIVE and its QoS is applied and verified. It is stopped on revert and on
  shutdown (the kubelet then marks the units unhealthy; running pods keep their devices).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from metaroce_agent.capabilities import Capabilities, probe_capabilities
from metaroce_agent.discover import Inventory, discover
from metaroce_agent.engine import ApplyResult, Engine, Journal, verified_state_serving
from metaroce_agent.exporter import (
    AgentMetrics,
    MetricsServer,
    RdmaCounterCollector,
    TransportStatsCollector,
)
from metaroce_agent.host import Host
from metaroce_agent.kube import METADATA_WATCH, KubeClient, KubeError, cluster_path
from metaroce_agent.plan import Plan, make_plan, select_netdevs
from metaroce_agent.primary import node_internal_ips, primary_interfaces, read_primary_facts
from metaroce_agent.report import ErrorLog, NodeStateWriter, build_status, now
from metaroce_agent.steps import Step
from metaroce_agent.transport.stats import (
    ContainerRef,
    HoldersSource,
    StatsDirectories,
    TransportStats,
)
from metaroce_api import AgentConfig, MetaRoceNodeStateStatus, ProbeSummary, constants
from metaroce_api.base import parse_duration
from metaroce_api.podnet import block_annotation

log = logging.getLogger("metaroce.agent.loop")

POLL_SECONDS = 5.0
"""How often the loop looks at the node between passes (config file, inventory)."""
LIBRARY_SWEEP_SECONDS = 60.0
"""Transport library versions no pod holds go within this long, not only on the drift
pass (which may be an hour apart); the check is a PodResources list and a listdir."""
RETRY_BASE_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0
REPORT_RETRY_BASE_SECONDS = 2.0
REPORT_RETRY_MAX_SECONDS = 60.0
"""A NodeState write that failed is tried again on this backoff, not at the next pass:
with a long drift interval the next pass may be an hour away, and the operator and the
scheduler wait for the report."""
LIVENESS_SECONDS = 600.0
"""/livez fails once the loop has not turned for this long: no pass takes minutes, so
one that does is stuck (in a kernel call, a hung command) and a restart is the cure."""


def readiness(status: MetaRoceNodeStateStatus | None, generation: int) -> tuple[bool, str]:
    """/readyz (pure): ready exactly when the node's plan for the current config
    (`generation`) is applied and verified, i.e. the NodeState's phase is Ready for it.
    What the DaemonSet's rollout gates on (`maxUnavailable`, `minReadySeconds`)."""
    if status is None:
        return False, "not applied yet"
    if status.config_generation != generation:
        return False, (
            f"config generation {generation} not applied yet "
            f"(the node has generation {status.config_generation})"
        )
    if status.phase != "Ready":
        ready = next((c for c in status.conditions or [] if c.type == "Ready"), None)
        why = f": {ready.message}" if ready is not None and ready.message else ""
        return False, f"{status.phase}{why}"[:2000]
    return True, f"applied and verified (config generation {generation})"


def retry_delay(
    failures: int, base: float = RETRY_BASE_SECONDS, cap: float = RETRY_MAX_SECONDS
) -> float:
    """Seconds to wait after `failures` consecutive failed passes: base, 2 base, 4 base, ...
    up to cap."""
    return float(min(cap, base * 2 ** max(0, failures - 1)))


@dataclass
class AgentOptions:
    config_path: Path
    node_name: str
    root: Path = Path("/")
    kubeconfig: str | None = None
    report: bool = True
    metrics_address: str = "0.0.0.0"
    metrics_port: int | None = constants.AGENT_METRICS_PORT
    """None = no metrics server; 0 = any free port."""
    state_dir: str = "/run/metaroce/agent"
    skip_knobs: frozenset[str] = frozenset()
    require_pyverbs: bool = False
    probe: bool | None = None
    """None = as the config says (probe.enabled)."""
    probe_port: int = constants.AGENT_PROBE_PORT
    probe_key_file: Path | None = None
    """The network's probe key (a mounted Secret); None or an absent file = the probe's
    side channel is not authenticated."""
    watch: bool = True
    device_plugin_dir: Path | None = None
    """The kubelet's device-plugin directory (/var/lib/kubelet/device-plugins); None = no
    device plugin (tests, `--once`, `--no-device-plugin`)."""
    pod_resources_socket: str | None = "/var/lib/kubelet/pod-resources/kubelet.sock"
    """The kubelet's PodResources API (metaroce: which library versions pods hold);
    None = keep every version until the network is reverted."""


def load_config(path: Path) -> AgentConfig:
    """The agent config, with errors that name the field, the value and the fix."""
    from pydantic import ValidationError

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"agent config {path}: cannot read it ({e.strerror}): pass --config with the "
            f"path of the mounted ConfigMap key {constants.AGENT_CONFIG_KEY}"
        ) from e
    try:
        return AgentConfig.from_yaml(text)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            value = err.get("input")
            shown = repr(value) if not isinstance(value, dict) else "{...}"
            lines.append(f"  field {where}: value {shown[:80]}: {err['msg']}")
        raise ConfigError(
            f"agent config {path} is invalid:\n"
            + "\n".join(lines)
            + "\nfix the MetaRoceNetwork spec (the operator renders this file), or the file"
        ) from e
    except Exception as e:  # YAML syntax
        raise ConfigError(f"agent config {path} is not valid YAML: {e}") from e


class ConfigError(ValueError):
    pass


@dataclass
class AgentState:
    config: AgentConfig
    inventory: Inventory = field(default_factory=Inventory)
    caps: Capabilities = field(default_factory=Capabilities)
    plan: Plan | None = None
    result: ApplyResult | None = None
    errors: ErrorLog = field(default_factory=ErrorLog)
    drift_corrections: int = 0
    probe: ProbeSummary | None = None
    reverted: bool = False
    last_applied: datetime | None = None
    status: MetaRoceNodeStateStatus | None = None
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of each part of the last apply pass (discover, capabilities, plan, apply,
    rediscover, report, total): the benchmarks read them."""
    failing: frozenset[str] = frozenset()
    """`Step.device` of the steps the last drift pass could not repair ("" = node-wide)."""
    failures: int = 0
    """Consecutive failed apply passes (0 after a pass that verified)."""
    next_retry: float | None = None
    """`time.monotonic()` of the next attempt after a failed pass; None when none is due."""
    revert_left: list[Step] | None = None
    """After a revert that failed: the steps still applied (journaled); None otherwise."""


class Agent:
    def __init__(
        self,
        options: AgentOptions,
        *,
        host: Host | None = None,
        kube: KubeClient | None = None,
    ) -> None:
        self.options = options
        self.host = host or Host(options.root)
        self.config = load_config(options.config_path)
        self._config_mtime = self._mtime()
        self.state = AgentState(self.config)
        self.metrics = AgentMetrics(self.config.network, options.node_name)
        self.collector = RdmaCounterCollector(
            self.host, self.config.network, devices=self._served_devices
        )
        self.metrics.add_rdma_collector(self.collector)
        self.metrics.add_plugin_source(self._plugin_state)
        self.transport_stats = self._transport_stats()
        self.kube = kube
        if self.kube is None and options.report:
            self.kube = KubeClient.load(options.kubeconfig)
        self.writer = (
            NodeStateWriter(self.kube, self.config.network, options.node_name)
            if self.kube is not None and options.report
            else None
        )
        self.engine = Engine(self.host, Journal(self.host, self.config.network, options.state_dir))
        self.server: MetricsServer | None = None
        self.wake = threading.Event()
        self.stop_event = threading.Event()
        self.deleting = threading.Event()
        self.left_network = False
        """The operator's node label asks this agent to revert the node: it left the
        network's nodeSelector (see the operator's nodelabels.py)."""
        self.cleanup_on_delete = self.config.cleanup_on_delete
        self.pod_block: str | None = None
        """This node's block of the network's podNetwork.subnet (the operator's node
        annotation, see metaroce_api.podnet), followed by `watch_node`."""
        self._planned_block: str | None = None
        """`pod_block` as the last apply pass planned with it."""
        self.prober: Any = None
        self._lock = threading.Lock()
        self._seen: tuple[Any, ...] = ()
        self.plugin: Any = None
        """The running `DevicePlugin` (imported lazily: grpcio is only needed with one)."""
        self._allocations_lock = threading.Lock()
        self._allocations: dict[str, str] | None = None
        self.heartbeat = time.monotonic()
        """When the loop last turned (`beat`), for /livez."""
        self.report_retry_at: float | None = None
        """When to write the NodeState again after a failed write (None: none failed)."""
        self._report_failures = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """Import pyverbs and pyroute2 now (start-up), not inside the first apply pass."""
        from metaroce_agent.discover import verbs_backend

        verbs_backend(self.host, require_pyverbs=self.options.require_pyverbs)
        if self.host.is_real:
            import pyroute2  # noqa: F401

    # --- helpers -------------------------------------------------------------------------
    def _mtime(self) -> float:
        try:
            return self.options.config_path.stat().st_mtime
        except OSError:
            return 0.0

    def _served_devices(self) -> list[tuple[str, str | None]]:
        plan = self.state.plan
        if plan is None:
            return []
        return sorted({(d.rdma_device, d.netdev) for d in plan.devices if d.rdma_device})

    def _internal_ips(self) -> list[str]:
        """The node's Kubernetes InternalIPs, for the primary-interface guard; empty when
        the agent runs without the apiserver (the default-route check still holds)."""
        if self.kube is None:
            return []
        try:
            node = self.kube.get(f"/api/v1/nodes/{self.options.node_name}")
        except KubeError as e:
            log.warning(
                "cannot read node %s (%s): the primary-interface guard checks the default "
                "routes only",
                self.options.node_name,
                e,
            )
            return []
        return node_internal_ips(node)

    @property
    def drift_seconds(self) -> float:
        return max(parse_duration(self.config.drift_interval).total_seconds(), 1.0)

    # --- passes --------------------------------------------------------------------------
    def discover(self) -> Inventory:
        inv = discover(self.host, require_pyverbs=self.options.require_pyverbs)
        self.state.inventory = inv
        self._seen = self._fingerprint()
        return inv

    def _fingerprint(self) -> tuple[Any, ...]:
        """What a drift pass checks before paying for a full discovery: RDMA devices, port
        states, and the selected netdevs' state, MTU and addresses."""
        h = self.host
        devs = tuple(h.listdir("/sys/class/infiniband"))
        ports = tuple(
            h.read_opt(f"/sys/class/infiniband/{d}/ports/{p}/state")
            for d in devs
            for p in h.listdir(f"/sys/class/infiniband/{d}/ports")
        )
        plan = self.state.plan
        names = (
            tuple(h.listdir("/sys/class/net")),
            tuple(h.listdir("/sys/class/infiniband_verbs")),
        )
        nets = tuple(
            (
                h.read_opt(f"/sys/class/net/{n}/operstate"),
                h.read_opt(f"/sys/class/net/{n}/mtu"),
                tuple(h.netlink.ipv4_addresses(n)),
                tuple(h.netlink.ipv6_addresses(n)),
            )
            for n in (plan.netdevs if plan else ())
        )
        return devs, ports, names, nets

    def apply_pass(self) -> ApplyResult:
        """Discover, plan, apply (with rollback), rediscover, report."""
        with self._lock:
            st = self.state
            st.config = self.config
            st.revert_left = None
            t = {"start": time.monotonic()}
            log.info(
                "apply pass for network %s generation %d",
                self.config.network,
                self.config.generation,
            )
            inv = self.discover()
            t["discover"] = time.monotonic()
            netdevs = [n.name for n in select_netdevs(self.config, inv)]
            st.caps = probe_capabilities(self.host, inv, netdevs)
            t["capabilities"] = time.monotonic()
            facts = read_primary_facts(self.host, inv, self._internal_ips())
            self._planned_block = self.pod_block
            st.plan = make_plan(
                self.config,
                inv,
                st.caps,
                skip_knobs=self.options.skip_knobs,
                primary=primary_interfaces(facts, inv.netdevs),
                pod_block=self._planned_block,
            )
            t["plan"] = time.monotonic()
            for note in st.plan.notes:
                log.info("plan: %s", note)
            for skip in st.plan.skipped:
                log.warning("skipped %s on %s: %s", skip.knob, skip.device or "node", skip.reason)
            with self.metrics.apply_seconds.time():
                result = self.engine.apply(st.plan)
            t["apply"] = time.monotonic()
            st.result = result
            self.metrics.applies.labels(result="ok" if result.ok else "failed").inc()
            errors: list[tuple[str, str]] = []
            if not st.plan.ok:
                errors += [(e.where, e.message) for e in st.plan.errors]
            elif not result.ok:
                where = f"apply {result.failed_step.name}" if result.failed_step else "apply"
                rolled = ", ".join(result.rolled_back) or "nothing"
                if result.rollback_incomplete:
                    left = ", ".join(s.name for s in result.left_off)
                    why = (
                        f"rollback incomplete (retrying): {left} left off the last verified "
                        f"state; rolled back: {rolled}"
                    )
                else:
                    why = f"rolled back to the last verified state: {rolled}"
                errors.append((where, f"{result.error}; {why}"))
            if result.undo_errors:  # a plan that cannot apply still retries a rollback
                where = "apply" if result.ok else "rollback"
                errors += [(where, e) for e in result.undo_errors]
            if result.ok and not st.plan.problems:
                st.failures, st.next_retry = 0, None
            else:
                # a failed pass, or one with problems that may clear (a port still down,
                # GIDs not there yet): look again with backoff, at once on a change
                st.failures += 1
                delay = retry_delay(st.failures, RETRY_BASE_SECONDS, RETRY_MAX_SECONDS)
                st.next_retry = time.monotonic() + delay
                what = f"attempt {st.failures} failed" if not result.ok else "problems remain"
                note = (
                    f"{what}; next attempt in {delay:.0f} s, or as soon as the node's "
                    "devices, ports or addresses change"
                )
                log.warning("apply pass: %s", note)
                if not result.ok:  # after the failure itself, which stays the first error
                    errors.append((constants.NODESTATE_ERROR_STEP_RETRY, note))
            errors += [(p.where, p.message) for p in st.plan.problems]
            if self.engine.journal.problem:
                errors.append(("journal", self.engine.journal.problem))
            for step, _ in errors:
                self.metrics.errors.labels(step=step[:64]).inc()
            st.errors.set(errors)
            if result.ok and (result.changed or st.last_applied is None):
                st.last_applied = now()
            st.failing = frozenset()
            if result.ok:
                self.discover()  # rxe devices and GIDs that now exist
            t["rediscover"] = time.monotonic()
            self._feed_plugin()
            if result.ok:
                self._remove_unused_libraries()
            self.metrics.knobs_applied.set(len([s for s in result.applied if s.report]))
            self.metrics.knobs_skipped.set(len(st.plan.skipped))
            self.report()
            t["report"] = time.monotonic()
            order = ["start", "discover", "capabilities", "plan", "apply", "rediscover", "report"]
            st.timings = {k: t[k] - t[prev] for prev, k in itertools.pairwise(order)}
            st.timings["total"] = t["report"] - t["start"]
            return result

    def drift_pass(self) -> None:
        with self._lock:
            st = self.state
            if st.plan is None or st.reverted or not (st.result and st.result.ok):
                return
            if self._fingerprint() != self._seen:
                log.info("devices, ports or addresses changed: discovering again")
                self.discover()
            drift = self.engine.drift(st.plan)
            self.metrics.drift_seconds.set(drift.seconds)
            for step, _ in drift.repaired:
                self.metrics.drift_repairs.labels(knob=step.knob).inc()
            st.drift_corrections += len(drift.repaired)
            errors = [(e.where, e.message) for e in st.plan.problems]
            errors += [(f"repair {s.name}", msg) for s, msg in drift.errors]
            st.errors.set(errors)
            st.failing = frozenset(s.device for s, _ in drift.errors)
            self._feed_plugin()
            self._remove_unused_libraries()
            if self.transport_stats is not None:
                self.transport_stats.refresh(force=True)  # removes long-unowned directories
            if drift.repaired:
                st.last_applied = now()
                log.info(
                    "drift pass: repaired %s",
                    ", ".join(f"{s.name} ({why})" for s, why in drift.repaired),
                )
            self.report()

    def revert(self, why: str = "is being deleted") -> None:
        with self._lock:
            st = self.state
            log.warning("network %s %s with cleanupOnDelete: reverting", self.config.network, why)
            st.status = self._status(reverting=True)
            self._write(st.status)
            result = self.engine.revert()
            if self.transport_stats is not None:  # what no pod holds goes with the network
                self.transport_stats.refresh(force=True, grace=0)
            st.errors.set(
                [(f"revert {name}", msg) for name, msg in result.errors]
                + [(f"revert {name}", msg) for name, msg in result.left]
            )
            st.reverted = result.ok
            st.revert_left = (
                None if result.ok else [e.step for e in self.engine.journal.entries.values()]
            )
            if result.ok:
                log.info("reverted %d step(s) in %.2f s", len(result.undone), result.seconds)
            self.discover()
            self.report()
            self.stop_plugin()  # the node no longer carries the network's settings

    # --- the device plugin ---------------------------------------------------------------
    def start_plugin(self) -> None:
        """Start the network's device plugin (it registers once it has a device)."""
        if self.options.device_plugin_dir is None or self.plugin is not None:
            return
        from metaroce_agent.deviceplugin import DevicePlugin, PluginConfig

        cfg = self.config
        self.plugin = DevicePlugin(
            PluginConfig(
                resource_name=cfg.resource_name,
                pods_per_device=cfg.pods_per_device,
                socket_dir=self.options.device_plugin_dir,
                device_env=frozenset(cfg.device_env),
                on_allocate=self._record_allocation,
                stats_dir_for=(
                    None if self.transport_stats is None else self.transport_stats.dirs.create
                ),
            )
        )
        self.plugin.start()
        self._feed_plugin()
        log.info(
            "device plugin for %s started in %s", cfg.resource_name, self.options.device_plugin_dir
        )

    # --- metaroce stats files ------------------------------------------------------------
    def _transport_stats(self) -> TransportStats | None:
        """metaroce: the per-allocation stats directories and their exporter (else None)."""
        if self.config.transport.mode != "metaroce":
            return None
        dirs = StatsDirectories(self.host, self.options.state_dir, self.config.network)
        socket = self.options.pod_resources_socket
        holders = None
        if socket is not None and self.options.device_plugin_dir is not None:
            holders = self._stats_holders(socket)
        stats = TransportStats(dirs, holders)
        self.metrics.add_transport_stats(TransportStatsCollector(self.config.network, stats))
        return stats

    def _stats_holders(self, socket: str) -> HoldersSource:
        resource = self.config.resource_name

        def holders() -> dict[ContainerRef, frozenset[str]]:
            from metaroce_agent.deviceplugin.podresources import units_by_container  # grpcio

            held = units_by_container(resource, socket)
            return {ContainerRef(*key): units for key, units in held.items()}

        return holders

    # --- metaroce library versions ---------------------------------------------------------
    @property
    def _allocations_path(self) -> str:
        from metaroce_agent.transport.library import ALLOCATIONS_FILE

        return f"{self.options.state_dir}/{self.config.network}/{ALLOCATIONS_FILE}"

    def _load_allocations(self) -> dict[str, str]:
        if self._allocations is None:
            text = self.host.read_opt(self._allocations_path)
            try:
                data = json.loads(text) if text else {}
            except ValueError:
                data = {}
            self._allocations = {
                str(k): str(v) for k, v in (data if isinstance(data, dict) else {}).items()
            }
        return self._allocations

    def _record_allocation(self, ids: tuple[str, ...], got: Any) -> None:
        """Which library directory each unit was last handed (gRPC thread)."""
        if not got.mounts:
            return
        with self._allocations_lock:
            records = self._load_allocations()
            records.update({unit: got.mounts[0].host_path for unit in ids})
            self.host.write_atomic(
                self._allocations_path, json.dumps(records, sort_keys=True, indent=1)
            )

    def _remove_unused_libraries(self) -> None:
        """Remove metaroce library versions no pod holds (PodResources) and none maps."""
        plan = self.state.plan
        socket = self.options.pod_resources_socket
        if plan is None or plan.library is None or socket is None:
            return
        if self.options.device_plugin_dir is None:
            return  # no device plugin, no allocations to keep versions for
        from metaroce_agent.deviceplugin.podresources import PodResourcesError, allocated_units
        from metaroce_agent.transport.library import remove_unused_versions

        try:
            held = allocated_units(self.config.resource_name, socket)
        except PodResourcesError as e:
            log.warning("old transport versions kept: %s", e)
            return
        with self._allocations_lock:
            records = dict(self._load_allocations())
        removed, notes = remove_unused_versions(
            self.host, self.config.network, plan.library.directory, records, held
        )
        for version in removed:
            log.info("removed transport version %s: no pod holds it", version)
        for note in notes:
            log.info("transport versions kept: %s", note)

    def _plugin_state(self) -> tuple[str, Any] | None:
        """The running plugin's resource and state, for the metrics (scrape thread)."""
        plugin = self.plugin
        return None if plugin is None else (plugin.config.resource_name, plugin.status())

    def stop_plugin(self) -> None:
        plugin, self.plugin = self.plugin, None
        if plugin is not None:
            plugin.stop()
            log.info("device plugin for %s stopped", plugin.config.resource_name)

    def _feed_plugin(self) -> None:
        """Hand the plugin the current devices (the plugin skips an unchanged list)."""
        if self.plugin is None:
            return
        from metaroce_agent.deviceplugin.feed import plugin_devices  # grpcio: only with a plugin

        st = self.state
        applied = st.result is not None and st.result.ok and not st.reverted
        kept = [] if st.reverted else verified_state_serving(st.result, st.plan)
        self.plugin.update(
            plugin_devices(
                self.config,
                st.inventory,
                st.plan,
                applied=applied,
                failing=st.failing,
                in_force=kept,
            )
        )

    def watch_ports(self) -> None:
        """Between passes: rediscover and re-feed the plugin when a port, a device or an
        address changed (cheap sysfs reads; a port going down is seen within seconds)."""
        if self.plugin is None or self.state.reverted:
            return
        with self._lock:
            if self._fingerprint() != self._seen:
                log.info("devices, ports or addresses changed: updating the device plugin")
                self.discover()
                self._feed_plugin()
                self.report()  # the NodeState shows the port state too (written if changed)

    # --- reporting -----------------------------------------------------------------------
    def _status(self, *, reverting: bool = False) -> MetaRoceNodeStateStatus:
        st = self.state
        return build_status(
            config=self.config,
            inventory=st.inventory,
            plan=st.plan,
            result=st.result,
            errors=st.errors,
            drift_corrections=st.drift_corrections,
            probe=st.probe,
            reverted=st.reverted,
            reverting=reverting,
            previous=st.status,
            last_applied=st.last_applied,
            revert_left=st.revert_left,
        )

    def report(self) -> None:
        status = self._status()
        self.state.status = status
        self.metrics.ready.set(1 if status.phase == "Ready" else 0)
        self._write(status)

    def _write(self, status: MetaRoceNodeStateStatus) -> None:
        if self.writer is None:
            return
        try:
            self.writer.write(status)
        except KubeError as e:
            self._report_failures += 1
            delay = retry_delay(
                self._report_failures, REPORT_RETRY_BASE_SECONDS, REPORT_RETRY_MAX_SECONDS
            )
            self.report_retry_at = time.monotonic() + delay
            self.wake.set()  # the loop recomputes its wait
            log.error(
                "cannot write NodeState %s: %s (retrying in %.0f s)", self.writer.name, e, delay
            )
            self.writer._ensured = False
            return
        self.report_retry_at = None
        self._report_failures = 0

    def set_probe(self, summary: ProbeSummary | None) -> None:
        """Called by the prober: a summary that changes only with the verdict."""
        with self._lock:
            self.state.probe = summary
            if not self.state.reverted:
                self.report()

    # --- the network watch ---------------------------------------------------------------
    def _network_path(self) -> str:
        return cluster_path(constants.GROUP, constants.VERSION, constants.NETWORK_PLURAL)

    def _check_network(self, obj: dict[str, Any] | None) -> None:
        if obj is None:
            return
        spec = obj.get("spec") or {}
        if "cleanupOnDelete" in spec:
            self.cleanup_on_delete = bool(spec["cleanupOnDelete"])
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            log.info("network %s has a deletionTimestamp", self.config.network)
            self.deleting.set()
            self.wake.set()

    def _check_node(self, obj: dict[str, Any] | None) -> None:
        """The operator's label on this node: `revert` once the node left the network's
        nodeSelector (its agent reverts before it goes), `selected` while it is in."""
        if obj is None:
            return
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        block = (meta.get("annotations") or {}).get(block_annotation(self.config.network))
        if block != self.pod_block:
            log.info("this node's pod block of network %s: %s", self.config.network, block)
            self.pod_block = block
            self.wake.set()
        left = labels.get(constants.node_label(self.config.network)) == constants.NODE_REVERT
        if left != self.left_network:
            self.left_network = left
            log.info(
                "this node %s network %s's nodeSelector",
                "left" if left else "is in", self.config.network,
            )  # fmt: skip
            self.wake.set()

    def _read_pod_block(self) -> None:
        """This node's pod block before the first pass (the node watch follows it)."""
        assert self.kube is not None
        try:
            self._check_node(self.kube.get(f"/api/v1/nodes/{self.options.node_name}"))
        except KubeError as e:
            log.warning("cannot read node %s (%s): the node watch will", self.options.node_name, e)

    def watch_node(self) -> None:
        """Thread: follow this node's labels (metadata only, see `_check_node`)."""
        assert self.kube is not None
        base = "/api/v1/nodes"
        name = self.options.node_name
        while not self.stop_event.is_set():
            try:
                obj = self.kube.get(f"{base}/{name}")
                self._check_node(obj)
                rv = ((obj or {}).get("metadata") or {}).get("resourceVersion", "")
                params = {"fieldSelector": f"metadata.name={name}", "timeoutSeconds": "300"}
                if rv:
                    params["resourceVersion"] = rv
                started = time.monotonic()
                for event in self.kube.watch(base, params, accept=METADATA_WATCH):
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._check_node(event.get("object"))
                    if self.stop_event.is_set():
                        return
                if time.monotonic() - started < 1:  # a watch that ends at once: no busy loop
                    self.stop_event.wait(1)
            except KubeError as e:
                log.warning("watch of node %s: %s; retrying in 5 s", name, e)
                self.stop_event.wait(5)

    def watch_network(self) -> None:
        """Thread: follow the network object; flag its deletion."""
        assert self.kube is not None
        base = self._network_path()
        name = self.config.network
        while not self.stop_event.is_set() and not self.deleting.is_set():
            try:
                obj = self.kube.get(f"{base}/{name}")
                if obj is None:  # gone (a finalizer normally holds it until agents revert)
                    log.warning("network %s does not exist (any more)", name)
                    self._check_network({"metadata": {"deletionTimestamp": "gone"}})
                    return
                self._check_network(obj)
                rv = ((obj or {}).get("metadata") or {}).get("resourceVersion", "")
                params = {"fieldSelector": f"metadata.name={name}", "timeoutSeconds": "300"}
                if rv:
                    params["resourceVersion"] = rv
                started = time.monotonic()
                for event in self.kube.watch(base, params):
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._check_network(event.get("object"))
                    elif event.get("type") == "DELETED":
                        self._check_network({"metadata": {"deletionTimestamp": "gone"}})
                    if self.deleting.is_set() or self.stop_event.is_set():
                        return
                if time.monotonic() - started < 1:  # a watch that ends at once: no busy loop
                    self.stop_event.wait(1)
            except KubeError as e:
                log.warning("watch of network %s: %s; retrying in 5 s", name, e)
                self.stop_event.wait(5)

    # --- health --------------------------------------------------------------------------
    def beat(self) -> None:
        self.heartbeat = time.monotonic()

    def ready(self) -> tuple[bool, str]:
        return readiness(self.state.status, self.config.generation)

    def live(self) -> tuple[bool, str]:
        idle = time.monotonic() - self.heartbeat
        if idle > LIVENESS_SECONDS:
            return False, f"the agent's loop has not turned for {idle:.0f} s"
        return True, f"the loop turned {idle:.0f} s ago"

    # --- run -----------------------------------------------------------------------------
    def serve_metrics(self) -> None:
        """Serve /metrics, /readyz and /livez; a port someone else holds (e.g. another
        network's agent on this node) costs the metrics, not the node's RDMA: the agent
        goes on without them."""
        if self.options.metrics_port is not None and self.server is None:
            try:
                self.server = MetricsServer(
                    self.metrics,
                    self.options.metrics_address,
                    self.options.metrics_port,
                    checks={"/readyz": self.ready, "/livez": self.live},
                )
            except OSError as e:
                log.error(
                    "cannot serve metrics on %s:%d: %s; going on without /metrics. If another "
                    "network's agent runs on this node, give one of the two networks another "
                    "spec.agent.metricsPort",
                    self.options.metrics_address,
                    self.options.metrics_port,
                    e,
                )

    def run(self) -> int:
        self.serve_metrics()
        self.start_plugin()
        if self.config.pod_network is not None and self.kube is not None:
            self._read_pod_block()
        self.apply_pass()
        if self.writer is not None and self.options.watch:
            threading.Thread(target=self.watch_network, name="network-watch", daemon=True).start()
            threading.Thread(target=self.watch_node, name="node-watch", daemon=True).start()
        if self.prober is not None:
            self.prober.start()
        next_drift = time.monotonic() + self.drift_seconds
        next_sweep = time.monotonic() + LIBRARY_SWEEP_SECONDS
        while not self.stop_event.is_set():
            self.beat()
            due = [next_drift, time.monotonic() + POLL_SECONDS]
            if self.state.next_retry is not None:
                due.append(self.state.next_retry)
            if self.report_retry_at is not None:
                due.append(self.report_retry_at)
            timeout = max(0.0, min(due) - time.monotonic())
            self.wake.wait(timeout)
            self.wake.clear()
            if self.stop_event.is_set():
                break
            if self.deleting.is_set() and not self.state.reverted:
                if self.cleanup_on_delete:
                    self.revert()
                else:
                    log.info("network deleted without cleanupOnDelete: leaving the node as it is")
                    self.deleting.clear()
                continue
            if self.left_network and not self.state.reverted and not self.deleting.is_set():
                if self.cleanup_on_delete:
                    self.revert("left this node's nodeSelector")
                continue  # without cleanupOnDelete the operator lets the agent go as it is
            if self.state.reverted:
                if self.left_network or self.deleting.is_set():
                    continue  # idle until the DaemonSet goes away
                log.info("this node is in network %s again: applying", self.config.network)
                self.state.reverted = False  # selected again before the agent went
                self.start_plugin()
                self.apply_pass()
                next_drift = time.monotonic() + self.drift_seconds
                continue
            if self._mtime() != self._config_mtime:
                self._reload()
                next_drift = time.monotonic() + self.drift_seconds
                continue
            if self._retry_due() or (
                self.config.pod_network is not None and self.pod_block != self._planned_block
            ):
                self.apply_pass()
                next_drift = time.monotonic() + self.drift_seconds
                continue
            if self.report_retry_at is not None and time.monotonic() >= self.report_retry_at:
                log.info("writing the NodeState again (attempt %d)", self._report_failures + 1)
                with self._lock:
                    self.report()
                continue
            if time.monotonic() >= next_drift:
                self.drift_pass()  # sweeps the library versions too
                next_drift = time.monotonic() + self.drift_seconds
                next_sweep = time.monotonic() + LIBRARY_SWEEP_SECONDS
            else:
                self.watch_ports()
                if time.monotonic() >= next_sweep:
                    self._remove_unused_libraries()
                    next_sweep = time.monotonic() + LIBRARY_SWEEP_SECONDS
        log.info("stopping: the node keeps its settings (only cleanupOnDelete reverts them)")
        self.stop_plugin()
        if self.prober is not None:
            self.prober.stop()
        if self.server is not None:
            self.server.close()
        return 0

    def _retry_due(self) -> bool:
        """After a failed pass: the backoff has passed, or the inventory changed."""
        st = self.state
        if st.next_retry is None:
            return False
        if time.monotonic() >= st.next_retry:
            log.info("retrying the apply pass (attempt %d)", st.failures + 1)
            return True
        with self._lock:
            changed = self._fingerprint() != self._seen
        if changed:
            log.info("devices, ports or addresses changed: retrying the apply pass now")
        return changed

    def _reload(self) -> None:
        self._config_mtime = self._mtime()
        try:
            config = load_config(self.options.config_path)
        except ConfigError as e:
            log.error("%s; keeping the previous config", e)
            return
        if config.network != self.config.network:
            log.error(
                "config now names network %s, this agent serves %s: ignoring it",
                config.network,
                self.config.network,
            )
            return
        log.info("config changed (generation %d): new apply pass", config.generation)
        old = self.config
        self.config = config
        self.cleanup_on_delete = config.cleanup_on_delete
        if self.plugin is not None and (
            (old.resource_name, old.pods_per_device, old.device_env)
            != (config.resource_name, config.pods_per_device, config.device_env)
        ):
            # Units and their IDs change: a new plugin re-registers with the new list.
            self.stop_plugin()
            self.start_plugin()
        self.apply_pass()

    def stop(self) -> None:
        self.stop_event.set()
        self.wake.set()
