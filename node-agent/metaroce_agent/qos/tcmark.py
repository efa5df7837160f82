"""DSCP marking and priority mapping with `tc`, for netdevs without DCB (SoftRoCE).

One `clsact` egress filter on the netdev matches RoCEv2 (UDP port 4791) and rewrites the
DSCP bits (ECN bits kept), fixes the IPv4 header checksum and sets the skb priority:

    tc filter replace dev eth0 egress protocol ip pref 4791 handle 0x4d52 flower \\
        ip_proto udp dst_port 4791 \\
        action pedit ex munge ip dsfield set 0x68 retain 0xfc pipe \\
        action csum ip pipe action skbedit priority 3

so every RoCEv2 packet rxe sends leaves with DSCP 26 (ToS 0x68 on the wire), whatever the
application asked for: the node-level DSCP policy a DCB NIC enforces in hardware.
Read back from `tc -j filter show dev eth0 egress` (pedit key `val` `680000`, mask
`ff03ffff`; skbedit `priority` `:3`). The agent owns only its filter (pref 4791, handle
0x4d52) and a clsact qdisc it created itself and that holds no other filter.

The MetaRoCE transport's UDP port range is marked the same way, as destination and as
source port, for IPv4 (prefs 4792, 4793) and IPv6 endpoints (prefs 4794, 4795: a pref
holds one protocol); IPv6 rewrites the traffic class (`munge ip6 traffic_class`, pedit
key `val` `6800000`, mask `f03fffff`) and needs no checksum fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from metaroce_agent.host import Host
from metaroce_agent.steps import Json, Step, StepError

ROCE_V2_PORT = 4791
FILTER_PREF = 4791
FILTER_HANDLE = 0x4D52  # "MR"


def _json(host: Host, argv: list[str]) -> list[dict[str, Any]]:
    res = host.run(argv)
    try:
        data = json.loads(res.stdout or "[]")
    except ValueError as e:
        raise StepError(f"`{res.command}` printed no JSON: {res.stdout[:200]!r}") from e
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def has_clsact(host: Host, dev: str) -> bool:
    return any(
        q.get("kind") == "clsact" for q in _json(host, ["tc", "-j", "qdisc", "show", "dev", dev])
    )


def filters(host: Host, dev: str, direction: str) -> list[dict[str, Any]]:
    """Filters of a clsact hook, with options (the bare per-pref headers dropped)."""
    entries = _json(host, ["tc", "-j", "filter", "show", "dev", dev, direction])
    return [e for e in entries if "options" in e]


@dataclass(frozen=True)
class ClsactStep(Step):
    kind = "tc-clsact"
    snapshot_is_state = True
    knob = "tc-clsact"
    method = "tc"
    report = False

    def value(self) -> str:
        return "clsact"

    def snapshot(self, host: Host) -> Json:
        return {"existed": has_clsact(host, self.device)}

    def apply(self, host: Host) -> None:
        if not has_clsact(host, self.device):
            host.run(["tc", "qdisc", "add", "dev", self.device, "clsact"])

    def verify(self, host: Host) -> str | None:
        return None if has_clsact(host, self.device) else f"no clsact qdisc on {self.device}"

    def undo(self, host: Host, snapshot: Json) -> None:
        if not (isinstance(snapshot, dict) and snapshot.get("existed") is False):
            return  # it was there before us: shared, never ours to remove
        if not has_clsact(host, self.device):
            return
        if filters(host, self.device, "egress") or filters(host, self.device, "ingress"):
            return  # someone else put filters on it since: leave it
        host.run(["tc", "qdisc", "del", "dev", self.device, "clsact"])


@dataclass(frozen=True)
class EgressMarkStep(Step):
    """One agent-owned `clsact` egress flower filter that marks UDP packets with `dscp`
    and skb priority `priority`: the filter at egress pref `pref` with the agent's
    handle, matching `port_key` (`dst_port` or `src_port`) on `port_text()`. Subclasses
    say which packets (RoCEv2's port 4791, the MetaRoCE range) and keep their own step
    kind, fields and id, so journals of earlier agents still rebuild them."""

    dscp: int = 26
    priority: int = 3
    family: str = "ipv4"

    what: ClassVar[str] = "marking filter"
    """How the filter is named in what verify reports."""

    @property
    def pref(self) -> int:
        raise NotImplementedError

    @property
    def port_key(self) -> str:
        return "dst_port"

    def port_text(self) -> str:
        """The port (or `first-last` range) the filter matches, as tc takes it."""
        raise NotImplementedError

    def port_problem(self, keys: dict[str, Any]) -> str | None:
        """What differs in the filter's port match (tc's JSON `keys`), or None."""
        raise NotImplementedError

    @property
    def tos(self) -> int:
        return self.dscp << 2

    def _proto(self) -> str:
        return "ip" if self.family == "ipv4" else "ipv6"

    def command(self) -> list[str]:
        munge = (
            ["munge", "ip", "dsfield"]
            if self.family == "ipv4"
            else ["munge", "ip6", "traffic_class"]
        )
        csum = ["action", "csum", "ip", "pipe"] if self.family == "ipv4" else []
        return [
            "tc", "filter", "replace", "dev", self.device, "egress",
            "protocol", self._proto(), "pref", str(self.pref), "handle", hex(FILTER_HANDLE),
            "flower", "ip_proto", "udp", self.port_key, self.port_text(),
            "action", "pedit", "ex", *munge, "set", f"0x{self.tos:02x}", "retain", "0xfc", "pipe",
            *csum,
            "action", "skbedit", "priority", str(self.priority),
        ]  # fmt: skip

    def _ours(self, host: Host) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The agent's filter at `pref` (by its handle), and any others there."""
        mine, others = None, []
        for f in filters(host, self.device, "egress"):
            if f.get("pref") != self.pref:
                continue
            if (f.get("options") or {}).get("handle") == FILTER_HANDLE:
                mine = f
            else:
                others.append(f)
        return mine, others

    def apply(self, host: Host) -> None:
        # `replace` with the agent's pref and handle is idempotent; a foreign filter at the
        # same pref is caught by the read-back (and the rollback deletes only ours).
        mine, _ = self._ours(host)
        held = mine.get("protocol") if mine else None
        if held is not None and held != self._proto():
            # the address family changed: a pref holds filters of one protocol, and the
            # kernel refuses a replace of another, so ours of the old family goes first
            self._delete(host, str(held))
        host.run(self.command())

    def _delete(self, host: Host, protocol: str) -> None:
        host.run(
            [
                "tc", "filter", "del", "dev", self.device, "egress", "protocol", protocol,
                "pref", str(self.pref), "handle", hex(FILTER_HANDLE), "flower",
            ]
        )  # fmt: skip

    def verify(self, host: Host) -> str | None:
        mine, others = self._ours(host)
        if others:
            handles = [o.get("options", {}).get("handle") for o in others]
            return (
                f"egress pref {self.pref} on {self.device} also holds filters that are not "
                f"the agent's (handles {handles}): move them to another pref"
            )
        if mine is None:
            return (
                f"no {self.what} (egress pref {self.pref}, udp {self.port_key.replace('_', ' ')}"
                f" {self.port_text()}) on {self.device}"
            )
        problems = []
        protocol = mine.get("protocol")
        if protocol is not None and protocol != self._proto():
            problems.append(f"matches protocol {protocol}, want {self._proto()}")
        port = self.port_problem((mine.get("options") or {}).get("keys") or {})
        if port:
            problems.append(port)
        have_tos, have_prio, _ = marking_of(mine)
        if have_tos is None or (have_tos & 0xFC) != (self.tos & 0xFC):
            shown = "nothing" if have_tos is None else f"0x{have_tos:02x}"
            problems.append(f"sets tos {shown}, want 0x{self.tos:02x}")
        if have_prio != self.priority:
            problems.append(f"sets priority {have_prio}, want {self.priority}")
        return (f"{self.what} " + "; ".join(problems)) if problems else None

    def at_snapshot(self, host: Host, snapshot: Json) -> bool:
        # before the agent there is no filter with its handle at its pref
        return self._ours(host)[0] is None

    def undo(self, host: Host, snapshot: Json) -> None:
        mine, _ = self._ours(host)
        if mine is None:
            return
        self._delete(host, str(mine.get("protocol") or self._proto()))


@dataclass(frozen=True)
class TcMarkStep(EgressMarkStep):
    """Mark RoCEv2 egress packets (UDP destination port 4791) with `dscp` and skb
    priority `priority`."""

    kind = "tc-mark"
    knob = "dscp-mark"
    method = "tc"
    what = "RoCEv2 marking filter"

    @property
    def pref(self) -> int:
        return FILTER_PREF

    def value(self) -> str:
        return f"dscp {self.dscp} (tos 0x{self.tos:02x}) priority {self.priority}"

    def port_text(self) -> str:
        return str(ROCE_V2_PORT)

    def port_problem(self, keys: dict[str, Any]) -> str | None:
        port = keys.get("dst_port")
        have = int(port) if isinstance(port, int | str) and str(port).isdigit() else None
        return None if have == ROCE_V2_PORT else f"matches dst_port {have}, want {ROCE_V2_PORT}"


def marking_of(entry: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(tos, skb priority, dst_port) a flower filter entry sets, from tc's JSON."""
    opts = entry.get("options") or {}
    keys = opts.get("keys") or {}
    port = keys.get("dst_port")
    tos = prio = None
    for action in opts.get("actions") or []:
        if action.get("kind") == "pedit":
            for key in action.get("keys") or []:
                try:
                    val = int(str(key.get("val")), 16)
                    mask = int(str(key.get("mask")), 16)
                except ValueError:
                    continue
                if key.get("htype") == "ipv4" and int(key.get("offset", -1)) == 0:
                    if mask & 0x00FF0000 != 0x00FF0000:  # the ToS byte is being set
                        tos = (val >> 16) & 0xFF
                elif key.get("htype") == "ipv6" and int(key.get("offset", -1)) == 0:
                    tos = (val >> 20) & 0xFF
        elif action.get("kind") == "skbedit" and "priority" in action:
            minor = str(action["priority"]).rsplit(":", 1)[-1] or "0"
            try:
                prio = int(minor, 16)
            except ValueError:
                prio = None
    return tos, prio, int(port) if isinstance(port, int | str) and str(port).isdigit() else None


# --- MetaRoCE: the network's UDP port range -------------------------------------------------

PORT_RANGE_PREFS = {"dst": 4792, "src": 4793}
"""Egress prefs of the agent's MetaRoCE filters: one matches the range as destination
port (what a node sends to its peers' endpoints), one as source port (what its own
endpoints send, whatever port the peer uses)."""
PORT_RANGE_PREFS_IPV6 = {"dst": 4794, "src": 4795}
"""The same for IPv6 endpoints: a pref holds filters of one protocol only (the kernel
refuses another at the same pref), so IPv6 has prefs of its own."""
MARK_FAMILIES = ("ipv4", "ipv6")
"""The address families the MetaRoCE range is marked for: endpoints bind IPv4 or IPv6
addresses, whichever the netdev and the peer have, so both are marked."""


def port_range_of(value: object) -> tuple[int, int] | None:
    """A flower port key as (first, last): `{"start": a, "end": b}` (iproute2's JSON for a
    range), `"a-b"`, or a single port."""
    if isinstance(value, dict):
        try:
            return int(value["start"]), int(value["end"])
        except (KeyError, TypeError, ValueError):
            return None
    text = str(value)
    first, _, last = text.partition("-")
    if not first.isdigit() or (last and not last.isdigit()):
        return None
    return int(first), int(last or first)


@dataclass(frozen=True)
class TcPortRangeMarkStep(EgressMarkStep):
    """Mark the MetaRoCE transport's UDP packets (ports `first`-`last` as destination or
    as source, `match`) with `dscp` and skb priority `priority` on egress: the node-level
    DSCP policy for a NIC without DCB, as `TcMarkStep` is for RoCEv2's port 4791."""

    kind = "tc-mark-ports"
    knob = "dscp-mark"
    method = "tc"
    what = "MetaRoCE marking filter"

    match: str = "dst"
    first: int = 20000
    last: int = 23999

    def id_suffix(self) -> str:
        # IPv4 keeps the id it always had, so journals of earlier agents still match
        return f":{self.match}" if self.family == "ipv4" else f":{self.match}:{self.family}"

    @property
    def pref(self) -> int:
        prefs = PORT_RANGE_PREFS if self.family == "ipv4" else PORT_RANGE_PREFS_IPV6
        return prefs[self.match]

    @property
    def port_key(self) -> str:
        return f"{self.match}_port"

    def value(self) -> str:
        return (
            f"{self.family} udp {self.match} port {self.first}-{self.last}: dscp {self.dscp} "
            f"(tos 0x{self.tos:02x}) priority {self.priority}"
        )

    def port_text(self) -> str:
        return f"{self.first}-{self.last}"

    def port_problem(self, keys: dict[str, Any]) -> str | None:
        have = port_range_of(keys.get(self.port_key))
        if have == (self.first, self.last):
            return None
        shown = "nothing" if have is None else f"{have[0]}-{have[1]}"
        return f"matches {self.match} port {shown}, want {self.first}-{self.last}"
