"""The HTTPS server of the admission webhooks (stdlib: socketserver threads + ssl).

Endpoints: `POST /mutate-pod`, `POST /validate-network` (AdmissionReview v1 in and out),
`GET /healthz` (200 once the network cache is loaded, else 503).

- TLS from `tls.crt`/`tls.key` in a directory (a mounted Secret, or one `SecretWatch`
  keeps in step); the files are checked every `reload_interval` seconds and a changed
  pair is loaded into a *new* SSLContext that new connections use (a half-written pair
  fails to load and is retried: the old certificate keeps serving meanwhile);
- keep-alive HTTP/1.1, TCP_NODELAY, one write per answer: the apiserver reuses its
  connections and the answer leaves in one TLS record;
- bounded: at most `max_connections` connections (a new one beyond closes the one idle
  longest, then the one reading longest; only when every one is answering is the new one
  refused), a `request_timeout` from a request's first byte to its last (a trickle of
  headers cannot hold a slot), an `idle_timeout` between requests, `MAX_BODY` per review
  and `MAX_BODY_BYTES_IN_FLIGHT` for all bodies being read at once (503 beyond: the
  failurePolicy decides). A flood still costs the apiserver's calls their connection:
  the chart's optional NetworkPolicy keeps everyone else out;
- every replica serves from its own `NetworkWatch`; a request that arrives before the
  first list completes waits up to `sync_timeout` and is then answered with HTTP 503;
  an internal error with HTTP 500. Never with `allowed: false`: the apiserver honours a
  denial whatever the failurePolicy, while a call error is left to the policy (the
  chart's `Fail` for annotated pods, or `Ignore` where an admin chose to fail open).

`serve_main(argv)` runs it standalone (`python -m metaroce_operator.webhooks`); the
operator can embed `WebhookApp` instead (see `WebhookApp.start`).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import socketserver
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metaroce_api.constants import WEBHOOK_MUTATE_PATH, WEBHOOK_VALIDATE_PATH
from metaroce_operator.kube import Credentials, Kube, load_credentials
from metaroce_operator.webhooks import certs, metrics
from metaroce_operator.webhooks.apiloop import ApiLoop
from metaroce_operator.webhooks.mutate import (
    DEFAULT_ATTACHMENT_NAMESPACE,
    Allowed,
    Denied,
    Namespace,
    NetworkView,
    mutate_pod,
)
from metaroce_operator.webhooks.validate import validate_network_change

log = logging.getLogger("metaroce.webhooks")

MUTATE_PATH = WEBHOOK_MUTATE_PATH
VALIDATE_PATH = WEBHOOK_VALIDATE_PATH
HEALTH_PATHS = ("/healthz", "/readyz")


# --- admission logic over the caches ----------------------------------------------------------


class WebhookUnavailable(Exception):
    """The webhook cannot decide (cache not loaded, internal error): answered as an HTTP
    error so that the webhook's failurePolicy decides, not as a denial."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class AdmissionHandler:
    """AdmissionReview dict in, AdmissionReview dict out; no I/O beyond the caches."""

    def __init__(
        self,
        networks: Callable[[], Mapping[str, NetworkView]],
        synced: threading.Event,
        namespace_labels: Callable[[str], Mapping[str, str] | None],
        node_labels: Callable[[], Mapping[str, Mapping[str, str]] | None] = lambda: None,
        *,
        check_pod_security: bool = True,
        default_pod_security: str = "privileged",
        sync_timeout: float = 2.0,
        allowed_agent_images: Sequence[str] | None = None,
        attachment_namespace: str = DEFAULT_ATTACHMENT_NAMESPACE,
    ) -> None:
        self.allowed_agent_images = allowed_agent_images
        self.attachment_namespace = attachment_namespace
        self.networks = networks
        self.synced = synced
        self.namespace_labels = namespace_labels
        self.node_labels = node_labels
        self.check_pod_security = check_pod_security
        self.default_pod_security = default_pod_security
        self.sync_timeout = sync_timeout

    def _wait_synced(self) -> None:
        if self.synced.is_set() or self.synced.wait(self.sync_timeout):
            return
        raise WebhookUnavailable(
            503,
            "ServiceUnavailable",
            "the metaroce webhook has not loaded the MetaRoceNetworks yet (the operator is "
            "starting, or cannot reach the API server): retry in a few seconds; if this "
            "persists, read the operator's log",
        )

    def mutate(self, request: Mapping[str, Any]) -> Allowed | Denied:
        if request.get("operation") != "CREATE":
            return Allowed()
        pod = request.get("object") or {}
        namespace = request.get("namespace") or (pod.get("metadata") or {}).get("namespace", "")
        self._wait_synced()
        return mutate_pod(
            pod,
            self.networks(),
            Namespace(namespace, self.namespace_labels(namespace)),
            check_pod_security=self.check_pod_security,
            default_pod_security=self.default_pod_security,
            attachment_namespace=self.attachment_namespace,
        )

    def validate(self, request: Mapping[str, Any]) -> Allowed | Denied:
        if request.get("operation") not in ("CREATE", "UPDATE"):
            return Allowed()
        obj = request.get("object") or {}
        old = request.get("oldObject") or None
        if old is not None and old.get("spec") == obj.get("spec"):
            return Allowed()  # matchConditions skip these already; belt and braces
        self._wait_synced()
        others = [v.network for v in self.networks().values() if v.network is not None]
        verdict = validate_network_change(
            obj,
            others,
            self.node_labels(),
            old=old,
            allowed_agent_images=self.allowed_agent_images,
        )
        name = (obj.get("metadata") or {}).get("name", "")
        if not verdict.allowed:
            return Denied(verdict.message(name), code=422, reason="Invalid")
        return Allowed(warnings=verdict.warnings)

    def review(self, endpoint: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The AdmissionReview answer; raises `WebhookUnavailable` when it cannot decide."""
        request = body.get("request") or {}
        uid = request.get("uid", "")
        try:
            handle = self.mutate if endpoint == MUTATE_PATH else self.validate
            decision = handle(request)
        except WebhookUnavailable:
            metrics.DECISIONS.labels(endpoint=endpoint, decision="unavailable").inc()
            raise
        except Exception as exc:
            log.exception("webhook %s failed", endpoint)
            metrics.DECISIONS.labels(endpoint=endpoint, decision="error").inc()
            raise WebhookUnavailable(
                500,
                "InternalError",
                f"internal error in the metaroce webhook ({type(exc).__name__}: {exc}); "
                "read the operator's log",
            ) from exc
        outcome = "allowed" if isinstance(decision, Allowed) else "denied"
        metrics.DECISIONS.labels(endpoint=endpoint, decision=outcome).inc()
        return {
            "apiVersion": body.get("apiVersion", "admission.k8s.io/v1"),
            "kind": "AdmissionReview",
            "response": response_for(uid, decision),
        }


def response_for(uid: str, decision: Allowed | Denied) -> dict[str, Any]:
    if isinstance(decision, Denied):
        return {
            "uid": uid,
            "allowed": False,
            "status": {
                "code": decision.code,
                "reason": decision.reason,
                "message": decision.message,
            },
        }
    out: dict[str, Any] = {"uid": uid, "allowed": True}
    if decision.patch:
        out["patchType"] = "JSONPatch"
        out["patch"] = base64.b64encode(
            json.dumps(decision.patch, separators=(",", ":")).encode()
        ).decode()
    if decision.warnings:
        out["warnings"] = list(decision.warnings)
    return out


# --- TLS with reload ------------------------------------------------------------------------------


class TlsFiles:
    """A server SSLContext from `cert`/`key` files, rebuilt when the files change."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self._signature: tuple[Any, ...] | None = None
        self.context: ssl.SSLContext | None = None
        self.loaded_at = 0.0
        self.reload()

    def _stat(self) -> tuple[Any, ...] | None:
        try:
            a, b = os.stat(self.cert), os.stat(self.key)
        except OSError:
            return None
        return (a.st_ino, a.st_mtime_ns, a.st_size, b.st_ino, b.st_mtime_ns, b.st_size)

    def reload(self) -> bool:
        """Load the files if they changed; True when a new context is in use."""
        signature = self._stat()
        if signature is None or signature == self._signature:
            return False
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        ctx.num_tickets = 0  # the apiserver does not resume sessions: skip the work
        try:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (ssl.SSLError, OSError) as exc:
            # e.g. the key was replaced and the certificate not yet: try again next time
            metrics.CERT_RELOADS.labels(result="failed").inc()
            log.warning("webhook: loading %s failed (%s); keeping the current one", self.cert, exc)
            return False
        self.context = ctx
        self._signature = signature
        self.loaded_at = time.time()
        metrics.CERT_RELOADS.labels(result="loaded").inc()
        log.info("webhook: serving certificate loaded from %s", self.cert)
        return True


# --- HTTP ---------------------------------------------------------------------------------------


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    411: "Length Required",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
MAX_BODY = 4 << 20
"""An AdmissionReview carries the object and, on UPDATE, the old one: objects are bounded
by etcd's 1.5 MiB request limit, the apiserver's request bodies by 3 MiB."""
MAX_BODY_BYTES_IN_FLIGHT = 64 << 20
"""All bodies being read at once (the server's memory under a flood of large requests)."""
HEADER_LIMIT = 65536


class ByteBudget:
    """A count of bytes shared by the connections' threads: take before reading a body."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


SlotState = str
"""'idle' (handshaking, or between requests), 'reading' (a request is arriving) or
'answering' (the review is being decided)."""


def pick_eviction(slots: Mapping[Any, tuple[SlotState, float]]) -> Any | None:
    """The connection to close for a new one: the one idle longest, else the one reading
    longest; never one being answered (that would fail a review the apiserver sent)."""
    for state in ("idle", "reading"):
        since = {key: at for key, (s, at) in slots.items() if s == state}
        if since:
            return min(since, key=lambda key: since[key])
    return None


class ConnectionSlots:
    """At most `limit` connections, each known by its file descriptor so that the accept
    thread can shut one down under the thread serving it. A slot is released before its
    socket is closed, so a descriptor number reused by a later connection is never shut
    down by mistake."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._slots: dict[int, tuple[SlotState, float]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def admit(self, fd: int) -> bool:
        """Take a slot for a new connection (closing another if all are taken)."""
        with self._lock:
            if len(self._slots) >= self.limit:
                victim = pick_eviction(self._slots)
                if victim is None:
                    return False
                state, _ = self._slots.pop(victim)
                metrics.CONNECTIONS.labels(result=f"evicted-{state}").inc()
                evicted = socket.socket(fileno=victim)
                with contextlib.suppress(OSError):
                    evicted.shutdown(socket.SHUT_RDWR)
                evicted.detach()  # its own thread closes it
            self._slots[fd] = ("idle", time.monotonic())
            return True

    def mark(self, fd: int, state: SlotState) -> None:
        with self._lock:
            if fd in self._slots:
                self._slots[fd] = (state, time.monotonic())

    def release(self, fd: int) -> None:
        with self._lock:
            self._slots.pop(fd, None)


def _response(code: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
        % (code, _REASONS.get(code, "").encode(), content_type, len(body))
        + body
    )


def _noop(_state: SlotState) -> None:
    pass


def serve_connection(
    conn: Any,
    app: AdmissionHandler,
    *,
    idle_timeout: float | None = None,
    request_timeout: float | None = None,
    budget: ByteBudget | None = None,
    state: Callable[[SlotState], None] = _noop,
) -> None:
    """Answer HTTP/1.1 requests on one (TLS) connection until the peer closes it.

    A small keep-alive loop instead of BaseHTTPRequestHandler: the apiserver sends one
    POST with a Content-Length at a time, and this costs a fraction of the CPU (the
    webhook's CPU is the apiserver's latency). Each answer leaves in one write.
    `idle_timeout` bounds the wait for a request's first byte, `request_timeout` the
    time from it to the request's last byte (socket.timeout ends the connection)."""
    buf = b""
    idle = idle_timeout if idle_timeout is not None else conn.gettimeout()
    while True:
        deadline = None
        if buf:  # a pipelined request: its clock runs already
            deadline = _deadline(request_timeout)
            state("reading")
        while b"\r\n\r\n" not in buf:
            conn.settimeout(idle if deadline is None else _left(deadline) or idle)
            chunk = conn.recv(65536)
            if not chunk:
                return
            if deadline is None:
                deadline = _deadline(request_timeout)
                state("reading")
            buf += chunk
            if len(buf) > HEADER_LIMIT and b"\r\n\r\n" not in buf:
                conn.sendall(_response(413, b'{"error":"headers too large"}'))
                return
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        try:
            method, target, _version = lines[0].split(b" ", 2)
        except ValueError:
            conn.sendall(_response(400, b'{"error":"bad request line"}'))
            return
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(b":")
            headers[key.strip().lower()] = value.strip()
        if b"transfer-encoding" in headers:
            conn.sendall(_response(411, b'{"error":"send a Content-Length"}'))
            return
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            conn.sendall(_response(413, b'{"error":"bad Content-Length (at most 4 MiB)"}'))
            return
        if budget is not None and not budget.take(length):
            conn.sendall(_response(503, b'{"error":"too many large requests at once"}'))
            return
        try:
            while len(rest) < length:
                if deadline is not None:
                    conn.settimeout(_left(deadline))
                chunk = conn.recv(max(65536, length - len(rest)))
                if not chunk:
                    return
                rest += chunk
            body, buf = rest[:length], rest[length:]
            state("answering")
            path = target.split(b"?", 1)[0].decode("latin-1")
            conn.sendall(_answer(method, path, body, app))
        finally:
            if budget is not None:
                budget.give(length)
        state("idle")
        if headers.get(b"connection", b"").lower() == b"close":
            return


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request did not arrive within its deadline")
    return left


def _status_body(exc: WebhookUnavailable) -> bytes:
    """A metav1.Status: the apiserver's client shows its message in the call error."""
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": exc.code,
        "reason": exc.reason,
        "message": exc.message,
    }
    return json.dumps(status, separators=(",", ":")).encode()


def _answer(method: bytes, path: str, body: bytes, app: AdmissionHandler) -> bytes:
    if method == b"GET":
        if path in HEALTH_PATHS:
            ok = app.synced.is_set()
            text = b"ok" if ok else b"networks not loaded"
            return _response(200 if ok else 503, text, b"text/plain")
        return _response(404, b"not found", b"text/plain")
    if method != b"POST" or path not in (MUTATE_PATH, VALIDATE_PATH):
        return _response(404, b'{"error":"unknown path"}')
    started = time.perf_counter()
    try:
        review = json.loads(body)
    except ValueError:
        return _response(400, b'{"error":"body is not JSON"}')
    try:
        answer = app.review(path, review)
    except WebhookUnavailable as exc:
        return _response(exc.code, _status_body(exc))
    data = _response(200, json.dumps(answer, separators=(",", ":")).encode())
    metrics.LATENCY.labels(endpoint=path).observe(time.perf_counter() - started)
    return data


class _HttpsServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    request_queue_size = 256
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], app: AdmissionHandler, tls: TlsFiles, options: ServerOptions
    ) -> None:
        self.app = app
        self.tls = tls
        self.options = options
        self.slots = ConnectionSlots(options.max_connections)
        self.budget = ByteBudget(MAX_BODY_BYTES_IN_FLIGHT)
        super().__init__(address, socketserver.BaseRequestHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # On the accept thread: take a slot before a thread is started for the connection.
        if not self.slots.admit(request.fileno()):
            metrics.CONNECTIONS.labels(result="refused").inc()
            log.warning(
                "webhook: %d connections are all answering reviews; refused one from %s",
                self.slots.limit,
                client_address,
            )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's own thread: the TLS handshake never blocks accept().
        fd = request.fileno()
        ctx = self.tls.context
        conn = None
        try:
            if ctx is None:
                return
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request.settimeout(self.options.handshake_timeout)
            conn = ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
            try:
                conn.do_handshake()
            except (ssl.SSLError, OSError) as exc:
                metrics.CONNECTIONS.labels(result="handshake-failed").inc()
                log.debug("webhook: TLS handshake with %s failed: %s", client_address, exc)
                return
            metrics.CONNECTIONS.labels(result="accepted").inc()

            def state(value: SlotState) -> None:
                self.slots.mark(fd, value)

            serve_connection(
                conn,
                self.app,
                idle_timeout=self.options.idle_timeout,
                request_timeout=self.options.request_timeout,
                budget=self.budget,
                state=state,
            )
        except (OSError, ssl.SSLError) as exc:
            log.debug("webhook: connection from %s ended: %s", client_address, exc)
        finally:
            self.slots.release(fd)  # before the descriptor can be reused
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()

    def shutdown_request(self, request: Any) -> None:
        # finish_request closed the TLS wrapper (which owns the descriptor) already.
        if request.fileno() != -1:
            super().shutdown_request(request)


@dataclass
class ServerOptions:
    cert_dir: Path
    address: str = "0.0.0.0"
    port: int = 8443
    reload_interval: float = 2.0
    idle_timeout: float = 30.0
    """Seconds a connection may wait for its next request (the apiserver's client keeps
    idle connections 90 s and opens a new one when the server closed its)."""
    request_timeout: float = 10.0
    """Seconds from a request's first byte to its last (the apiserver's webhook timeout
    is at most 30 s, 10 s by default)."""
    handshake_timeout: float = 5.0
    max_connections: int = 256
    """HTTP/1.1 carries one review per connection at a time: this is also the most
    reviews answered at once (the apiserver opens a connection per concurrent call)."""


class WebhookServer:
    """The HTTPS server in background threads; `port` is the bound port (0 = any)."""

    def __init__(self, options: ServerOptions, app: AdmissionHandler) -> None:
        self.options = options
        self.app = app
        self.tls = TlsFiles(options.cert_dir / "tls.crt", options.cert_dir / "tls.key")
        self._httpd: _HttpsServer | None = None
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        if self.tls.context is None:
            raise RuntimeError(
                f"no serving certificate in {self.options.cert_dir} (tls.crt, tls.key): mount "
                "the webhook Secret there, or pass --cert-secret / --manage-certs"
            )
        self._httpd = _HttpsServer(
            (self.options.address, self.options.port), self.app, self.tls, self.options
        )
        threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.5},
            daemon=True,
            name="webhook-https",
        ).start()
        threading.Thread(target=self._reload_loop, daemon=True, name="webhook-tls-reload").start()
        log.info("webhook: serving https on %s:%d", self.options.address, self.port)

    def _reload_loop(self) -> None:
        while not self._stop.wait(self.options.reload_interval):
            self.tls.reload()

    def stop(self) -> None:
        self._stop.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


# --- latency tuning of the process ----------------------------------------------------------------

SWITCH_INTERVAL = 0.0005
"""Seconds a Python thread may hold the GIL while another one waits (default 0.005). A
request thread woken by the apiserver's bytes would otherwise wait up to 5 ms behind a
thread doing CPU work (another request, a cache refresh, kopf in the operator)."""
GC_THRESHOLD = (20_000, 50, 50)
"""Young-generation collections every 20,000 allocations instead of 700: admission
requests allocate acyclic JSON, so frequent cyclic collections only add pauses."""


def tune_for_latency() -> None:
    """Process-wide settings for a low admission tail latency (both the standalone server
    and the operator call it once their long-lived objects exist)."""
    import sys

    sys.setswitchinterval(SWITCH_INTERVAL)
    gc.set_threshold(*GC_THRESHOLD)
    # What is loaded so far lives as long as the process: keep it out of the cyclic GC,
    # whose full passes would otherwise stop every request thread for tens of ms.
    gc.collect()
    gc.freeze()


# --- the whole thing, embeddable --------------------------------------------------------------


@dataclass
class AppOptions:
    cert_dir: Path | None = None
    """Directory with tls.crt/tls.key (a mounted Secret). None: a private temp dir, filled
    from `cert_secret`."""
    cert_secret: str | None = None
    """`namespace/name` of the certificate Secret, read through the API (no volume)."""
    manage_certs: bool = False
    """Create/rotate the Secret and write caBundles (what the leader does)."""
    service: str = "metaroce-webhook"
    service_namespace: str = "metaroce-system"
    mutating_configs: Sequence[str] = ()
    """MutatingWebhookConfigurations whose caBundle the leader writes (the chart's
    `<fullname>-pods`)."""
    validating_configs: Sequence[str] = ()
    """ValidatingWebhookConfigurations likewise (the chart's `<fullname>-networks`)."""
    cert_check_interval: float = 3600.0
    address: str = "0.0.0.0"
    port: int = 8443
    check_pod_security: bool = True
    default_pod_security: str = "privileged"
    """The cluster's PodSecurity default enforce level (namespaces without the label)."""
    namespace_ttl: float = 30.0
    node_ttl: float = 30.0
    sync_timeout: float = 2.0
    reload_interval: float = 2.0
    allowed_agent_images: Sequence[str] | None = None
    """The images networks may name in spec.agent.image (the operator's allowlist, see
    `images`); None: not checked (a standalone webhook given none)."""
    attachment_namespace: str = DEFAULT_ATTACHMENT_NAMESPACE
    """The agents' namespace, where the networks' NetworkAttachmentDefinitions are."""


class WebhookApp:
    """Network watch + caches + (optional) certificate Secret sync/rotation + HTTPS server.

    The operator embeds it as: `app = WebhookApp(options, creds); app.start()` in every
    replica (with `cert_secret` or a mounted `cert_dir`), and awaits
    `app.rotate_certificates(kube)` from the leader only, on its own loop and client (a
    standalone single-replica webhook sets `manage_certs`: the rotation then runs on the
    webhook's API loop). Every API read goes through `ApiLoop`, the operator's client on
    a loop of the webhook's own. `app.stop()` on shutdown."""

    def __init__(self, options: AppOptions, creds: Credentials) -> None:
        from metaroce_operator.webhooks.cache import (
            NamespaceLabels,
            NetworkWatch,
            NodeLabels,
            SecretWatch,
        )

        self.options = options
        self.creds = creds
        self.api = ApiLoop(creds)
        self.watch = NetworkWatch(self.api)
        self.namespaces = NamespaceLabels(self.api, options.namespace_ttl)
        self.nodes = NodeLabels(self.api, options.node_ttl)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        cert_dir = options.cert_dir
        if cert_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="metaroce-webhook-certs-")
            cert_dir = Path(self._tmp.name)
        self.cert_dir = cert_dir
        secret = options.cert_secret or (
            f"{options.service_namespace}/{options.service}-tls" if options.manage_certs else None
        )
        self.secret_ref = tuple(secret.split("/", 1)) if secret else None
        self.secret_watch = (
            SecretWatch(self.api, self.secret_ref[0], self.secret_ref[1], cert_dir)
            if self.secret_ref and options.cert_dir is None
            else None
        )
        self.handler = AdmissionHandler(
            self.watch.views,
            self.watch.synced,
            self.namespaces.get,
            self.nodes.get,
            check_pod_security=options.check_pod_security,
            default_pod_security=options.default_pod_security,
            sync_timeout=options.sync_timeout,
            allowed_agent_images=options.allowed_agent_images,
            attachment_namespace=options.attachment_namespace,
        )
        self.server: WebhookServer | None = None
        self._stop = threading.Event()

    async def rotate_certificates(
        self, kube: Kube, *, force: bool = False, force_ca: bool = False
    ) -> str | None:
        """Leader: make the Secret valid (create/rotate) and publish its CA bundle, through
        `kube` (the operator's own client: the leader passes its lease-gated view)."""
        if self.secret_ref is None:
            raise RuntimeError("no certificate Secret configured: pass cert_secret")
        namespace, name = self.secret_ref
        bundle, changed = await certs.ensure_secret(
            kube,
            namespace,
            name,
            certs.service_dns_names(self.options.service, self.options.service_namespace),
            force=force,
            force_ca=force_ca,
        )
        await certs.patch_ca_bundles(
            kube,
            bundle.ca_bundle,
            mutating=self.options.mutating_configs,
            validating=self.options.validating_configs,
        )
        if self.secret_watch is not None:
            self.secret_watch.show(bundle)  # now, rather than when the watch sees it
        return changed

    def _rotate_standalone(self) -> str | None:
        """`manage_certs` (a standalone, single-replica webhook): one rotation on the
        webhook's own API loop."""
        return self.api.call(self.rotate_certificates, timeout=120)

    def _rotation_loop(self) -> None:
        while not self._stop.wait(self.options.cert_check_interval):
            try:
                self._rotate_standalone()
            except Exception as exc:
                log.warning("webhook: certificate check failed (%s); retrying later", exc)

    def start(self, wait_certificates: float | None = 60.0) -> None:
        """Watch, wait for the certificate, serve. `wait_certificates=None` waits as long as
        it takes (an operator replica whose leader has not written the Secret yet) and
        returns without serving only when `stop()` is called meanwhile."""
        self.watch.start()
        if self.options.manage_certs:
            self._rotate_standalone()
            threading.Thread(target=self._rotation_loop, daemon=True, name="webhook-certs").start()
        if self.secret_watch is not None:
            self.secret_watch.start()
            if not self._wait_certificates(wait_certificates):
                if self._stop.is_set():
                    return
                raise RuntimeError(
                    f"the certificate Secret {'/'.join(self.secret_ref or ())} did not appear "
                    f"within {wait_certificates or 0:.0f} s: is the leader running with "
                    "--manage-certs, or cert-manager installed?"
                )
        server = WebhookServer(
            ServerOptions(
                cert_dir=self.cert_dir,
                address=self.options.address,
                port=self.options.port,
                reload_interval=self.options.reload_interval,
            ),
            self.handler,
        )
        server.start()
        self.server = server

    def _wait_certificates(self, timeout: float | None) -> bool:
        assert self.secret_watch is not None
        if timeout is not None:
            return self.secret_watch.ready.wait(timeout)
        waited = 0.0
        while not self._stop.is_set():
            if self.secret_watch.ready.wait(5.0):
                return True
            waited += 5.0
            if waited % 60 == 0:
                log.warning(
                    "webhook: still waiting for the certificate Secret %s (%.0f s): the leader "
                    "creates it (or cert-manager does)",
                    "/".join(self.secret_ref or ()),
                    waited,
                )
        return False

    def ready(self) -> tuple[bool, str]:
        """Serving with a certificate and a synced network cache (the replica's readiness)."""
        secret = "/".join(self.secret_ref or ()) or str(self.cert_dir)
        server = self.server
        if server is None or server.tls.context is None:
            return False, f"webhook has no serving certificate yet (from {secret})"
        if not self.watch.synced.is_set():
            return False, "webhook has not loaded the MetaRoceNetworks yet"
        return True, f"webhook serving on port {server.port}"

    def stop(self) -> None:
        self._stop.set()
        if self.secret_watch is not None:
            self.secret_watch.stop()
        self.watch.stop()
        if self.server is not None:
            self.server.stop()
        self.api.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


# --- command line ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m metaroce_operator.webhooks",
        description="Serve the MetaRoCE admission webhooks (pod mutation, network validation).",
    )
    p.add_argument("--address", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8443, help="HTTPS port (default 8443)")
    p.add_argument(
        "--cert-dir",
        type=Path,
        help="directory with tls.crt and tls.key (the mounted webhook Secret); reloaded on change",
    )
    p.add_argument(
        "--cert-secret",
        metavar="NAMESPACE/NAME",
        help="read the certificate Secret through the API instead of a mounted directory "
        "(default with --manage-certs: SERVICE_NAMESPACE/SERVICE-tls)",
    )
    p.add_argument(
        "--manage-certs",
        action="store_true",
        help="create/rotate the certificate Secret and write the caBundles (one replica only)",
    )
    p.add_argument("--service", default="metaroce-webhook", help="webhook Service name")
    p.add_argument(
        "--service-namespace", default="metaroce-system", help="namespace of the webhook Service"
    )
    p.add_argument(
        "--mutating-config",
        action="append",
        default=[],
        help="MutatingWebhookConfiguration whose caBundle to write (repeatable; with "
        "--manage-certs)",
    )
    p.add_argument(
        "--validating-config",
        action="append",
        default=[],
        help="ValidatingWebhookConfiguration whose caBundle to write (repeatable; with "
        "--manage-certs)",
    )
    p.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, then $KUBECONFIG)")
    p.add_argument(
        "--no-pod-security-check",
        action="store_true",
        help="do not refuse pods in namespaces whose Pod Security level forbids IPC_LOCK",
    )
    p.add_argument(
        "--pod-security-default",
        default="privileged",
        choices=["privileged", "baseline", "restricted"],
        help="the cluster's PodSecurity default enforce level, for namespaces without the "
        "label (default privileged, the Kubernetes default)",
    )
    p.add_argument(
        "--allowed-agent-image",
        action="append",
        default=None,
        metavar="IMAGE",
        help="an image networks may name in spec.agent.image (repeatable; the operator's "
        "--agent-image and --allowed-agent-image); without it, images are not checked",
    )
    p.add_argument("--namespace-cache-ttl", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = none)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def serve_main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.cert_dir is None and args.cert_secret is None and not args.manage_certs:
        _parser().error(
            "give --cert-dir, --cert-secret or --manage-certs: the server needs a certificate"
        )
    if args.manage_certs and not (args.mutating_config or args.validating_config):
        _parser().error(
            "--manage-certs writes caBundles: name the configurations with --mutating-config "
            "and --validating-config (the chart's <fullname>-pods and <fullname>-networks)"
        )
    if args.cert_secret and "/" not in args.cert_secret:
        _parser().error(f"--cert-secret {args.cert_secret!r}: write NAMESPACE/NAME")
    options = AppOptions(
        cert_dir=args.cert_dir,
        cert_secret=args.cert_secret,
        manage_certs=args.manage_certs,
        service=args.service,
        service_namespace=args.service_namespace,
        mutating_configs=tuple(args.mutating_config),
        validating_configs=tuple(args.validating_config),
        address=args.address,
        port=args.port,
        check_pod_security=not args.no_pod_security_check,
        default_pod_security=args.pod_security_default,
        namespace_ttl=args.namespace_cache_ttl,
        allowed_agent_images=tuple(args.allowed_agent_image) if args.allowed_agent_image else None,
    )
    if args.allowed_agent_image is None:
        log.warning("no --allowed-agent-image given: spec.agent.image is not checked")
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    app = WebhookApp(options, load_credentials(args.kubeconfig))
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        app.start()
    except RuntimeError as exc:
        log.error("%s", exc)
        app.stop()
        return 1
    tune_for_latency()
    done.wait()
    app.stop()
    return 0
