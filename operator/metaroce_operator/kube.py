"""A small async Kubernetes REST client (aiohttp) that speaks plain dicts.

Why not the official client: its v37 API classes are synchronous (threads per call) and
deserialise into generated models, while the operator only needs a handful of verbs on a
handful of kinds, as JSON. Credentials still come from the official loader, so kubeconfig
files, embedded certificates and in-cluster service-account tokens all work.

Every request that changes state passes a write gate: the leader-election code installs
one that refuses writes the moment the lease is not held (`NotLeader`), so a replica that
lost the lease cannot write even from a task that has not been cancelled yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

log = logging.getLogger("metaroce.operator.kube")

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(RuntimeError):
    """The apiserver answered with an error status."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.body = body
        try:
            message = str(json.loads(body).get("message", body))
        except (ValueError, AttributeError):
            message = body
        self.message = message
        super().__init__(f"{method} {path}: HTTP {status}: {message[:500]}")


class NotLeader(RuntimeError):
    """A write was attempted by a replica that does not hold the lease."""


@dataclass(frozen=True)
class Credentials:
    """Where the apiserver is and how to authenticate (from kubeconfig or in-cluster)."""

    server: str
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False
    token_source: Callable[[], str | None] | None = None
    """Called per request: in-cluster tokens are rotated on disk."""

    def token(self) -> str | None:
        return self.token_source() if self.token_source else None


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """Credentials from `kubeconfig`, else $KUBECONFIG / ~/.kube/config, else in-cluster."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=cfg, persist_config=False
        )
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                client_configuration=cfg, persist_config=False
            )

    def token() -> str | None:
        header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
            "authorization"
        )
        if not header:
            return None
        return header.split(" ", 1)[1] if header.lower().startswith("bearer ") else header

    return Credentials(
        server=str(cfg.host).rstrip("/"),
        ca_path=cfg.ssl_ca_cert or None,
        cert_path=cfg.cert_file or None,
        key_path=cfg.key_file or None,
        insecure=not cfg.verify_ssl,
        token_source=token,
    )


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST API."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool

    def path(self, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [prefix]
        if self.namespaced:
            if namespace is None:
                # Listing across namespaces.
                if name is not None:
                    raise ValueError(f"{self.kind} {name!r} needs a namespace")
            else:
                parts.append(f"namespaces/{quote(namespace)}")
        parts.append(self.plural)
        if name is not None:
            parts.append(quote(name))
        if sub:
            parts.append(sub)
        return "/".join(parts)


def _kinds() -> dict[tuple[str, str], Kind]:
    from metaroce_api import constants as c

    table = [
        Kind("v1", "ConfigMap", "configmaps", True),
        Kind("v1", "ServiceAccount", "serviceaccounts", True),
        Kind("v1", "Secret", "secrets", True),
        Kind("v1", "Node", "nodes", False),
        Kind("v1", "Namespace", "namespaces", False),
        Kind("v1", "Event", "events", True),
        Kind("v1", "Pod", "pods", True),
        Kind("apps/v1", "DaemonSet", "daemonsets", True),
        Kind("apps/v1", "ControllerRevision", "controllerrevisions", True),
        Kind("rbac.authorization.k8s.io/v1", "ClusterRole", "clusterroles", False),
        Kind("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "clusterrolebindings", False),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles", True),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", True),
        Kind("coordination.k8s.io/v1", "Lease", "leases", True),
        Kind(
            "admissionregistration.k8s.io/v1",
            "MutatingWebhookConfiguration",
            "mutatingwebhookconfigurations",
            False,
        ),
        Kind(
            "admissionregistration.k8s.io/v1",
            "ValidatingWebhookConfiguration",
            "validatingwebhookconfigurations",
            False,
        ),
        Kind(
            "admissionregistration.k8s.io/v1",
            "MutatingAdmissionPolicy",
            "mutatingadmissionpolicies",
            False,
        ),
        Kind(
            "admissionregistration.k8s.io/v1",
            "MutatingAdmissionPolicyBinding",
            "mutatingadmissionpolicybindings",
            False,
        ),
        Kind(c.API_VERSION, c.NETWORK_KIND, c.NETWORK_PLURAL, False),
        Kind(c.API_VERSION, c.NODESTATE_KIND, c.NODESTATE_PLURAL, False),
        # Multus's CRD (a cluster prerequisite of podNetwork macvlan/ipvlan, not ours)
        Kind(
            "k8s.cni.cncf.io/v1",
            "NetworkAttachmentDefinition",
            "network-attachment-definitions",
            True,
        ),
    ]
    return {(k.api_version, k.kind): k for k in table}


KINDS = _kinds()


def kind_of(obj: Mapping[str, Any]) -> Kind:
    """The `Kind` of an object by its apiVersion and kind."""
    key = (str(obj.get("apiVersion")), str(obj.get("kind")))
    try:
        return KINDS[key]
    except KeyError:
        raise ValueError(f"unknown kind {key[1]} ({key[0]}): add it to kube.KINDS") from None


def lookup_kind(kind: str, api_version: str | None = None) -> Kind:
    for k in KINDS.values():
        if k.kind == kind and (api_version is None or k.api_version == api_version):
            return k
    raise ValueError(f"unknown kind {kind}")


class Kube:
    """The async client. One per event loop; `gated()` gives a view with a write gate."""

    def __init__(
        self,
        creds: Credentials,
        *,
        user_agent: str = "metaroce-operator",
        timeout: float = 30.0,
        gate: Callable[[], bool] | None = None,
        _shared: Kube | None = None,
    ) -> None:
        self.creds = creds
        self.user_agent = user_agent
        self.timeout = timeout
        self.gate = gate
        self._shared = _shared
        self._session: aiohttp.ClientSession | None = None
        self.writes = 0
        """Write requests sent through this view (for tests and metrics)."""

    def gated(self, gate: Callable[[], bool]) -> Kube:
        """A view sharing this client's connections whose writes need `gate()` to be true."""
        return Kube(
            self.creds,
            user_agent=self.user_agent,
            timeout=self.timeout,
            gate=gate,
            _shared=self._root(),
        )

    def _root(self) -> Kube:
        return self._shared._root() if self._shared else self

    def _ssl(self) -> ssl.SSLContext | bool:
        if self.creds.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.creds.ca_path)
        if self.creds.cert_path and self.creds.key_path:
            ctx.load_cert_chain(self.creds.cert_path, self.creds.key_path)
        return ctx

    async def session(self) -> aiohttp.ClientSession:
        root = self._root()
        if root._session is None or root._session.closed:
            connector = aiohttp.TCPConnector(ssl=root._ssl(), limit=32)
            root._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=root.timeout),
                headers={"User-Agent": root.user_agent},
            )
        return root._session

    async def close(self) -> None:
        root = self._root()
        if root._session is not None:
            await root._session.close()
            root._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | None = None,
        accept: str = "application/json",
    ) -> dict[str, Any]:
        """One API call; JSON in, JSON out. Raises `ApiError` or `NotLeader`."""
        if method != "GET" and self.gate is not None and not self.gate():
            raise NotLeader(f"refusing {method} {path}: this replica does not hold the lease")
        headers = {"Accept": accept}
        token = self.creds.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body, sort_keys=True)
        if method != "GET":
            self.writes += 1
        session = await self.session()
        async with session.request(
            method,
            self.creds.server + path,
            params=params,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout or self._root().timeout),
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(method, path, resp.status, text)
            if not text:
                return {}
            result: dict[str, Any] = json.loads(text)
            return result

    # -- verbs ----------------------------------------------------------------------------

    async def get(self, kind: Kind, name: str, namespace: str | None = None) -> dict[str, Any]:
        return await self.request("GET", kind.path(namespace, name))

    async def get_or_none(
        self, kind: Kind, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        try:
            return await self.get(kind, name, namespace)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list_items(
        self,
        kind: Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        cached: bool = False,
    ) -> list[dict[str, Any]]:
        """Every item (paged); `cached` reads from the apiserver's watch cache (cheaper)."""
        items: list[dict[str, Any]] = []
        params: dict[str, str] = {}
        if label_selector:
            params["labelSelector"] = label_selector
        if cached:
            params["resourceVersion"] = "0"
        else:
            params["limit"] = "500"
        while True:
            page = await self.request("GET", kind.path(namespace), params=params)
            items += page.get("items") or []
            cont = (page.get("metadata") or {}).get("continue")
            if not cont or cached:
                return items
            params["continue"] = cont

    async def list_with_version(
        self,
        kind: Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """One consistent list and its resourceVersion (to start a watch from)."""
        params = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        page = await self.request("GET", kind.path(namespace), params=params)
        return page.get("items") or [], str((page.get("metadata") or {}).get("resourceVersion"))

    async def watch(
        self,
        kind: Kind,
        namespace: str | None = None,
        *,
        resource_version: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout: int = 300,
        bookmarks: bool = False,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) events from `resource_version` on, until the server ends the
        watch. An ERROR event (e.g. 410 Gone) is yielded for the caller to re-list."""
        params = {"watch": "true", "resourceVersion": resource_version}
        params["timeoutSeconds"] = str(timeout)
        if bookmarks:
            params["allowWatchBookmarks"] = "true"
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        headers = {"Accept": "application/json"}
        token = self.creds.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        session = await self.session()
        async with session.get(
            self.creds.server + kind.path(namespace),
            params=params,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout + 30),
        ) as resp:
            if resp.status >= 400:
                raise ApiError("WATCH", kind.path(namespace), resp.status, await resp.text())
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        event = json.loads(line)
                        yield str(event.get("type")), event.get("object") or {}

    async def apply(
        self, obj: Mapping[str, Any], *, field_manager: str, subresource: str = ""
    ) -> dict[str, Any]:
        """Server-side apply with `force` (the operator owns what it renders)."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        path = kind.path(meta.get("namespace"), meta["name"], subresource)
        return await self.request(
            "PATCH",
            path,
            params={"fieldManager": field_manager, "force": "true"},
            body=obj,
            content_type=APPLY_PATCH,
        )

    async def patch(
        self,
        kind: Kind,
        name: str,
        body: Any,
        *,
        namespace: str | None = None,
        content_type: str = MERGE_PATCH,
        subresource: str = "",
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        params = {"fieldManager": field_manager} if field_manager else None
        return await self.request(
            "PATCH",
            kind.path(namespace, name, subresource),
            body=body,
            content_type=content_type,
            params=params,
        )

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        return await self.request(
            "POST", kind.path((obj.get("metadata") or {}).get("namespace")), body=obj
        )

    async def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        meta = obj["metadata"]
        return await self.request("PUT", kind.path(meta.get("namespace"), meta["name"]), body=obj)

    async def delete_collection(
        self, kind: Kind, namespace: str | None = None, *, label_selector: str
    ) -> None:
        """Delete every object of `kind` matching the selector, in one request."""
        # The apiserver deletes one by one before answering: allow it time.
        await self.request(
            "DELETE", kind.path(namespace), params={"labelSelector": label_selector}, timeout=300
        )

    async def delete(
        self,
        kind: Kind,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
    ) -> bool:
        """Delete; True if deleted, False if already gone. `uid` guards against a re-creation."""
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            await self.request("DELETE", kind.path(namespace, name), body=body)
        except ApiError as err:
            if err.status in (404, 409):
                return False
            raise
        return True


async def retrying(
    what: str, call: Callable[[], Any], *, attempts: int = 5, delay: float = 0.5
) -> Any:
    """Retry a call on transient errors (connection problems, 429, 5xx)."""
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except ApiError as err:
            if err.status not in (429, 500, 502, 503, 504) or attempt == attempts:
                raise
            log.info("%s: HTTP %s, retrying (%d/%d)", what, err.status, attempt, attempts)
        except (TimeoutError, aiohttp.ClientError) as err:
            if attempt == attempts:
                raise
            log.info("%s: %s, retrying (%d/%d)", what, err, attempt, attempts)
        await asyncio.sleep(delay * attempt)
    raise AssertionError("unreachable")
