"""A plain list + watch ("informer") of one kind, on the controller's event loop.

Used for MetaRoceNodeStates: the one kind with an event per node (and several per node
during a rollout). kopf's per-object machinery (a worker task, memories, body views, a
copy across its thread) is costly at that volume: in the 1,000-node benchmark the
operator used 4.8-6.8 CPU-seconds per rollout with kopf watching NodeStates and 3.2-3.6
with this informer. NodeStates are only read, so a list + watch that hands each event to
the controller is all that is needed, and like kopf's `on.event` it writes nothing. The
operator's children (also only read: drift, the DaemonSet's rollout) come through it too,
so kopf is left with the networks alone.

Semantics: the initial list is delivered with event type None (as kopf does); a watch
that ends is resumed from the last resourceVersion; on 410 Gone (or any error) the kind
is listed again, and objects that vanished meanwhile are delivered as DELETED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from metaroce_api.failpoints import failpoint
from metaroce_operator import metrics
from metaroce_operator.kube import Kind, Kube

log = logging.getLogger("metaroce.operator.informer")

Handler = Callable[[str | None, dict[str, Any]], None]


class Informer:
    def __init__(
        self,
        kube: Kube,
        kind: Kind,
        handler: Handler,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        watch_timeout: int = 300,
        failpoint_name: str = "informer.before_list",
    ) -> None:
        self.kube = kube
        self.kind = kind
        self.handler = handler
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.watch_timeout = watch_timeout
        self.failpoint_name = failpoint_name
        """Hit before each list (the fault tier): one name per informer, so a test that
        fails the NodeStates' lists does not spend its hits on the children's."""
        self.known: dict[str, dict[str, Any]] = {}
        """uid -> last body seen (to tell what vanished between two lists)."""
        self.synced = asyncio.Event()

    async def run(self) -> None:
        backoff = 0.5
        while True:
            try:
                version = await self._list()
                self.synced.set()
                backoff = 0.5
                while version:
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                metrics.ERRORS.labels(where="watch").inc()
                log.warning(
                    "watching %s: %s; listing again in %.1fs", self.kind.plural, err, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _list(self) -> str:
        failpoint(self.failpoint_name)  # a list that fails or comes late (the fault tier)
        items, version = await self.kube.list_with_version(
            self.kind,
            self.namespace,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
        )
        current = {str(item["metadata"]["uid"]): item for item in items}
        for uid, body in list(self.known.items()):
            if uid not in current:
                self.handler("DELETED", body)
        self.known = current
        for item in items:
            self.handler(None, item)
        return version

    async def _watch(self, version: str) -> str:
        """Watch from `version`; returns the version to resume from, or '' to re-list."""
        async for event_type, body in self.kube.watch(
            self.kind,
            self.namespace,
            resource_version=version,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            timeout=self.watch_timeout,
            bookmarks=True,
        ):
            if event_type == "ERROR":
                code = body.get("code")
                log.info("watch of %s expired (%s): listing again", self.kind.plural, code)
                return ""
            meta = body.get("metadata") or {}
            version = str(meta.get("resourceVersion") or version)
            if event_type == "BOOKMARK":
                continue
            uid = str(meta.get("uid"))
            if event_type == "DELETED":
                self.known.pop(uid, None)
            else:
                self.known[uid] = body
            self.handler(event_type, body)
        return version
