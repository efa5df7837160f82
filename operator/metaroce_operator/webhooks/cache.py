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

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from metaroce_api import InvalidObject, MetaRoceNetwork, validate_network
from metaroce_api.constants import API_VERSION, NETWORK_KIND
from metaroce_api.failpoints import failpoint
from metaroce_operator.informer import Informer
from metaroce_operator.kube import KINDS, ApiError, Kube
from metaroce_operator.webhooks import metrics
from metaroce_operator.webhooks.apiloop import ApiLoop
from metaroce_operator.webhooks.certs import CertBundle, write_cert_files
from metaroce_operator.webhooks.mutate import NetworkView

log = logging.getLogger("metaroce.webhooks.cache")
NETWORK = KINDS[(API_VERSION, NETWORK_KIND)]
NAMESPACE = KINDS[("v1", "Namespace")]
NODE = KINDS[("v1", "Node")]
SECRET = KINDS[("v1", "Secret")]


def view_of(obj: Mapping[str, Any]) -> NetworkView:
    name = str((obj.get("metadata") or {}).get("name", ""))
    try:
        return NetworkView(name, validate_network(obj))
    except InvalidObject as exc:
        return NetworkView(name, None, "; ".join(str(i) for i in exc.issues[:3]))


class NetworkWatch:
    """List+watch of MetaRoceNetworks (an `Informer` on the webhook's API loop);
    `views()` is a consistent snapshot, `synced` is set once the first list is in."""

    def __init__(self, api: ApiLoop | None) -> None:
        self.api = api
        self.synced = threading.Event()
        self._views: dict[str, NetworkView] = {}

    # -- reading --------------------------------------------------------------------

    def views(self) -> dict[str, NetworkView]:
        return self._views  # replaced wholesale on every change: safe to read unlocked

    def networks(self) -> list[MetaRoceNetwork]:
        return [v.network for v in self._views.values() if v.network is not None]

    def set_views(self, views: Mapping[str, NetworkView]) -> None:
        """Replace the cache (tests; also used by the watch)."""
        self._views = dict(views)
        metrics.NETWORKS_CACHED.set(len(self._views))

    # -- the watch ----------------------------------------------------------------------

    def on_event(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """One watch event (None: an item of a list), on the API loop."""
        views = dict(self._views)
        if event_type == "DELETED":
            views.pop(str(obj["metadata"]["name"]), None)
        else:
            view = view_of(obj)
            views[view.name] = view
        self.set_views(views)

    def start(self) -> None:
        if self.api is None:
            raise RuntimeError("no API client: the network watch cannot start")
        self.api.spawn(self._run)

    async def _run(self, kube: Kube) -> None:
        informer = Informer(
            kube, NETWORK, self.on_event, failpoint_name="webhook.networks.before_list"
        )
        task = asyncio.create_task(informer.run(), name="webhook network watch")
        try:
            await informer.synced.wait()
            self.synced.set()
            log.info("webhook: %d MetaRoceNetwork(s) loaded", len(self._views))
            await task
        finally:
            task.cancel()

    def stop(self) -> None:
        """The API loop's `stop` ends the watch."""


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

    def __init__(self, api: ApiLoop | None, ttl: float = 30.0) -> None:
        self.api = api
        self.cache = RefreshingCache(self._fetch, ttl)

    def _fetch(self, name: str) -> Mapping[str, str] | None:
        if self.api is None:
            return None

        async def read(kube: Kube) -> dict[str, Any]:
            return await kube.request("GET", NAMESPACE.path(None, name), timeout=5)

        try:
            ns = self.api.call(read, timeout=6)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return dict((ns.get("metadata") or {}).get("labels") or {})

    def get(self, name: str) -> Mapping[str, str] | None:
        value: Mapping[str, str] | None = self.cache.get(name)
        return value


class NodeLabels:
    """Node name -> labels from a metadata-only list, cached for `ttl` seconds."""

    ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"

    def __init__(self, api: ApiLoop | None, ttl: float = 30.0) -> None:
        self.api = api
        self.cache = _TtlCache(ttl)

    async def _list(self, kube: Kube) -> dict[str, Mapping[str, str]]:
        nodes: dict[str, Mapping[str, str]] = {}
        params = {"limit": "500"}
        while True:  # metadata only: a fraction of full Node objects
            page = await kube.request(
                "GET", NODE.path(), params=params, accept=self.ACCEPT, timeout=10
            )
            for item in page.get("items") or []:
                meta = item.get("metadata", {})
                nodes[meta["name"]] = dict(meta.get("labels") or {})
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return nodes
            params["continue"] = token

    def get(self) -> Mapping[str, Mapping[str, str]] | None:
        hit, value = self.cache.get("nodes")
        if hit:
            return value  # type: ignore[no-any-return]
        if self.api is None:
            return None
        try:
            nodes = self.api.call(self._list, timeout=30)
        except Exception as exc:
            log.warning("webhook: cannot list nodes (%s); judging selectors alone", exc)
            return None
        self.cache.put("nodes", nodes)
        return nodes


class SecretWatch:
    """Keep `directory` (tls.crt, tls.key, ca.crt) in step with a Secret, via a watch."""

    def __init__(self, api: ApiLoop, namespace: str, name: str, directory: Path) -> None:
        self.api = api
        self.namespace, self.name, self.directory = namespace, name, directory
        self.ready = threading.Event()
        self._last: CertBundle | None = None
        self._lock = threading.Lock()

    def sync_once(self) -> bool:
        """Read the Secret now and write the files if it changed; True when files exist."""

        async def read(kube: Kube) -> dict[str, Any] | None:
            return await kube.get_or_none(SECRET, self.name, self.namespace)

        secret = self.api.call(read, timeout=30)
        if secret is not None:
            self._write(secret.get("data"))
        return self.ready.is_set()

    def show(self, bundle: CertBundle) -> None:
        """Write a bundle the leader just put in the Secret (its watch event follows)."""
        self._write(bundle.secret_data())

    def _write(self, data: Mapping[str, str] | None) -> None:
        bundle = CertBundle.from_secret_data(dict(data or {}))
        with self._lock:  # the watch (API loop) and the leader (its loop) both write
            if bundle is None or bundle == self._last:
                return
            write_cert_files(bundle, self.directory)
            failpoint("certs.after_reload")  # every replica: files written, not reloaded
            self._last = bundle
        self.ready.set()
        log.info("webhook: certificate files updated from Secret %s/%s", self.namespace, self.name)

    def _on_event(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        if event_type != "DELETED":
            self._write(obj.get("data"))

    def start(self) -> None:
        self.api.spawn(self._run)

    async def _run(self, kube: Kube) -> None:
        informer = Informer(
            kube,
            SECRET,
            self._on_event,
            namespace=self.namespace,
            field_selector=f"metadata.name={self.name}",
            failpoint_name="webhook.secret.before_list",
        )
        await informer.run()

    def stop(self) -> None:
        """The API loop's `stop` ends the watch."""
