"""A small Kubernetes API client: the few calls the agent makes, over the standard library.

The agent creates its NodeState and patches its status, watches its network for
deletion and lists its peers' NodeStates. The official client costs ~35 MB of RSS and
half a second of start-up for that; this one speaks HTTPS with `ssl` and `http.client`,
from a kubeconfig (client certificates or token) or the in-cluster service account
(its token re-read on every request, so rotated tokens work). Requests reuse one
keep-alive connection (a TLS handshake costs the apiserver more CPU than a small
write); watches get their own.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import ssl
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("metaroce.agent.kube")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
STALE_CONNECTION = (
    http.client.RemoteDisconnected,
    BrokenPipeError,
    ConnectionResetError,
    ssl.SSLEOFError,
)
"""A kept-alive connection the server closed meanwhile: reconnect and send again. Over
TLS a close without close_notify reads as SSLEOFError ("EOF occurred in violation of
protocol"): both guests' agents lost their first NodeState write to it in CI."""


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class KubeClient:
    host: str
    port: int
    context: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None
    timeout: float = 30.0
    _conn_kept: http.client.HTTPSConnection | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _conn_lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    # --- construction ------------------------------------------------------------------
    @classmethod
    def from_kubeconfig(cls, path: str | Path) -> KubeClient:
        try:
            cfg = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise KubeError(0, f"cannot read kubeconfig {path}: {e}") from e
        ctx_name = cfg.get("current-context")
        contexts = {c["name"]: c["context"] for c in cfg.get("contexts") or []}
        context: dict[str, Any] = contexts.get(ctx_name) or next(iter(contexts.values()), {})
        clusters = {c["name"]: c["cluster"] for c in cfg.get("clusters") or []}
        users = {u["name"]: u.get("user") or {} for u in cfg.get("users") or []}
        cluster = clusters.get(context.get("cluster")) or next(iter(clusters.values()), None)
        if cluster is None:
            raise KubeError(0, f"kubeconfig {path} has no cluster")
        user = users.get(context.get("user"), {})
        if not cluster.get("server"):
            raise KubeError(0, f"kubeconfig {path}: its cluster has no server (https://HOST:PORT)")
        base = Path(path).parent
        ssl_ctx = ssl.create_default_context()
        try:
            if cluster.get("insecure-skip-tls-verify"):
                ssl_ctx.check_hostname = False
                ssl_ctx.verify_mode = ssl.CERT_NONE
            elif cluster.get("certificate-authority-data"):
                ssl_ctx.load_verify_locations(
                    cadata=base64.b64decode(cluster["certificate-authority-data"]).decode()
                )
            elif cluster.get("certificate-authority"):
                ssl_ctx.load_verify_locations(cafile=str(base / cluster["certificate-authority"]))
            cert = _material(user, "client-certificate", base)
            key = _material(user, "client-key", base)
            if cert and key:
                _load_chain(ssl_ctx, cert, key)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            # ssl's own errors name no file: say which kubeconfig and which entry.
            ca = cluster.get("certificate-authority") or "certificate-authority-data"
            raise KubeError(
                0, f"kubeconfig {path}: cannot load its CA ({ca}) or client certificate: {e}"
            ) from e
        host, port = _split_server(cluster["server"])
        token = user.get("token")
        token_file = Path(user["tokenFile"]) if user.get("tokenFile") else None
        return cls(host, port, ssl_ctx, token=token, token_file=token_file)

    @classmethod
    def in_cluster(cls) -> KubeClient:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = int(os.environ.get("KUBERNETES_SERVICE_PORT", "443"))
        if not host:
            raise KubeError(
                0,
                "not in a pod (KUBERNETES_SERVICE_HOST unset) and no --kubeconfig given: "
                "pass --kubeconfig PATH, or --no-report to run without the API",
            )
        ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        return cls(host, port, ctx, token_file=SA_DIR / "token")

    @classmethod
    def load(cls, kubeconfig: str | None) -> KubeClient:
        path = kubeconfig or os.environ.get("KUBECONFIG")
        return cls.from_kubeconfig(path) if path else cls.in_cluster()

    # --- requests ----------------------------------------------------------------------
    def _headers(self, content_type: str | None, accept: str | None = None) -> dict[str, str]:
        h = {"Accept": accept or "application/json", "User-Agent": "metaroce-agent"}
        token = self.token
        if self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError:
                token = self.token
        if token:
            h["Authorization"] = f"Bearer {token}"
        if content_type:
            h["Content-Type"] = content_type
        return h

    def _conn(self, timeout: float | None) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            self.host, self.port, context=self.context, timeout=timeout or self.timeout
        )

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str | None = None,
        params: dict[str, str] | None = None,
        accept: str | None = None,
    ) -> dict[str, Any]:
        """`accept`: e.g. METADATA_LIST, for the objects' metadata only."""
        if params:
            path = f"{path}?{urllib.parse.urlencode(params)}"
        data = None if body is None else json.dumps(body).encode()
        if data is not None and content_type is None:
            content_type = "application/json"
        headers = self._headers(content_type, accept)
        with self._conn_lock:
            for attempt in (0, 1):
                reused = self._conn_kept is not None
                conn = self._conn_kept or self._conn(None)
                self._conn_kept = None
                try:
                    conn.request(method, path, body=data, headers=headers)
                    resp = conn.getresponse()
                    raw = resp.read()
                except STALE_CONNECTION as e:
                    conn.close()
                    if reused and attempt == 0:
                        continue  # the server closed the idle connection: once more, fresh
                    raise KubeError(0, f"{method} {path}: cannot reach the apiserver: {e}") from e
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    raise KubeError(0, f"{method} {path}: cannot reach the apiserver: {e}") from e
                if resp.will_close:
                    conn.close()
                else:
                    self._conn_kept = conn
                break
        try:
            obj = json.loads(raw or b"{}")
        except ValueError:
            obj = {"message": raw[:300].decode(errors="replace")}
        if resp.status >= 400:
            raise KubeError(resp.status, f"{method} {path}: {resp.status} {obj.get('message', '')}")
        return obj if isinstance(obj, dict) else {"items": obj}

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def close(self) -> None:
        with self._conn_lock:
            if self._conn_kept is not None:
                self._conn_kept.close()
                self._conn_kept = None

    def create(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """POST `body` to the collection at `path` (409 when it exists)."""
        return self.request("POST", path, body, params={"fieldManager": field_manager})

    def merge_patch(self, path: str, patch: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): cheaper for the apiserver than an apply."""
        return self.request(
            "PATCH", path, patch, content_type=MERGE_PATCH, params={"fieldManager": field_manager}
        )

    def apply(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        return self.request(
            "PATCH",
            path,
            body,
            content_type=APPLY_PATCH,
            params={"fieldManager": field_manager, "force": "true"},
        )

    def watch(
        self,
        path: str,
        params: dict[str, str],
        timeout: float = 330.0,
        *,
        accept: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Events (`{"type": ..., "object": ...}`) of a watch, until the server ends it;
        `accept` METADATA_WATCH for the objects' metadata only."""
        query = urllib.parse.urlencode({**params, "watch": "true"})
        conn = self._conn(timeout)
        try:
            conn.request("GET", f"{path}?{query}", headers=self._headers(None, accept))
            resp = conn.getresponse()
            if resp.status >= 400:
                raise KubeError(resp.status, f"watch {path}: {resp.status} {resp.read()[:300]!r}")
            while True:
                line = resp.readline()
                if not line:
                    return
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    yield event
        except OSError as e:
            raise KubeError(0, f"watch {path}: {e}") from e
        finally:
            conn.close()


METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
"""Accept header of a list that returns only each object's metadata."""
METADATA_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


def _split_server(server: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(server)
    if u.scheme != "https" or not u.hostname:
        raise KubeError(0, f"apiserver {server!r} must be an https:// URL")
    return u.hostname, u.port or 443


def _material(user: dict[str, Any], key: str, base: Path) -> bytes | None:
    if user.get(f"{key}-data"):
        return base64.b64decode(str(user[f"{key}-data"]))
    if user.get(key):
        return (base / str(user[key])).read_bytes()
    return None


def _load_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """`load_cert_chain` wants files: write both to a private temp dir, load, delete."""
    with tempfile.TemporaryDirectory(prefix="metaroce-agent-") as tmp:
        cpath, kpath = Path(tmp) / "c.pem", Path(tmp) / "k.pem"
        cpath.write_bytes(cert)
        kpath.touch(mode=0o600)
        kpath.write_bytes(key)
        ctx.load_cert_chain(str(cpath), str(kpath))


def cluster_path(group: str, version: str, plural: str, name: str | None = None) -> str:
    p = f"/apis/{group}/{version}/{plural}"
    return f"{p}/{name}" if name else p
