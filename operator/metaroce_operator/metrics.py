"""Prometheus metrics of the operator (served on --metrics-port at /metrics)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "metaroce_operator_reconciles_total",
    "Reconciles of networks (render + apply), by result.",
    ["network", "result"],
)
RECONCILE_SECONDS = Histogram(
    "metaroce_operator_reconcile_duration_seconds",
    "Time to render and apply a network's children.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ERRORS = Counter(
    "metaroce_operator_errors_total",
    "Errors by where they happened (reconcile, status, nodes, lease).",
    ["where"],
)
NETWORK_NODES = Gauge(
    "metaroce_network_nodes",
    "Nodes of a network by state (desired, configured, healthy, failed).",
    ["network", "state"],
)
STATUS_WRITES = Counter(
    "metaroce_operator_status_writes_total",
    "Status writes (batched: at most one per network per status interval).",
    ["network"],
)
LEADER = Gauge("metaroce_operator_leader", "1 while this replica holds the lease.")
FOREIGN_NETWORKS = Gauge(
    "metaroce_operator_foreign_networks",
    "Networks claimed by another operator, which this one leaves alone (claim.py).",
)
TAINT_CHANGES = Counter(
    "metaroce_operator_taint_changes_total", "Node taints added or removed.", ["network"]
)


def set_network_nodes(network: str, counts: dict[str, int]) -> None:
    for state, value in counts.items():
        NETWORK_NODES.labels(network=network, state=state).set(value)


def forget_network(network: str) -> None:
    for state in ("desired", "configured", "healthy", "failed"):
        with contextlib.suppress(KeyError):
            NETWORK_NODES.remove(network, state)
