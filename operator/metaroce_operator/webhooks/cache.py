"""What the webhook reads from the API, cached so that admission makes no API call on its
hot path (except the first lookup of a namespace's labels per TTL):

- `NetworkWatch`: every replica's own list+watch of MetaRoceNetworks, each object parsed
  once per change into a `NetworkView`;
- `NamespaceLabels`: a namespace's labels, fetched on demand, kept `ttl` seconds;
- `NodeLabels`: node name -> labels (metadata-only list), for network validation, kept
  `ttl` seconds (network writes are rare);
- `SecretWatch`: keeps a cert directory in step with the webhook certificate Secret, for
  replicas that do not mount it (the chart mounts it; tests and `--cert-secret` use this).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from metaroce_api import InvalidObject, MetaRoceNetwork, validate_network
from metaroce_api.constants import GROUP, NETWORK_PLURAL, VERSION
from metaroce_api.failpoints import failpoint
from metaroce_operator.webhooks import metrics
from metaroce_operator.webhooks.certs import CertBundle, write_cert_files
from metaroce_operator.webhooks.mutate import NetworkView

log = logging.getLogger("metaroce.webhooks.cache")


def view_of(obj: Mapping[str, Any]) -> NetworkView:
    name = str((obj.get("metadata") or {}).get("name", ""))
    try:
        return NetworkView(name, validate_network(obj))
    except InvalidObject as exc:
        return NetworkView(name, None, "; ".join(str(i) for i in exc.issues[:3]))


class NetworkWatch:
    """List+watch of MetaRoceNetworks in a thread; `views()` is a consistent snapshot."""

    def __init__(self, api_client: Any, *, resync_seconds: int = 300) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.resync_seconds = resync_seconds
        self.synced = threading.Event()
        self._views: dict[str, NetworkView] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None

    # -- reading --------------------------------------------------------------------

    def views(self) -> dict[str, NetworkView]:
        return self._views  # replaced wholesale on every change: safe to read unlocked

    def networks(self) -> list[MetaRoceNetwork]:
        return [v.network for v in self._views.values() if v.network is not None]

    def set_views(self, views: Mapping[str, NetworkView]) -> None:
        """Replace the cache (tests; also used by the watch loop)."""
        self._views = dict(views)
        metrics.NETWORKS_CACHED.set(len(self._views))

    # -- the watch ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="webhook-network-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _list(self) -> str:
        data: dict[str, Any] = self.api.list_cluster_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, NETWORK_PLURAL
        )
        self.set_views({v.name: v for v in map(view_of, data.get("items") or [])})
        self.synced.set()
        return str(data["metadata"]["resourceVersion"])

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        version: str | None = None
        backoff = 1.0  # doubles up to 10 s while the API fails (e.g. CRDs not installed)
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                    backoff = 1.0
                    log.info("webhook: %d MetaRoceNetwork(s) loaded", len(self._views))
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    self.api.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    NETWORK_PLURAL,
                    resource_version=version,
                    timeout_seconds=self.resync_seconds,
                    allow_watch_bookmarks=True,
                ):
                    if self._stop.is_set():
                        break
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            version = None  # expired: list again
                        break
                    version = str(obj["metadata"]["resourceVersion"])
                    if kind == "BOOKMARK":
                        continue
                    views = dict(self._views)
                    if kind == "DELETED":
                        views.pop(obj["metadata"]["name"], None)
                    else:
                        view = view_of(obj)
                        views[view.name] = view
                    self.set_views(views)
            except ApiException as exc:
                if exc.status == 410:
                    version = None
                    continue
                if self._stop.is_set():
                    return
                log.warning(
                    "webhook: watching MetaRoceNetworks failed (%s %s); retrying in %.0f s",
                    exc.status,
                    exc.reason,
                    backoff,
                )
                version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception as exc:  # keep watching whatever happens
                if self._stop.is_set():
                    return
                log.warning(
                    "webhook: watching MetaRoceNetworks failed (%s); retrying in %.0f s",
                    exc,
                    backoff,
                )
                version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)


class _TtlCache:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._items: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, Any]:
        with self._lock:
            hit = self._items.get(key)
        if hit is not None and hit[0] > self.clock():
            return True, hit[1]
        return False, None

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            if len(self._items) > 10_000:
                self._items.clear()
            self._items[key] = (self.clock() + self.ttl, value)


class RefreshingCache:
    """Values fetched by `fetch(key)`, kept fresh without blocking readers.

    - the first read of a key fetches it; concurrent readers of that key wait for the
      same fetch (one API call, not one per request), at most `wait` seconds;
    - a value older than `ttl` is still returned at once, while one background fetch
      refreshes it (stale-while-revalidate): after the first read, no admission waits on
      the API server again, which matters because the API server is waiting on us;
    - a failed fetch keeps the old value (or returns None when there is none).
    """

    def __init__(
        self,
        fetch: Callable[[str], Any],
        ttl: float = 30.0,
        wait: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fetch = fetch
        self.ttl = ttl
        self.wait = wait
        self.clock = clock
        self._values: dict[str, tuple[float, Any]] = {}
        self._inflight: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            hit = self._values.get(key)
            running = self._inflight.get(key)
            start = running is None and (hit is None or hit[0] <= self.clock())
            if start:
                running = self._inflight[key] = threading.Event()
        if start:
            assert running is not None
            if hit is None:
                self._refresh(key, running)  # first read: fetch in this thread
            else:
                threading.Thread(
                    target=self._refresh, args=(key, running), daemon=True, name="cache-refresh"
                ).start()
        if hit is not None:
            return hit[1]
        assert running is not None
        running.wait(self.wait)
        with self._lock:
            got = self._values.get(key)
        return got[1] if got is not None else None

    def _refresh(self, key: str, done: threading.Event) -> None:
        try:
            value = self.fetch(key)
        except Exception as exc:
            log.warning("webhook: refreshing %s failed (%s); keeping what is cached", key, exc)
        else:
            with self._lock:
                if len(self._values) > 10_000:
                    self._values.clear()
                self._values[key] = (self.clock() + self.ttl, value)
        finally:
            with self._lock:
                self._inflight.pop(key, None)
            done.set()


class NamespaceLabels:
    """Labels of a namespace, read from the API once, then refreshed every `ttl` seconds in
    the background (`RefreshingCache`).

    None when they cannot be read (the Pod Security check is then skipped: PodSecurity
    admission itself still applies, with its own message)."""

    def __init__(self, api_client: Any, ttl: float = 30.0) -> None:
        from kubernetes import client

        self.api = client.CoreV1Api(api_client)
        self.cache = RefreshingCache(self._fetch, ttl)

    def _fetch(self, name: str) -> Mapping[str, str] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            ns = self.api.read_namespace(name, _request_timeout=5)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict((ns.metadata and ns.metadata.labels) or {})

    def get(self, name: str) -> Mapping[str, str] | None:
        value: Mapping[str, str] | None = self.cache.get(name)
        return value


class NodeLabels:
    """Node name -> labels from a metadata-only list, cached for `ttl` seconds."""

    ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"

    def __init__(self, api_client: Any, ttl: float = 30.0) -> None:
        from kubernetes import client

        self.api: Any = client.CoreV1Api(api_client)  # raw responses: typed loosely
        self.cache = _TtlCache(ttl)

    def _page(self, token: str) -> dict[str, Any]:
        try:  # metadata only: a fraction of full Node objects
            response = self.api.list_node(
                limit=500,
                _continue=token or None,
                _headers={"Accept": self.ACCEPT},
                _preload_content=False,
                _request_timeout=10,
            )
            page: dict[str, Any] = json.loads(response.data)
            return page
        except TypeError:  # an older client without `_headers`: full objects
            nodes = self.api.list_node(limit=500, _continue=token or None, _request_timeout=10)
            return {
                "items": [
                    {"metadata": {"name": n.metadata.name, "labels": n.metadata.labels}}
                    for n in nodes.items
                ],
                "metadata": {"continue": nodes.metadata._continue},
            }

    def get(self) -> Mapping[str, Mapping[str, str]] | None:
        hit, value = self.cache.get("nodes")
        if hit:
            return value  # type: ignore[no-any-return]
        nodes: dict[str, Mapping[str, str]] = {}
        token = ""
        try:
            while True:
                page = self._page(token)
                for item in page.get("items") or []:
                    meta = item.get("metadata", {})
                    nodes[meta["name"]] = dict(meta.get("labels") or {})
                token = page.get("metadata", {}).get("continue") or ""
                if not token:
                    break
        except Exception as exc:
            log.warning("webhook: cannot list nodes (%s); judging selectors alone", exc)
            return None
        self.cache.put("nodes", nodes)
        return nodes


class SecretWatch:
    """Keep `directory` (tls.crt, tls.key, ca.crt) in step with a Secret, via a watch."""

    def __init__(self, api_client: Any, namespace: str, name: str, directory: Path) -> None:
        from kubernetes import client

        self.api = client.CoreV1Api(api_client)
        self.namespace, self.name, self.directory = namespace, name, directory
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._last: CertBundle | None = None
        self._watch: Any = None

    def sync_once(self) -> bool:
        """Read the Secret now and write the files if it changed; True when files exist."""
        from kubernetes.client.exceptions import ApiException

        try:
            secret = self.api.read_namespaced_secret(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return self.ready.is_set()
            raise
        self._write(secret.data)  # type: ignore[arg-type]
        return self.ready.is_set()

    def show(self, bundle: CertBundle) -> None:
        """Write a bundle the leader just put in the Secret (its watch event follows)."""
        self._write(bundle.secret_data())

    def _write(self, data: Mapping[str, str] | None) -> None:
        bundle = CertBundle.from_secret_data(dict(data or {}))
        if bundle is None or bundle == self._last:
            return
        write_cert_files(bundle, self.directory)
        failpoint("certs.after_reload")  # every replica: files written, server not reloaded
        self._last = bundle
        self.ready.set()
        log.info("webhook: certificate files updated from Secret %s/%s", self.namespace, self.name)

    def start(self) -> None:
        threading.Thread(target=self._run, name="webhook-secret-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                self.sync_once()
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    self.api.list_namespaced_secret,
                    self.namespace,
                    field_selector=f"metadata.name={self.name}",
                    timeout_seconds=300,
                ):
                    if self._stop.is_set():
                        break
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._write(event["object"].data)
            except Exception as exc:
                log.warning(
                    "webhook: watching Secret %s/%s failed (%s)", self.namespace, self.name, exc
                )
                self._stop.wait(1.0)
