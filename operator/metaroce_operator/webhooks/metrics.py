"""Prometheus metrics of the admission webhooks (in the default registry, so the operator's
metrics endpoint serves them too)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY = Histogram(
    "metaroce_webhook_request_duration_seconds",
    "Time from reading an AdmissionReview to writing the answer, by endpoint.",
    ["endpoint"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
DECISIONS = Counter(
    "metaroce_webhook_decisions_total",
    "Admission decisions by endpoint and outcome (allowed, denied; error and unavailable are "
    "answered as HTTP errors, left to the failurePolicy).",
    ["endpoint", "decision"],
)
NETWORKS_CACHED = Gauge(
    "metaroce_webhook_networks_cached", "MetaRoceNetworks in this replica's webhook cache."
)
CERT_RELOADS = Counter(
    "metaroce_webhook_certificate_reloads_total",
    "Serving certificate (re)loads from the certificate files, by result.",
    ["result"],
)
CONNECTIONS = Counter(
    "metaroce_webhook_connections_total",
    "TLS connections accepted (the apiserver reuses them: this grows far slower than requests).",
    ["result"],
)
