"""Failpoints for the fault tier (tests/fault): named places where a test can kill the
process or make the code fail, chosen by the environment so a seed is reproducible.

``METAROCE_FAILPOINTS="apply.after_step=3,revert.before_journal=1:error"``, a comma-
separated list of ``name=N[:action]`` (N >= 1 counts the hits of that name in this
process, the first is 1):

- ``name=N`` (or ``name=N:kill``) sends SIGKILL to this process the Nth time
  ``failpoint(name)`` is reached (kill -9: no handler, no cleanup, as a node losing power
  or an OOM kill); one line on stderr says which point fired, first;
- ``name=N:error`` raises ``FailpointError`` there the Nth time and every time after
  (a step that fails on its second and later passes);
- ``name=N:error=K`` raises ``FailpointError`` at hits N to N+K-1 only (K >= 1), then
  passes again: a failure that heals, such as an apiserver that refuses the operator's
  first lists (``informer.before_list=1:error=4``: the first four lists fail).

Unset (production), ``failpoint()`` is one dict lookup and does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass

ENV = "METAROCE_FAILPOINTS"
SYNTAX = "name=N[:kill|:error|:error=K] with N, K >= 1"


class FailpointError(RuntimeError):
    """Raised at an ``:error`` failpoint."""


@dataclass(frozen=True)
class Failpoint:
    name: str
    hit: int  # 1-based: act the hit-th time the point is reached
    action: str  # "kill" or "error"
    times: int | None = None
    """For "error": how many hits from `hit` on raise (None: every one)."""

    def acts_at(self, hits: int) -> bool:
        """Whether the `hits`-th time the point is reached acts."""
        if hits < self.hit:
            return False
        if self.action == "kill":
            return hits == self.hit
        return self.times is None or hits < self.hit + self.times


def _positive(text: str) -> bool:
    return text.isdigit() and int(text) >= 1


def parse(spec: str) -> dict[str, Failpoint]:
    """``name=N[:kill|:error|:error=K],...`` to failpoints by name; a clear error on bad
    input."""
    points: dict[str, Failpoint] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, rest = item.partition("=")
        count, _, action = rest.partition(":")
        action, has_times, times = (action or "kill").partition("=")
        if not sep or not name or not _positive(count):
            raise ValueError(
                f"{ENV}: {item!r} is not {SYNTAX} "
                "(e.g. apply.after_step=2, apply.step=2:error or informer.before_list=1:error=3)"
            )
        if action not in ("kill", "error") or (has_times and action != "error"):
            raise ValueError(
                f"{ENV}: {item!r}: the action {rest.partition(':')[2]!r} is not kill, error "
                "or error=K"
            )
        if has_times and not _positive(times):
            raise ValueError(f"{ENV}: {item!r}: error=K needs a count K >= 1, not {times!r}")
        points[name] = Failpoint(name, int(count), action, int(times) if has_times else None)
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
    if not point.acts_at(hits):
        return
    if point.action == "error":
        raise FailpointError(f"failpoint {name} (hit {hits}, {ENV})")
    sys.stderr.write(f"failpoint {name} (hit {hits}, {ENV}): SIGKILL\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def reset(spec: str) -> None:
    """Re-read failpoints (for tests running the code in-process)."""
    global _points
    with _lock:
        _points = parse(spec)
        _hits.clear()
