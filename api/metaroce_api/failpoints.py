"""Failpoints for the fault tier (tests/fault): named places where a test can kill the
process or make the code fail, chosen by the environment so a seed is reproducible.

``METAROCE_FAILPOINTS="apply.after_step=3,revert.before_journal=1:error"``:

- ``name=N`` sends SIGKILL to this process the Nth time ``failpoint(name)`` is reached
  (kill -9: no handler, no cleanup, as a node losing power or an OOM kill);
- ``name=N:error`` raises ``FailpointError`` there the Nth time and every time after
  (a step that fails on its second and later passes).

Unset (production), ``failpoint()`` is one dict lookup and does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

ENV = "METAROCE_FAILPOINTS"


class FailpointError(RuntimeError):
    """Raised at an ``:error`` failpoint."""


@dataclass(frozen=True)
class Failpoint:
    name: str
    hit: int  # 1-based: act the hit-th time the point is reached
    action: str  # "kill" or "error"


def parse(spec: str) -> dict[str, Failpoint]:
    """``name=N[:kill|:error],...`` to failpoints by name; a clear error on bad input."""
    points: dict[str, Failpoint] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, rest = item.partition("=")
        count, _, action = rest.partition(":")
        action = action or "kill"
        if not sep or not name or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"{ENV}: {item!r} is not name=N[:kill|:error] with N >= 1 "
                "(e.g. apply.after_step=2 or apply.step=2:error)"
            )
        if action not in ("kill", "error"):
            raise ValueError(f"{ENV}: {item!r}: the action {action!r} is not kill or error")
        points[name] = Failpoint(name, int(count), action)
    return points


_points = parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}
_lock = threading.Lock()


def failpoint(name: str) -> None:
    """Reached ``name``: kill or fail here if the environment asks for it."""
    point = _points.get(name)
    if point is None:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        hits = _hits[name]
    if hits < point.hit:
        return
    if point.action == "error":
        raise FailpointError(f"failpoint {name} (hit {hits}, {ENV})")
    if hits == point.hit:
        os.kill(os.getpid(), signal.SIGKILL)


def reset(spec: str) -> None:
    """Re-read failpoints (for tests running the code in-process)."""
    global _points
    with _lock:
        _points = parse(spec)
        _hits.clear()
