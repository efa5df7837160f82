"""The webhook's API client: the operator's own (`metaroce_operator.kube`), on an event
loop of its own thread.

Issue 16 (one client stack): the webhook used to read the API with the official
kubernetes client (a watch thread per kind, blocking calls from the server's threads),
beside the operator's aiohttp client. Now its watches run as tasks on this loop and its
server threads call it synchronously (`call`). The loop is the webhook's, not the
controller's: admission never waits behind the leader's work, and a standalone webhook
runs the same code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from metaroce_operator.kube import Credentials, Kube

log = logging.getLogger("metaroce.webhooks.api")
T = TypeVar("T")


class ApiLoop:
    """One event loop on a daemon thread, with one `Kube` used only from that loop."""

    def __init__(self, creds: Credentials, user_agent: str = "metaroce-webhook") -> None:
        self.loop = asyncio.new_event_loop()
        self.kube = Kube(creds, user_agent=user_agent)
        self._thread = threading.Thread(target=self._main, name="webhook-api", daemon=True)
        self._tasks: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                self.loop.run_until_complete(self.kube.close())
            except Exception as err:  # closing on the way out: nothing left to tell
                log.debug("closing the webhook's API client: %r", err)
            self.loop.close()

    def _ensure_started(self) -> None:
        with self._lock:
            if not self._thread.is_alive() and not self.loop.is_closed():
                self._thread.start()

    def call(self, make: Callable[[Kube], Coroutine[Any, Any, T]], timeout: float) -> T:
        """Run `make(kube)` on the loop and wait for its result (from any other thread)."""
        self._ensure_started()
        future = asyncio.run_coroutine_threadsafe(make(self.kube), self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the API did not answer within {timeout:g} s") from None

    def spawn(self, make: Callable[[Kube], Coroutine[Any, Any, None]]) -> None:
        """Run `make(kube)` on the loop until it ends or `stop()` (a watch)."""
        self._ensure_started()
        future = asyncio.run_coroutine_threadsafe(make(self.kube), self.loop)
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)

    def stop(self, timeout: float = 5.0) -> None:
        for future in list(self._tasks):
            future.cancel()
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
