"""kopf, embedded: its own thread and event loop, bridged to the controller.

Why a thread: `kopf.operator()` cancels every task created after it started when it stops,
and installs its own SIGINT/SIGTERM handlers. Run on the main loop, that would cancel the
lease renewal and the health server whenever leadership ends. On its own thread (kopf
skips signal handlers there) it can be started for a leadership term and stopped with a
flag, while the controller, the lease and the HTTP endpoints live on the main loop.

Handlers (see `handlers`) only hand watch events and reconcile calls over the `Bridge`
(see `bridge`): this module imports the handlers, the handlers import only the bridge.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import kopf

from metaroce_api.constants import GROUP
from metaroce_operator import handlers
from metaroce_operator.bridge import Bridge
from metaroce_operator.claim import kopf_prefix
from metaroce_operator.settings import DEFAULT_NAMESPACE

log = logging.getLogger("metaroce.operator.kopf")
KOPF_ANNOTATION_PREFIX = f"operator.{GROUP}"
"""Prefix of the annotations kopf keeps on networks (last-handled configuration, progress)
for the operator of the default namespace (others: `claim.kopf_prefix`)."""


def kopf_settings(namespace: str = DEFAULT_NAMESPACE) -> kopf.OperatorSettings:
    """kopf's settings for an operator whose agents (and Lease) are in `namespace`."""
    settings = kopf.OperatorSettings()
    prefix = kopf_prefix(namespace, DEFAULT_NAMESPACE)
    # No Event per successful handler: only warnings and errors are posted.
    settings.posting.level = logging.WARNING
    # Our Lease elects the leader; kopf's peering would pause replicas of equal priority.
    settings.peering.standalone = True
    # Watch the namespaces and CRDs we are told, without listing/watching all of them.
    settings.scanning.disabled = True
    # Our own annotation prefix instead of kopf.zalando.org, per operator namespace (a
    # second release's bookkeeping must not make this one's kopf skip a change, see
    # claim.py); no status.kopf (pruned anyway).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix, v1=False)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration", v1=False
    )
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings


class KopfThread:
    """One kopf run (one leadership term) on its own thread."""

    def __init__(self, bridge: Bridge, namespace: str) -> None:
        self.bridge = bridge
        self.namespace = namespace
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self.finished = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.thread = threading.Thread(target=self._main, name="kopf", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _main(self) -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=handlers.registry,
                    settings=kopf_settings(self.namespace),
                    standalone=True,
                    namespaces=[self.namespace],
                    memo=kopf.Memo(bridge=self.bridge),
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                )
            )
        except BaseException as err:  # reported to the main loop, which ends the term
            self.error = err
        finally:
            self._loop.call_soon_threadsafe(self.finished.set)

    async def wait(self) -> None:
        await self.finished.wait()
        if self.error is not None:
            raise RuntimeError(f"kopf stopped: {self.error!r}") from self.error

    async def stop(self, timeout: float = 10.0) -> None:
        self.stop_flag.set()
        try:
            await asyncio.wait_for(self.finished.wait(), timeout)
        except TimeoutError:
            log.warning("kopf did not stop within %.0fs; abandoning its thread", timeout)
