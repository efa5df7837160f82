"""Prometheus exporter: every RDMA port counter and `hw_counters` entry, and the agent's own.

On each scrape the collector reads `/sys/class/infiniband/<dev>/ports/<n>/counters/*`
(IB port counters; mlx5 has them, rxe does not), `.../ports/<n>/hw_counters/*` (driver
counters: mlx5's np_cnp_sent, rxe's sent_pkts, ...) and the device-level `hw_counters/`,
whatever names exist, as `metaroce_rdma_port_<name>_total` and
`metaroce_rdma_hw_<name>_total` labelled by device, port, netdev and network. Missing
directories and unreadable or non-numeric files are skipped; a scrape never fails on
them. The agent's metrics (apply duration, drift repairs, errors, probe latency and
loss) live in the same registry, and so does the device plugin's state, read from the
plugin at scrape time (`DevicePluginCollector`): whether the kubelet knows the resource,
how many units are healthy, and how often it registered (each kubelet restart adds one).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from metaroce_agent.host import Host

if TYPE_CHECKING:
    from metaroce_agent.transport.stats import TransportStats

log = logging.getLogger("metaroce.agent.exporter")

NOT_COUNTERS = {"lifespan"}
"""hw_counters entries that are settings, not counters (rxe and mlx5: the refresh period)."""
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")
LABELS = ["device", "port", "netdev", "network"]


def metric_name(prefix: str, counter: str) -> str:
    name = _NAME_RE.sub("_", counter).strip("_").lower()
    return f"{prefix}_{name}"


def _escape(value: str) -> str:
    """A label value as the text format wants it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RdmaCounterCollector:
    """Reads the counters of the network's RDMA devices at scrape time."""

    def __init__(
        self,
        host: Host,
        network: str,
        devices: Callable[[], list[tuple[str, str | None]]] | None = None,
    ) -> None:
        """`devices()` returns (rdma device, netdev) pairs to export; None = every device."""
        self.host = host
        self.network = network
        self.devices = devices
        self._names: dict[tuple[str, str], str] = {}

    def _targets(self) -> list[tuple[str, str]]:
        if self.devices is not None:
            return [(d, n or "") for d, n in self.devices()]
        out = []
        for dev in self.host.listdir("/sys/class/infiniband"):
            netdev = self.host.read_opt(f"/sys/class/infiniband/{dev}/parent")
            if netdev is None:
                nets = self.host.listdir(f"/sys/class/infiniband/{dev}/device/net")
                netdev = nets[0] if nets else ""
            out.append((dev, netdev))
        return out

    def _read(self) -> list[tuple[str, str, str, str, dict[str, str]]]:
        """(prefix, device, port, netdev, {counter: text}) for every counter directory."""
        out = []
        for dev, netdev in self._targets():
            base = f"/sys/class/infiniband/{dev}"
            for port in self.host.listdir(f"{base}/ports"):
                for prefix, sub in (
                    ("metaroce_rdma_port", "counters"),
                    ("metaroce_rdma_hw", "hw_counters"),
                ):
                    values = self.host.read_dir_values(f"{base}/ports/{port}/{sub}")
                    if values:
                        out.append((prefix, dev, port, netdev, values))
            values = self.host.read_dir_values(f"{base}/hw_counters")
            if values:
                out.append(("metaroce_rdma_hw", dev, "", netdev, values))
        return out

    def render(self) -> str:
        """The counters in the Prometheus text format, rendered directly: the one way they
        are served (prometheus_client's per-sample formatting and validation costs more
        than reading the files on an 8-NIC node)."""
        groups: dict[str, list[str]] = {}
        names = self._names
        for prefix, dev, port, netdev, values in self._read():
            lbl = (
                f'{{device="{_escape(dev)}",netdev="{_escape(netdev)}",'
                f'network="{_escape(self.network)}",port="{_escape(port)}"}}'
            )
            for counter, text in values.items():
                if not text.isdigit() or counter in NOT_COUNTERS:
                    continue
                key = (prefix, counter)
                name = names.get(key)
                if name is None:
                    name = names[key] = metric_name(prefix, counter) + "_total"
                lines = groups.get(name)
                if lines is None:
                    doc = "RDMA port counter" if prefix.endswith("port") else "RDMA driver counter"
                    lines = groups[name] = [
                        f"# HELP {name} {doc} {counter}\n# TYPE {name} counter\n"
                    ]
                lines.append(f"{name}{lbl} {text}\n")
        return "".join(line for lines in groups.values() for line in lines)


class PluginState(Protocol):
    """What the device-plugin metrics need (`DevicePlugin.status()` has more)."""

    registered: bool
    registrations: int
    healthy_units: int
    total_units: int


PluginSource = Callable[[], tuple[str, PluginState] | None]
"""The network's resource name and its plugin's state; None while no plugin runs."""


class DevicePluginCollector(Collector):
    """The device plugin's state at scrape time: the metrics that explain a node whose
    allocatable resource is 0 (not registered) or lower than its devices (unhealthy)."""

    def __init__(self, network: str, source: PluginSource) -> None:
        self.network = network
        self.source = source

    def collect(self) -> Iterator[Metric]:
        found = self.source()
        if found is None:
            return
        resource, st = found
        labels = ["network", "resource"]
        registered = GaugeMetricFamily(
            "metaroce_agent_device_plugin_registered",
            "1 while the kubelet has the network's device plugin registered",
            labels=labels,
        )
        registered.add_metric([self.network, resource], 1 if st.registered else 0)
        units = GaugeMetricFamily(
            "metaroce_agent_device_plugin_units",
            "Units of the resource the plugin advertises, by health",
            labels=[*labels, "health"],
        )
        units.add_metric([self.network, resource, "healthy"], st.healthy_units)
        units.add_metric([self.network, resource, "unhealthy"], st.total_units - st.healthy_units)
        registrations = CounterMetricFamily(
            "metaroce_agent_device_plugin_registrations",
            "Registrations with the kubelet (one more after each kubelet restart)",
            labels=labels,
        )
        registrations.add_metric([self.network, resource], st.registrations)
        yield from (registered, units, registrations)


TRANSPORT_LABELS = ["network", "namespace", "pod", "container"]
TRANSPORT_COUNTERS = {
    "retransmits": ("metaroce_transport_retransmits", "Packets the pod's endpoints resent"),
    "dup_rcvd": (
        "metaroce_transport_duplicates_received",
        "Duplicates the pod's endpoints received: the peers' spurious retransmits",
    ),
    "spurious_rtos": (
        "metaroce_transport_spurious_rtos",
        "Retransmit timeouts an ACK later showed premature",
    ),
    "rtos": ("metaroce_transport_rtos", "Retransmit timeouts"),
    "tlps": ("metaroce_transport_tail_loss_probes", "Tail-loss probes sent"),
    "ce_rcvd": ("metaroce_transport_ce_received", "Packets received with ECN CE marked"),
    "ce_echoed": ("metaroce_transport_ce_echoed", "CE marks the peers echoed back to the pod"),
    "sack_holes": ("metaroce_transport_sack_holes", "Packets the peers' SACKs showed lost"),
    "pkts_sent": ("metaroce_transport_packets_sent", "Data packets sent"),
    "pkts_rcvd": ("metaroce_transport_packets_received", "Data packets received"),
    "bytes_sent": ("metaroce_transport_bytes_sent", "Payload bytes sent"),
    "bytes_rcvd": ("metaroce_transport_bytes_received", "Payload bytes received"),
    "bytes_acked": (
        "metaroce_transport_bytes_acked",
        "Payload bytes the peers acknowledged for the first time (goodput, no retransmits)",
    ),
    "msgs_sent": ("metaroce_transport_messages_sent", "Messages sent"),
    "msgs_rcvd": ("metaroce_transport_messages_received", "Messages received"),
    "path_failures": ("metaroce_transport_path_failures", "Paths declared failed"),
    "rnr_waits": ("metaroce_transport_rnr_waits", "Waits for a receiver not ready"),
    "conns_failed": ("metaroce_transport_connections_failed", "Connections that failed"),
}
"""Stats-file counter -> (metric, help). The names are literal so the chart's test can
check that every metric its alerts and dashboard use is exported."""


class TransportStatsCollector(Collector):
    """The MetaRoCE transport's counters of the pods on this node, per network and
    container (`transport.stats.TransportStats` reads and attributes the files).

    Label cardinality: one series per container and counter, never per path or peer.
    A pod's endpoints have up to 32 peers x 16 paths each, and path ids and peers change
    with every job, so per-path RTT and window would multiply the series by hundreds and
    churn them. They are exported as min, mean and max over the container's live paths
    (`stat` label): the max shows a bad path, the mean the typical one, and the file in
    the pod keeps the per-path detail.
    """

    def __init__(self, network: str, stats: TransportStats) -> None:
        self.network = network
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        from metaroce_agent.transport.stats import REFUSE_REASONS

        try:
            containers, unowned = self.stats.read()
        except Exception as e:  # a scrape never fails on the pods' files
            log.error("reading the transport's stats files failed: %s", e)
            containers, unowned = [], 0
        counters = {
            key: CounterMetricFamily(name, doc, labels=TRANSPORT_LABELS)
            for key, (name, doc) in TRANSPORT_COUNTERS.items()
        }
        goodput = GaugeMetricFamily(
            "metaroce_transport_goodput_bytes_per_second",
            "Payload bytes per second over the endpoints' last snapshot interval",
            labels=[*TRANSPORT_LABELS, "direction"],
        )
        endpoints = GaugeMetricFamily(
            "metaroce_transport_endpoints",
            "The pod's endpoints with a stats file, open or closed",
            labels=[*TRANSPORT_LABELS, "state"],
        )
        paths = GaugeMetricFamily(
            "metaroce_transport_paths",
            "Paths of the pod's open endpoints, failed or not",
            labels=[*TRANSPORT_LABELS, "state"],
        )
        srtt = GaugeMetricFamily(
            "metaroce_transport_path_srtt_microseconds",
            "Smoothed RTT over the pod's live paths (min, mean, max)",
            labels=[*TRANSPORT_LABELS, "stat"],
        )
        min_rtt = GaugeMetricFamily(
            "metaroce_transport_path_min_rtt_microseconds",
            "Minimum RTT over the pod's live paths (min, mean, max)",
            labels=[*TRANSPORT_LABELS, "stat"],
        )
        cwnd = GaugeMetricFamily(
            "metaroce_transport_path_cwnd_packets",
            "Congestion window over the pod's live paths (min, mean, max)",
            labels=[*TRANSPORT_LABELS, "stat"],
        )
        for c in containers:
            lv = [self.network, c.ref.namespace, c.ref.pod, c.ref.container]
            agg = c.stats
            for key, family in counters.items():
                if key in agg.counters:
                    family.add_metric(lv, agg.counters[key])
            goodput.add_metric([*lv, "sent"], agg.goodput_sent)
            goodput.add_metric([*lv, "received"], agg.goodput_rcvd)
            endpoints.add_metric([*lv, "open"], agg.endpoints_open)
            endpoints.add_metric([*lv, "closed"], agg.endpoints_closed)
            paths.add_metric([*lv, "ok"], agg.paths - agg.paths_failed)
            paths.add_metric([*lv, "failed"], agg.paths_failed)
            per_path = ((srtt, agg.srtt_us), (min_rtt, agg.min_rtt_us), (cwnd, agg.cwnd))
            for gauge, figures in per_path:
                if figures is not None:
                    for stat, value in zip(("min", "mean", "max"), figures, strict=True):
                        gauge.add_metric([*lv, stat], value)
        yield from counters.values()
        yield from (goodput, endpoints, paths, srtt, min_rtt, cwnd)
        unattributed = GaugeMetricFamily(
            "metaroce_transport_stats_unowned_allocations",
            "Stats directories no container on the node holds (removed after a grace period)",
            labels=["network"],
        )
        unattributed.add_metric([self.network], unowned)
        refused = CounterMetricFamily(
            "metaroce_transport_stats_files_refused",
            "Reads of stats files the agent refused (symlink, not regular, oversize, bad "
            "JSON or schema, too many)",
            labels=["network", "reason"],
        )
        for reason in REFUSE_REASONS:
            refused.add_metric([self.network, reason], self.stats.refused.get(reason, 0))
        yield from (unattributed, refused)


class AgentMetrics:
    """The agent's own metrics, in one registry with the RDMA counters."""

    def __init__(self, network: str, node: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.network = network
        self.info = Gauge(
            "metaroce_agent_info", "Agent version and placement (always 1)",
            ["version", "network", "node"], registry=r,
        )  # fmt: skip
        self.ready = Gauge("metaroce_agent_ready", "1 when the node is Ready", registry=r)
        self.apply_seconds = Histogram(
            "metaroce_agent_apply_duration_seconds", "Duration of apply passes",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r,
        )  # fmt: skip
        self.applies = Counter(
            "metaroce_agent_apply", "Apply passes by result", ["result"], registry=r
        )
        self.drift_repairs = Counter(
            "metaroce_agent_drift_repairs", "Knobs re-applied after someone changed them",
            ["knob"], registry=r,
        )  # fmt: skip
        self.drift_seconds = Gauge(
            "metaroce_agent_drift_check_seconds", "Duration of the last drift pass", registry=r
        )
        self.errors = Counter("metaroce_agent_errors", "Errors by step", ["step"], registry=r)
        self.knobs_applied = Gauge(
            "metaroce_agent_knobs_applied", "Knobs applied and read back", registry=r
        )
        self.knobs_skipped = Gauge(
            "metaroce_agent_knobs_skipped", "Knobs the node cannot set", registry=r
        )
        self.probe_latency = Gauge(
            "metaroce_probe_latency_microseconds",
            "Probe round-trip latency to a peer (RC; UDP pings on metaroce networks)",
            ["peer", "quantile"], registry=r,
        )  # fmt: skip
        self.probe_rtt = Histogram(
            "metaroce_probe_rtt_microseconds",
            "Probe round trips to peers (RC; UDP on metaroce networks)",
            buckets=(10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000), registry=r,
        )  # fmt: skip
        self.probe_loss = Gauge(
            "metaroce_probe_loss_ratio",
            "Probe loss to a peer (UD; a UDP burst on metaroce networks)",
            ["peer"],
            registry=r,
        )
        self.probe_rounds = Counter(
            "metaroce_probe_rounds", "Probe rounds by peer and result", ["peer", "result"],
            registry=r,
        )  # fmt: skip
        self.info.labels(version=_version(), network=network, node=node).set(1)

    def add_plugin_source(self, source: PluginSource) -> None:
        """Report the device plugin's state (read from `source` at each scrape)."""
        self.registry.register(DevicePluginCollector(self.network, source))

    def add_transport_stats(self, collector: TransportStatsCollector) -> None:
        """Serve the MetaRoCE transport's per-pod counters."""
        self.registry.register(collector)

    def add_rdma_collector(self, collector: RdmaCounterCollector) -> None:
        """Serve `collector`'s counters next to the registry (rendered by the collector)."""
        self.rdma = collector

    def render(self) -> bytes:
        """The whole /metrics body: the agent's registry, then the RDMA counters."""
        from prometheus_client import generate_latest

        body = generate_latest(self.registry)
        rdma = getattr(self, "rdma", None)
        return body + rdma.render().encode() if rdma is not None else body


def _version() -> str:
    from metaroce_agent import __version__

    return __version__


Check = Callable[[], tuple[bool, str]]
"""A health check: (passing, what it says)."""


class MetricsServer:
    """The HTTP endpoint: GET /metrics, and the `checks` by path (e.g. /readyz, /livez:
    200 when passing, 503 when not, the check's text as the body) -- a small threaded
    stdlib server."""

    def __init__(
        self,
        metrics: AgentMetrics,
        address: str,
        port: int,
        checks: Mapping[str, Check] | None = None,
    ) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        routes: dict[str, Check] = dict(checks or {})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path in routes:
                    self._check(routes[path])
                    return
                if path not in ("/metrics", "/"):
                    self.send_error(404, "try /metrics")
                    return
                try:
                    body = metrics.render()
                except Exception as e:  # a scrape must not kill the server
                    log.error("metrics scrape failed: %s", e)
                    self.send_error(500, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _check(self, check: Check) -> None:
                try:
                    passing, text = check()
                except Exception as e:  # a broken check fails; it must not kill the server
                    passing, text = False, f"the check failed: {e}"
                body = (text + "\n").encode()
                self.send_response(200 if passing else 503)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="metrics", daemon=True
        )
        self.thread.start()
        log.info("metrics on http://%s:%d/metrics", address, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
