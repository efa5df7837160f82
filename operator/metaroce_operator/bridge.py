"""The bridge from kopf's thread and loop to the controller on the main loop.

Its own module so that the imports run one way: `kopfrun` -> `handlers` -> `bridge` ->
`controller` (the handlers used to import `kopfrun`, which imported them back).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from metaroce_operator.controller import Controller, MultusMissing, PermanentFailure
from metaroce_operator.kube import Credentials, NotLeader

MULTUS_RETRY_SECONDS = 15.0
"""How often a network waiting for Multus's CRD checks again."""


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a kopf body as plain dicts (it crosses to another thread)."""
    return copy.deepcopy({k: body[k] for k in body})


class Bridge:
    """Lets handlers on kopf's loop reach the controller on the main loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        controller: Controller,
        creds: Credentials,
        gate: Callable[[], bool],
    ) -> None:
        self.loop = loop
        self.controller = controller
        self.creds = creds
        self.gate = gate

    def connection_info(self) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(
            server=self.creds.server,
            ca_path=self.creds.ca_path,
            insecure=self.creds.insecure,
            certificate_path=self.creds.cert_path,
            private_key_path=self.creds.key_path,
            scheme="Bearer" if self.creds.token() else None,
            token=self.creds.token(),
        )

    def event(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Hand a watch event over (non-blocking, keeps the order of the watch)."""
        self.loop.call_soon_threadsafe(self.controller.on_event, kind, event_type, plain(body))

    async def reconcile(self, body: Mapping[str, Any]) -> None:
        """Run the controller's reconcile; a non-leader never acts and never lets kopf
        record a failure (it waits to be cancelled by the stop)."""
        if not self.gate():
            await asyncio.Event().wait()
        future = asyncio.run_coroutine_threadsafe(self.controller.reconcile(plain(body)), self.loop)
        try:
            await asyncio.wrap_future(future)
        except NotLeader:
            await asyncio.Event().wait()
        except PermanentFailure as err:
            raise kopf.PermanentError(str(err)) from None
        except MultusMissing as err:
            # no traceback every few seconds: the status says it, kopf checks again later
            raise kopf.TemporaryError(str(err), delay=MULTUS_RETRY_SECONDS) from None
