"""The kopf registrations, and nothing else: each hands its work to the controller.

Networks: create / update (of the spec) / resume run the reconcile; every watch event
refreshes the controller's view (status, deletion). The children are only read, so they
use `on.event`, which writes nothing to them: the DaemonSet's rollout feeds the status,
and a child deleted or changed behind the operator's back is re-applied. NodeStates (one
event per node) come through the controller's own `informer`, which costs far less CPU.
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


OURS = {c.MANAGED_BY_LABEL: c.MANAGED_BY}


@kopf.on.event("apps", "v1", "daemonsets", labels=OURS, registry=registry)
async def daemonset_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _bridge(memo).event("DaemonSet", type, body)


@kopf.on.event("", "v1", "configmaps", labels=OURS, registry=registry)
@kopf.on.event("", "v1", "serviceaccounts", labels=OURS, registry=registry)
@kopf.on.event("rbac.authorization.k8s.io", "v1", "clusterroles", labels=OURS, registry=registry)
@kopf.on.event(
    "rbac.authorization.k8s.io", "v1", "clusterrolebindings", labels=OURS, registry=registry
)
async def child_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _bridge(memo).event(str(body.get("kind", "")), type, body)
