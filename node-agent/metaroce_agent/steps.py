"""The unit of change: a `Step` sets one knob, reads it back, and knows how to undo it.

A step is plain data (its parameters) plus four methods that act through a `Host`:

- `snapshot(host)`: the state before the agent touched the knob (JSON), kept in the
  journal so that undo restores what was there, even after an agent restart;
- `apply(host)`: set the knob (idempotent: applying twice is applying once);
- `verify(host)`: read the knob back; None when it holds, else what differs;
- `undo(host, snapshot)`: put back what `snapshot` recorded, touching only what the agent
  created.

Steps are rebuilt from their records (`kind` + parameters) so that a later agent process
can verify or undo what an earlier one applied. Building a step has no side effects:
planning stays pure.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from metaroce_agent.host import Host

Json = Any
"""A JSON-serialisable value (snapshot content)."""

STEP_KINDS: dict[str, type[Step]] = {}


class StepError(RuntimeError):
    """A step could not be applied, verified or undone; the message says why."""


@dataclass(frozen=True)
class Step:
    """Base of every step; subclasses are frozen dataclasses of their parameters."""

    kind: ClassVar[str] = ""
    knob: ClassVar[str] = ""
    """Knob name as reported (AppliedKnob.name): pfc, dscp-map, ets, ecn, roce-tos, ..."""
    method: ClassVar[str] = ""
    """How it is set: dcb, sysfs, configfs, tc, netlink, rdma, modprobe."""
    report: ClassVar[bool] = True
    """Whether the step shows up as an applied knob (helpers such as mkdir do not)."""
    snapshot_is_state: ClassVar[bool] = False
    """Whether `snapshot` captures everything `apply` may change, so a knob whose snapshot
    reads back equal has nothing to undo. False where it does not (a step without a
    snapshot, or one whose snapshot names a directory but not what it holds)."""

    device: str
    """Netdev or RDMA device the knob belongs to; empty = node-wide."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            if cls.kind in STEP_KINDS and STEP_KINDS[cls.kind] is not cls:
                raise TypeError(f"two step classes use kind {cls.kind!r}")
            STEP_KINDS[cls.kind] = cls

    # --- identity and presentation ----------------------------------------------------
    @property
    def id(self) -> str:
        """Stable identity: the same knob on the same device has the same id, whatever the
        desired value, so a changed value keeps the original snapshot."""
        return f"{self.kind}:{self.device}{self.id_suffix()}"

    def id_suffix(self) -> str:
        return ""

    @property
    def name(self) -> str:
        where = f" on {self.device}" if self.device else ""
        return f"{self.knob}{self.id_suffix().replace(':', ' ')}{where}"

    def value(self) -> str:
        """The desired value as shown in the NodeState."""
        return ""

    # --- behaviour -------------------------------------------------------------------
    def snapshot(self, host: Host) -> Json:
        return None

    def apply(self, host: Host) -> None:
        raise NotImplementedError

    def verify(self, host: Host) -> str | None:
        raise NotImplementedError

    def check_drift(self, host: Host) -> str | None:
        """What the periodic drift pass reads back: by default `verify`. A step whose
        verify is a costly test reads back what would change that test's verdict."""
        return self.verify(host)

    def undo(self, host: Host, snapshot: Json) -> None:
        return None

    def at_snapshot(self, host: Host, snapshot: Json) -> bool:
        """Whether the knob reads back as it did when `snapshot` was taken: nothing to
        undo (an apply that failed before changing it, or a kill before it was applied).
        False when the step cannot tell (`snapshot_is_state`): then undo runs."""
        return self.snapshot_is_state and self.snapshot(host) == snapshot

    def split(self, snapshot: Json) -> list[tuple[Step, Json]]:
        """The steps (with their snapshots) a journal entry of an earlier agent stands
        for, where a step kind has since been made finer; by default itself."""
        return [(self, snapshot)]

    # --- records ---------------------------------------------------------------------
    def params(self) -> dict[str, Json]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # type: ignore[no-any-return]

    def record(self) -> dict[str, Json]:
        return {"kind": self.kind, "params": self.params()}


def step_from_record(record: dict[str, Json]) -> Step:
    """Rebuild a step from `Step.record()` (lists come back as tuples)."""
    kind = record.get("kind")
    cls = STEP_KINDS.get(str(kind))
    if cls is None:
        raise StepError(f"unknown step kind {kind!r} in the journal")
    params = {k: _tuplify(v) for k, v in dict(record.get("params") or {}).items()}
    return cls(**params)


def _tuplify(value: Json) -> Json:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value
