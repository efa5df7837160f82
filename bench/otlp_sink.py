"""A minimal OTLP/gRPC trace receiver: the apiserver exports its spans here.

The apiserver's admission-latency histogram has buckets at 5 and 25 ms, too coarse to
tell a p99 of 6 ms from one of 20 ms. Its traces are exact: with tracing on, the
mutating dispatcher wraps every webhook call in a "Call mutating webhook" span. The
apiserver samples parent-based, so with a sampling rate of 0 only the requests whose
client sends a sampled `traceparent` header are traced (cheap for everything else).

    sink = SpanSink().start()
    LocalCluster(extra_apiserver_args=[f"--tracing-config-file={sink.config_file(dir)}"])
    ...requests with headers {"traceparent": traceparent()}...
    durations = sink.durations("Call mutating webhook", webhook="pods.metaroce.io")
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from metaroce_harness.cluster import free_port


def traceparent() -> str:
    """A fresh W3C trace context with the sampled flag set."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.port = free_port()
        self._lock = threading.Lock()
        self._spans: list[tuple[str, dict[str, str], float]] = []
        self._full: list[Span] = []
        self._server: grpc.Server | None = None

    def start(self) -> SpanSink:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1)

    def config_file(self, directory: Path) -> Path:
        path = directory / "apiserver-tracing.yaml"
        path.write_text(
            "apiVersion: apiserver.config.k8s.io/v1\n"
            "kind: TracingConfiguration\n"
            f"endpoint: 127.0.0.1:{self.port}\n"
            "samplingRatePerMillion: 0\n"
        )
        return path

    def Export(  # the gRPC method's name
        self, request: Any, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        full = []
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attrs = {a.key: a.value.string_value for a in span.attributes}
                    seconds = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
                    got.append((span.name, attrs, seconds))
                    full.append(
                        Span(
                            span.trace_id.hex(),
                            span.name,
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            {e.name: e.time_unix_nano for e in span.events},
                        )
                    )
        with self._lock:
            self._spans.extend(got)
            self._full.extend(full)
        return trace_service_pb2.ExportTraceServiceResponse()

    def count(self) -> int:
        with self._lock:
            return len(self._spans)

    def durations(self, name: str, **attrs: str) -> list[float]:
        with self._lock:
            return [
                s
                for n, a, s in self._spans
                if n == name and all(a.get(k) == v for k, v in attrs.items())
            ]

    def wait_for(self, name: str, count: int, timeout: float = 30.0, **attrs: str) -> list[float]:
        """The durations once `count` spans arrived (the exporter batches every ~5 s)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.durations(name, **attrs)
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._full.clear()

    def admission_windows(self) -> list[float]:
        """Per traced pod create: seconds from the "Create" span's event "About to store
        object in database" (the handler is done decoding; mutating admission comes next)
        to the start of its "Create etcd3" span (the write, after mutating admission, the
        registry's defaulting and validation, and validating admission). The same window
        for every way of admitting a pod: a webhook call and in-process policies alike.
        (The apiserver traces webhook calls, "Call mutating webhook", but has no span for
        admission policies: v1.37 k8s.io/apiserver/pkg/admission/plugin/policy.)"""
        by_trace: dict[str, dict[str, Span]] = {}
        with self._lock:
            for span in self._full:
                if span.name in (CREATE_SPAN, ETCD_CREATE_SPAN):
                    by_trace.setdefault(span.trace_id, {})[span.name] = span
        out = []
        for spans in by_trace.values():
            create, etcd = spans.get(CREATE_SPAN), spans.get(ETCD_CREATE_SPAN)
            if create is None or etcd is None or STORE_EVENT not in create.events:
                continue
            out.append((etcd.start - create.events[STORE_EVENT]) / 1e9)
        return out

    def wait_for_windows(self, count: int, timeout: float = 30.0) -> list[float]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.admission_windows()
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.5)


CREATE_SPAN = "Create"
"""k8s.io/apiserver/pkg/endpoints/handlers/create.go: the handler's span."""
ETCD_CREATE_SPAN = "Create etcd3"
"""k8s.io/apiserver/pkg/storage/etcd3/store.go: the storage write."""
STORE_EVENT = "About to store object in database"
"""The handler's event right before admission and the registry's create."""


@dataclass(frozen=True)
class Span:
    trace_id: str
    name: str
    start: int
    end: int
    events: dict[str, int]
    """event name -> time (ns since the epoch)."""
