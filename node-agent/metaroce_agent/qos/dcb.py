"""iproute2 `dcb`: the APP table (trust DSCP: DSCP -> priority), PFC and ETS.

Read back with `dcb -j -N ... show` (JSON, numeric DSCP): `{"dscp_prio": [[26, 3], ...]}`,
`{"prio_pfc": [false, false, false, true, ...]}`, `{"tc_bw": [...], "tc_tsa": [...],
"prio_tc": [...]}`. On mlx5, the first DSCP APP entry also switches the port's trust
state to DSCP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from metaroce_agent.host import Host
from metaroce_agent.steps import Json, Step, StepError

PRIOS = range(8)


def _show(host: Host, obj: str, dev: str, *what: str) -> dict[str, Any]:
    res = host.run(["dcb", "-j", "-N", obj, "show", "dev", dev, *what])
    try:
        data = json.loads(res.stdout or "{}")
    except ValueError as e:
        raise StepError(f"`{res.command}` printed no JSON: {res.stdout[:200]!r}") from e
    return data if isinstance(data, dict) else {}


def read_dscp_prio(host: Host, dev: str) -> list[tuple[int, int]]:
    data = _show(host, "app", dev, "dscp-prio")
    out = []
    for item in data.get("dscp_prio") or []:
        if isinstance(item, list) and len(item) == 2:
            out.append((int(item[0]), int(item[1])))
    return sorted(out)


def read_pfc(host: Host, dev: str) -> list[bool]:
    data = _show(host, "pfc", dev, "prio-pfc")
    raw = data.get("prio_pfc") or []
    if isinstance(raw, dict):  # tolerate a {"0": false, ...} form
        raw = [raw.get(str(p), False) for p in PRIOS]
    return [bool(x) for x in raw][:8]


def read_ets(host: Host, dev: str) -> dict[str, list[Any]]:
    data = _show(host, "ets", dev)
    return {k: list(data.get(k) or []) for k in ("tc_bw", "tc_tsa", "prio_tc")}


def _pairs(value: Json) -> list[tuple[int, int]]:
    """The (dscp, priority) pairs of a DcbAppStep snapshot (`[[d, p], ...]`), sorted."""
    pairs = value if isinstance(value, list) else []
    return sorted(
        (p[0], p[1])
        for p in pairs
        if isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
    )


@dataclass(frozen=True)
class DcbAppStep(Step):
    """Trust DSCP and map a DSCP to its priority: `dcb app replace ... dscp-prio D:P`.

    The plan makes one step per DSCP, and the DSCP is part of the step's id: a DSCP the
    config no longer names is a step no longer planned, which the engine undoes (its
    entry deleted, the pre-agent entry of that DSCP put back), while a new priority for
    the same DSCP keeps the original snapshot. Journals of earlier agents hold one step
    for all entries; `split` reads them per entry."""

    kind = "dcb-app"
    snapshot_is_state = True
    knob = "dscp-map"
    method = "dcb"

    entries: tuple[tuple[int, int], ...] = ()
    """(dscp, priority) pairs: one in the steps the plan makes."""

    def id_suffix(self) -> str:
        return ":dscp" + ",".join(str(d) for d, _ in self.entries)

    def split(self, snapshot: Json) -> list[tuple[Step, Json]]:
        if len(self.entries) <= 1:
            return [(self, snapshot)]
        old = [(int(d), int(p)) for d, p in (snapshot or [])]
        return [
            (DcbAppStep(self.device, entries=((d, p),)), [[e, q] for e, q in old if e == d])
            for d, p in self.entries
        ]

    def value(self) -> str:
        return " ".join(f"{d}:{p}" for d, p in self.entries)

    def _args(self, entries: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> list[str]:
        return [f"{d}:{p}" for d, p in entries]

    def snapshot(self, host: Host) -> Json:
        dscps = {d for d, _ in self.entries}
        return [[d, p] for d, p in read_dscp_prio(host, self.device) if d in dscps]

    def apply(self, host: Host) -> None:
        host.run(
            ["dcb", "app", "replace", "dev", self.device, "dscp-prio", *self._args(self.entries)]
        )

    def verify(self, host: Host) -> str | None:
        have = read_dscp_prio(host, self.device)
        problems = []
        for d, p in self.entries:
            prios = sorted(q for e, q in have if e == d)
            if prios != [p]:
                problems.append(f"dscp {d} -> {prios or 'nothing'} (want {p})")
        return f"dcb app on {self.device}: {', '.join(problems)}" if problems else None

    def at_snapshot(self, host: Host, snapshot: Json) -> bool:
        # the order dcb lists entries in is not the snapshot's
        return _pairs(self.snapshot(host)) == _pairs(snapshot)

    def undo(self, host: Host, snapshot: Json) -> None:
        dscps = {d for d, _ in self.entries}
        current = [(d, p) for d, p in read_dscp_prio(host, self.device) if d in dscps]
        if current:
            host.run(["dcb", "app", "del", "dev", self.device, "dscp-prio", *self._args(current)])
        old = [(int(d), int(p)) for d, p in (snapshot or [])]
        if old:
            host.run(["dcb", "app", "add", "dev", self.device, "dscp-prio", *self._args(old)])


@dataclass(frozen=True)
class DcbPfcStep(Step):
    """PFC on exactly `enabled` priorities (none = PFC off, the lossy profile)."""

    kind = "dcb-pfc"
    snapshot_is_state = True
    knob = "pfc"
    method = "dcb"

    enabled: tuple[int, ...] = ()

    def value(self) -> str:
        return ",".join(map(str, self.enabled)) if self.enabled else "off"

    def _want(self) -> list[bool]:
        return [p in self.enabled for p in PRIOS]

    @staticmethod
    def _args(flags: list[bool]) -> list[str]:
        return [f"{p}:{'on' if flags[p] else 'off'}" for p in PRIOS]

    def snapshot(self, host: Host) -> Json:
        return read_pfc(host, self.device)

    def apply(self, host: Host) -> None:
        host.run(["dcb", "pfc", "set", "dev", self.device, "prio-pfc", *self._args(self._want())])

    def verify(self, host: Host) -> str | None:
        have = read_pfc(host, self.device)
        if have == self._want():
            return None
        on = [str(p) for p, f in enumerate(have) if f]
        return f"pfc on {self.device} is on priorities [{','.join(on)}], want [{self.value()}]"

    def undo(self, host: Host, snapshot: Json) -> None:
        if isinstance(snapshot, list) and len(snapshot) == 8:
            flags = [bool(x) for x in snapshot]
            host.run(["dcb", "pfc", "set", "dev", self.device, "prio-pfc", *self._args(flags)])


@dataclass(frozen=True)
class DcbEtsStep(Step):
    """ETS: each priority in its own traffic class, listed ones with their share."""

    kind = "dcb-ets"
    snapshot_is_state = True
    knob = "ets"
    method = "dcb"

    shares: tuple[tuple[int, int], ...] = ()
    """(priority, percent) pairs summing to 100."""

    def value(self) -> str:
        return " ".join(f"{p}:{b}%" for p, b in self.shares)

    def _want(self) -> dict[str, list[Any]]:
        bw = dict(self.shares)
        return {
            "tc_bw": [bw.get(p, 0) for p in PRIOS],
            "tc_tsa": ["ets"] * 8,
            "prio_tc": list(PRIOS),
        }

    @staticmethod
    def _args(state: dict[str, list[Any]]) -> list[str]:
        args: list[str] = []
        if state.get("prio_tc"):
            args += ["prio-tc", *(f"{p}:{t}" for p, t in enumerate(state["prio_tc"]))]
        if state.get("tc_tsa"):
            args += ["tc-tsa", *(f"{t}:{s}" for t, s in enumerate(state["tc_tsa"]))]
        if state.get("tc_bw"):
            args += ["tc-bw", *(f"{t}:{b}" for t, b in enumerate(state["tc_bw"]))]
        return args

    def snapshot(self, host: Host) -> Json:
        return read_ets(host, self.device)

    def apply(self, host: Host) -> None:
        host.run(["dcb", "ets", "set", "dev", self.device, *self._args(self._want())])

    def verify(self, host: Host) -> str | None:
        have = read_ets(host, self.device)
        want = self._want()
        diff = [k for k in want if [str(x) for x in have.get(k, [])] != [str(x) for x in want[k]]]
        if not diff:
            return None
        return f"ets on {self.device} differs in {', '.join(diff)}: {have}"

    def undo(self, host: Host, snapshot: Json) -> None:
        if isinstance(snapshot, dict) and any(snapshot.values()):
            host.run(["dcb", "ets", "set", "dev", self.device, *self._args(snapshot)])
