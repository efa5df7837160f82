"""Which body of a network is the newest, without comparing resourceVersions.

resourceVersions are opaque strings (the API conventions forbid ordering them; an
aggregated or differently stored apiserver need not issue increasing integers), so the
leader orders what it knows by the two things it may order:

- `metadata.generation`, an integer the apiserver increases on every spec change: a
  body with a lower generation than the one kept is stale and is dropped;
- its own status writes: the response of a write is newer than every watch event that
  arrives before the write's echo, so the status it carries is kept as "what the leader
  last wrote" until a watch event shows that status (the echo itself, or a later event
  kopf coalesced it into). A status that someone else wrote after ours never matches;
  it is trusted after `ECHO_WAIT` seconds, so a stale view cannot last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ECHO_WAIT = 30.0
"""Seconds a written status is preferred to watch events that do not show it."""


def generation(body: dict[str, Any]) -> int:
    value = (body.get("metadata") or {}).get("generation")
    return value if isinstance(value, int) else 0


@dataclass(frozen=True)
class Written:
    status: dict[str, Any]
    resource_version: str
    at: float


class NetworkBodies:
    """network name -> the newest body known, and the status this leader last wrote."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.bodies: dict[str, dict[str, Any]] = {}
        self.written: dict[str, Written] = {}
        self._clock = clock

    def from_watch(self, body: dict[str, Any]) -> bool:
        """Take a body from the watch (or from a kopf handler); False when it is stale."""
        name = body["metadata"]["name"]
        old = self.bodies.get(name)
        if old is not None and generation(body) < generation(old):
            return False
        self.bodies[name] = body
        written = self.written.get(name)
        if written is not None and (
            (body.get("metadata") or {}).get("resourceVersion") == written.resource_version
            or body.get("status") == written.status
            or self._clock() - written.at > ECHO_WAIT
        ):
            del self.written[name]
        return True

    def from_write(self, body: dict[str, Any]) -> None:
        """Take the response of the leader's own status write."""
        name = body["metadata"]["name"]
        self.bodies[name] = body
        self.written[name] = Written(
            status=dict(body.get("status") or {}),
            resource_version=str((body.get("metadata") or {}).get("resourceVersion") or ""),
            at=self._clock(),
        )

    def status(self, name: str) -> dict[str, Any] | None:
        """The status to judge changes against: ours until its echo, else the watch's."""
        written = self.written.get(name)
        if written is not None:
            return written.status
        status = (self.bodies.get(name) or {}).get("status")
        return status if isinstance(status, dict) else None

    def get(self, name: str) -> dict[str, Any] | None:
        return self.bodies.get(name)

    def forget(self, name: str) -> None:
        self.bodies.pop(name, None)
        self.written.pop(name, None)
