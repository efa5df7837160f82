"""The kopf registrations, and nothing else: each hands its work to the controller.

Networks: create / update (of the spec) / resume run the reconcile; every watch event
refreshes the controller's view (status, deletion). The children and the NodeStates are
only read: they come through the controller's own `informer`s on its loop and client
(cheaper than kopf's per-object machinery, and no hop between threads).
"""

from __future__ import annotations

from typing import Any, cast

import kopf

from metaroce_api import constants as c
from metaroce_operator.bridge import Bridge

registry = kopf.OperatorRegistry()
RETRY_BACKOFF = 5.0


def _bridge(memo: kopf.Memo) -> Bridge:
    return cast(Bridge, memo["bridge"])


@kopf.on.login(registry=registry)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return _bridge(memo).connection_info()


@kopf.on.resume(c.GROUP, c.VERSION, c.NETWORK_PLURAL, registry=registry, backoff=RETRY_BACKOFF)
@kopf.on.create(c.GROUP, c.VERSION, c.NETWORK_PLURAL, registry=registry, backoff=RETRY_BACKOFF)
@kopf.on.update(
    c.GROUP, c.VERSION, c.NETWORK_PLURAL, field="spec", registry=registry, backoff=RETRY_BACKOFF
)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _bridge(memo).reconcile(body)


@kopf.on.event(c.GROUP, c.VERSION, c.NETWORK_PLURAL, registry=registry)
async def network_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _bridge(memo).event(c.NETWORK_KIND, type, body)
