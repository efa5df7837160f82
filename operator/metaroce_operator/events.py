"""Kubernetes Events about networks, posted by the leader on real transitions only."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from metaroce_api import constants as c
from metaroce_operator.kube import KINDS, ApiError, Kube, NotLeader
from metaroce_operator.status import EventSpec

log = logging.getLogger("metaroce.operator.events")
EVENT = KINDS[("v1", "Event")]
EVENT_NAMESPACE = "default"
"""Events about cluster-scoped objects live in `default` (where kubectl describe looks)."""


def event_body(
    network: Mapping[str, Any], spec: EventSpec, identity: str, now: datetime
) -> dict[str, Any]:
    meta = network.get("metadata") or {}
    name = str(meta.get("name", ""))
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{name}.{time.time_ns():x}",
            "namespace": EVENT_NAMESPACE,
            "labels": {c.NETWORK_LABEL: name, c.MANAGED_BY_LABEL: c.MANAGED_BY},
        },
        "involvedObject": {
            "apiVersion": c.API_VERSION,
            "kind": c.NETWORK_KIND,
            "name": name,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": spec.type,
        "reason": spec.reason,
        "message": spec.message[:1024],
        "source": {"component": c.MANAGED_BY},
        "reportingComponent": f"{c.GROUP}/operator",
        "reportingInstance": identity[:128],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post(kube: Kube, network: Mapping[str, Any], spec: EventSpec, identity: str) -> None:
    """Post one Event; failures are logged, never raised (an Event is not worth a retry)."""
    try:
        await kube.create(event_body(network, spec, identity, datetime.now(UTC)))
    except NotLeader:
        raise
    except (ApiError, OSError) as err:
        log.warning("could not post event %s: %s", spec.reason, err)
