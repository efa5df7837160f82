#!/usr/bin/env python3
"""Test fabrics for the MetaRoCE transport, built from network namespaces on one host.

Two fabrics, each under a unique name so several coexist and nothing leaks:

multipath   endpoints A and B joined by 4 parallel veth data links (d0..d3), each shaped
            with tbf in both directions; one /32 data address per endpoint, reached over an
            ECMP route across the 4 links with layer-4 hashing (fib_multipath_hash_policy=1),
            so the UDP source port picks the link; a 5th unshaped, never-impaired control
            link (ctl) with its own /24 for out-of-band traffic (Open MPI's OOB, fi_pingpong's
            setup socket).
incast      sender namespaces s1..sN and a receiver r joined by a bridge in a switch
            namespace; the bridge's receiver-facing port is tbf-shaped.

Impairments are nftables rules at the INGRESS (prerouting) of the receiving namespace, on
both ends, so both directions are impaired and a sender's sendto never fails: random drop
in 1/10000 steps, CE marking of ECT packets, drop-everything on one link, and bursty loss
(see BURSTY below). Counters (per-veth packets/bytes, tbf drops, nft drop/CE counters) are
read as a dict by `counters()`.

Run as root. As a script:
    fabric.py up multipath [--name N] [--rate-mbit 250] [--mtu 1500]   # prints the fabric
    fabric.py up incast [--name N] [--senders 4] [--rate-mbit 500]
    fabric.py impair --name N [--drop P] [--ce P] [--burst P:LEN] [--blackhole LINK] [--link L]
    fabric.py counters --name N          # JSON
    fabric.py spread --name N            # UDP from 64 source ports: packets per data link
    fabric.py down --name N
    fabric.py cleanup [--prefix mrf] [--all]  # removes the fabrics whose owner is gone
Importable: `with MultipathFabric() as fab: fab.set_impairments([...]); fab.counters()`.
Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Self

# --- shaping constants (printed by `up`) ----------------------------------------------------
LINK_RATE_MBIT = 250
"""Per data link, per direction: 4 x 250 Mbit/s = 1 Gbit/s aggregate, which this 2-core host
fills with a UDP flood while leaving CPU for the transport under test."""
LINK_BURST_BYTES = 32 * 1024
"""tbf bucket: ~1 ms of line rate at 250 Mbit/s. tbf dequeues from softirq/hrtimer context;
on a loaded 2-core host a wake-up can be late by several hundred microseconds, and a bucket
smaller than that lateness makes the link run below its rate (measured: 8 KiB gave ~15 %
less). 1 ms is also the burst a userspace pacer with ~1 ms time slices emits."""
LINK_LIMIT_BYTES = 128 * 1024
"""tbf queue: ~4 ms at 250 Mbit/s, a shallow-buffered switch port's share. Large enough that
a paced sender at the link rate sees no tail drop from scheduling jitter alone, small enough
that an unpaced sender overflowing it is visible as tbf drops (loss that is congestion, not
the nftables impairment) and queueing delay stays in milliseconds."""
INCAST_RATE_MBIT = 500
"""The incast fabric's receiver-facing bridge port; senders' own ports are unshaped veth."""
DEFAULT_MTU = 1500
IPV4_UDP_HEADERS = 28  # what an IPv4 datagram of one MTU spends before its UDP payload
DATA_LINKS = 4
NAME_PREFIX = "mrf"
NFT_TABLE = "metaroce_fabric"
BURST_MARK = 0x4D52  # skb mark for "this packet is inside a loss burst"

MULTIPATH_ADDRS = {"a": "10.200.0.1", "b": "10.200.0.2"}
CONTROL_ADDRS = {"a": "10.202.0.1", "b": "10.202.0.2"}
INCAST_NET = "10.210.0"
INCAST_RECEIVER_ADDR = f"{INCAST_NET}.100"

_NAME_RE = re.compile(r"^[a-z][a-z0-9]{1,7}-[0-9a-f]{6}$")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,7}$")


class FabricError(RuntimeError):
    """A fabric step failed; the message names the command and what to do."""


# --- pure planning ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Impairment:
    """One impairment on the data links, both directions, at the receiving side's ingress.

    kind: "drop" (random, `per10000` of packets), "ce" (mark `per10000` of ECT packets CE),
    "blackhole" (drop every IP packet), "burst" (bursts of `burst_len` consecutive packets
    dropped, `per10000` on average; see BURSTY). link: a data link index, or None for all.
    """

    kind: str
    per10000: int = 0
    link: int | None = None
    burst_len: int = 16

    def validate(self, links: int) -> None:
        if self.kind not in ("drop", "ce", "blackhole", "burst"):
            raise ValueError(
                f"impairment kind={self.kind!r}: use one of drop, ce, blackhole, burst"
            )
        if self.kind != "blackhole" and not 0 <= self.per10000 <= 10000:
            raise ValueError(
                f"impairment per10000={self.per10000}: a fraction in 1/10000 from 0 to 10000"
                " (100 = 1 %)"
            )
        if self.link is not None and not 0 <= self.link < links:
            raise ValueError(
                f"impairment link={self.link}: a data link index 0..{links - 1}, or None for all"
            )
        if self.kind == "blackhole" and self.link is None:
            raise ValueError("impairment blackhole: name one link (link=N); all links is no fabric")
        if self.kind == "burst" and not 1 <= self.burst_len <= 1000:
            raise ValueError(f"impairment burst_len={self.burst_len}: 1..1000 packets")
        if self.kind == "burst" and self.per10000 and burst_period(self) > 2**31:
            raise ValueError(f"impairment burst per10000={self.per10000}: too small for its length")


BURSTY = """Bursty loss: in each direction, `numgen inc mod P >= P - L` over the packets
entering the (chosen) data links drops L consecutive packets out of every P,
P = L * 10000 / per10000; the first burst comes after P - L packets (a burst at the start
would eat a connection's handshake and its backed-off retries: bursts are counted in
packets, so where few packets flow a burst lasts long in time, as in a packet-domain
Gilbert-Elliott channel).
The average loss is exactly per10000/10000 (the counter is kernel-atomic, so it is per
direction, across all chosen links); each burst is a run of L back-to-back losses, the
'bad state' of a Gilbert-Elliott channel with loss 1 in bad and 0 in good, with fixed
sojourn times. With 4 links sprayed per packet, one burst hits every path at once."""


def burst_period(imp: Impairment) -> int:
    return max(imp.burst_len, round(imp.burst_len * 10000 / max(imp.per10000, 1)))


def nft_ruleset(links: Sequence[str], impairments: Sequence[Impairment]) -> str:
    """The whole nftables script for one namespace: table, named counters per link, and the
    ingress rules for `impairments` (applied atomically with `nft -f -`).

    Named counters (drop_<link>, ce_<link>, seen_<link>) survive rule changes, so drop
    counts accumulate across impairment changes until the fabric is torn down.
    """
    for imp in impairments:
        imp.validate(len(links))
    lines = [
        f"table inet {NFT_TABLE} {{",
    ]
    for dev in links:
        lines += [
            f"  counter seen_{dev} {{ }}",
            f"  counter drop_{dev} {{ }}",
            f"  counter ce_{dev} {{ }}",
        ]
    lines += [
        "  chain impair {",
        "    type filter hook prerouting priority -300; policy accept;",
    ]
    for dev in links:
        lines.append(f'    iifname "{dev}" counter name seen_{dev}')
    for imp in impairments:
        chosen = list(links) if imp.link is None else [links[imp.link]]
        # nftables refuses `mod 10000 < 10000`: 100 % is no random draw at all
        draw = "" if imp.per10000 >= 10000 else f" numgen random mod 10000 < {imp.per10000}"
        if imp.kind == "drop" and imp.per10000:
            for dev in chosen:
                lines.append(f'    iifname "{dev}"{draw} counter name drop_{dev} drop')
        elif imp.kind == "ce" and imp.per10000:
            for dev in chosen:
                lines.append(
                    f'    iifname "{dev}" ip ecn {{ ect0, ect1 }}{draw}'
                    f" counter name ce_{dev} ip ecn set ce"
                )
        elif imp.kind == "blackhole":
            for dev in chosen:
                lines.append(f'    iifname "{dev}" counter name drop_{dev} drop')
        elif imp.kind == "burst" and imp.per10000:
            names = ", ".join(f'"{d}"' for d in chosen)
            period = burst_period(imp)
            lines.append(
                f"    iifname {{ {names} }} numgen inc mod {period}"
                f" >= {period - imp.burst_len} meta mark set {BURST_MARK:#x}"
            )
            for dev in chosen:
                lines.append(
                    f'    iifname "{dev}" meta mark {BURST_MARK:#x} meta mark set 0'
                    f" counter name drop_{dev} drop"
                )
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def tbf_args(
    rate_mbit: int, burst: int = LINK_BURST_BYTES, limit: int = LINK_LIMIT_BYTES
) -> list[str]:
    return ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


def parse_route_dev(text: str) -> str:
    """The `dev` of one `ip route get` answer."""
    m = re.search(r"\bdev (\S+)", text)
    if not m:
        raise FabricError(f"ip route get gave no device: {text.strip()!r}")
    return m.group(1)


def offered_mbit(client_json: str, payload: int) -> float:
    """The UDP payload rate (Mbit/s) an iperf3 client's JSON report says it sent."""
    try:
        summ = json.loads(client_json)["end"]["sum"]
        return float(summ["packets"]) * payload * 8 / float(summ["seconds"]) / 1e6
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise FabricError(f"iperf3 client report unreadable ({e}): {client_json[:200]!r}") from e


def new_name(prefix: str = NAME_PREFIX) -> str:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix={prefix!r}: 2-8 characters, a-z then a-z/0-9 (e.g. mrf)")
    return f"{prefix}-{secrets.token_hex(3)}"


# --- side effects ----------------------------------------------------------------------------


def sh(
    argv: Sequence[str], ns: str | None = None, check: bool = True, input: str | None = None
) -> str:
    """Run a command (in a namespace when `ns`), return stdout; raise naming the command."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    p = subprocess.run(full, capture_output=True, text=True, input=input, check=False)
    if check and p.returncode != 0:
        raise FabricError(
            f"`{' '.join(full)}` exited {p.returncode}: {p.stderr.strip() or p.stdout.strip()}"
            " (run as root; `fabric.py cleanup` removes leftovers)"
        )
    return p.stdout


def veth_pair(dev: str, ns: str, peer: str, peer_ns: str) -> None:
    """A veth pair made directly inside the two namespaces (never in the host's)."""
    sh(
        [
            "ip",
            "link",
            "add",
            dev,
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            peer_ns,
        ]
    )


def softnet_dropped() -> int:
    """Packets the host dropped because a CPU's input backlog was full (all namespaces:
    /proc/net/softnet_stat is per CPU, not per namespace); veth delivery can drop there."""
    total = 0
    with open("/proc/net/softnet_stat") as f:
        for line in f:
            total += int(line.split()[1], 16)
    return total


def list_netns() -> list[str]:
    out = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_netns_processes(ns: str) -> None:
    """SIGKILL what runs inside one of our namespaces (started by us), by pid."""
    for pid in sh(["ip", "netns", "pids", ns], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def delete_netns(ns: str) -> None:
    kill_netns_processes(ns)
    sh(["ip", "netns", "del", ns], check=False)


# Who made each fabric: `<name>` holds the owner's pid and its start time (clock ticks since
# boot), so a cleanup can tell a live run's fabric (another test session, a bench) from one
# a killed run left behind. Two runs on one host must not remove each other's fabrics.
OWNER_DIR = Path("/run/metaroce-fabrics")


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its ')'
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _record_owner(name: str) -> None:
    OWNER_DIR.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    (OWNER_DIR / name).write_text(f"{pid} {_proc_start(pid)}\n")


def _forget_owner(name: str) -> None:
    (OWNER_DIR / name).unlink(missing_ok=True)


def owner_alive(name: str) -> bool:
    """True while the process that made fabric `name` runs (and is not this one)."""
    try:
        pid_s, start_s = (OWNER_DIR / name).read_text().split()
        pid, start = int(pid_s), int(start_s)
    except (OSError, ValueError):
        return False  # no record (made by `fabric.py up`, or an older run): an orphan
    return pid != os.getpid() and _proc_start(pid) == start


def cleanup(prefix: str = NAME_PREFIX, include_live: bool = False) -> list[str]:
    """Remove the namespaces of every fabric under `prefix` whose owner is gone (or all of
    them with `include_live`); returns what was removed. A fabric whose owner still runs
    belongs to another test session or bench on this host and is left alone. Everything a
    fabric makes lives inside its namespaces (veths are created there directly, never in
    the host namespace), so deleting them leaves nothing behind."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix={prefix!r}: 2-8 characters, a-z then a-z/0-9 (e.g. mrf)")
    pat = re.compile(rf"^({prefix}-[0-9a-f]{{6}})-[a-z0-9]+$")
    gone, names = [], set()
    for ns in list_netns():
        m = pat.match(ns)
        if m and (include_live or not owner_alive(m.group(1))):
            delete_netns(ns)
            gone.append(ns)
            names.add(m.group(1))
    for name in names:
        _forget_owner(name)
    return gone


_live: list[Fabric] = []


def _cleanup_live() -> None:
    for fab in list(_live):
        fab.down()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _cleanup_live()
    raise SystemExit(128 + signum)


_hooks_installed = False


def _install_exit_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_cleanup_live)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


@dataclass
class Fabric:
    """Common part: a name, the namespaces it made, nftables per receiving namespace."""

    name: str = field(default_factory=new_name)
    mtu: int = DEFAULT_MTU
    impairments: list[Impairment] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"name={self.name!r}: <prefix>-<6 hex>, e.g. {new_name()}")
        if not 576 <= self.mtu <= 9000:
            raise ValueError(f"mtu={self.mtu}: 576..9000 (1500 or 9000 are the tested ones)")

    def max_udp_payload(self) -> int:
        """The largest UDP payload one datagram of the fabric's MTU carries unfragmented."""
        return self.mtu - IPV4_UDP_HEADERS

    # subclasses fill these
    def roles(self) -> list[str]:
        raise NotImplementedError

    def impaired(self) -> dict[str, list[str]]:
        """namespace -> the data interfaces whose ingress is impaired there."""
        raise NotImplementedError

    def build(self) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def ns(self, role: str) -> str:
        return f"{self.name}-{role}"

    def namespaces(self) -> list[str]:
        return [self.ns(r) for r in self.roles()]

    def exists(self) -> bool:
        have = set(list_netns())
        return all(n in have for n in self.namespaces())

    def up(self) -> Self:
        _install_exit_hooks()
        _live.append(self)
        _record_owner(self.name)
        try:
            for n in self.namespaces():
                sh(["ip", "netns", "add", n])
                sh(["ip", "-n", n, "link", "set", "lo", "up"])
                for key, val in (
                    ("net.ipv4.fib_multipath_hash_policy", "1"),
                    ("net.ipv4.conf.all.rp_filter", "0"),
                    ("net.ipv4.conf.default.rp_filter", "0"),
                    ("net.ipv6.conf.all.disable_ipv6", "1"),
                    ("net.ipv6.conf.default.disable_ipv6", "1"),
                ):
                    sh(["sysctl", "-qw", f"{key}={val}"], ns=n)
            self.build()
            self.set_impairments([])
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for n in self.namespaces():
            delete_netns(n)
        _forget_owner(self.name)
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def set_impairments(self, impairments: Sequence[Impairment]) -> list[tuple[float, float]]:
        """Replace the impairments (atomically, in every receiving namespace). Returns,
        per namespace in turn, the `time.monotonic()` instants around its `nft -f`: the
        new rules took effect there between the two."""
        applied: list[tuple[float, float]] = []
        for ns, links in self.impaired().items():
            script = nft_ruleset(links, impairments)
            # add+delete first so the flush works on the first call too; counters persist
            existing = sh(["nft", "list", "tables"], ns=ns)
            prefix = ""
            if f"table inet {NFT_TABLE}" in existing:
                prefix = f"flush chain inet {NFT_TABLE} impair\n"
            before = time.monotonic()
            sh(["nft", "-f", "-"], ns=ns, input=prefix + script)
            applied.append((before, time.monotonic()))
        self.impairments = list(impairments)
        return applied

    def exec_argv(self, role: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(role), *argv]

    def probe(
        self,
        src: tuple[str, str],
        dst: tuple[str, str],
        sports: range,
        count: int,
        port: int = 9000,
        size: int = 1000,
        tos: int = 0,
        pps: int = 15000,
    ) -> dict[str, Any]:
        """Send numbered UDP from (role, address) `src`, one socket per source port, to a
        receiver at (role, address) `dst`; return the receiver's counts plus "sent"."""
        me = str(Path(__file__).resolve())
        sink = subprocess.Popen(
            self.exec_argv(
                dst[0],
                [sys.executable, me, "sink", "--addr", dst[1], "--port", str(port),
                 "--seconds", str(30 + count * len(sports) / pps), "--idle", "1.5"],
            ),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert sink.stdout is not None
            if sink.stdout.readline().strip() != "ready":
                raise FabricError("udp sink did not start")
            blast = sh(
                self.exec_argv(
                    src[0],
                    [sys.executable, me, "blast", "--src", src[1], "--dst", dst[1],
                     "--port", str(port), "--sports", f"{sports.start}:{len(sports)}",
                     "--count", str(count), "--size", str(size), "--tos", str(tos),
                     "--pps", str(pps)],
                )
            )  # fmt: skip
            out, _ = sink.communicate(timeout=60 + count * len(sports) / pps)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        res: dict[str, Any] = json.loads(out)
        res["per_port"] = {int(k): v for k, v in res["per_port"].items()}
        res["ce_per_port"] = {int(k): v for k, v in res["ce_per_port"].items()}
        res["missing_runs"] = {int(k): v for k, v in res["missing_runs"].items()}
        res["sent"] = json.loads(blast)["sent"]
        return res

    def counters(self) -> dict[str, Any]:
        """{namespace role: {"links": {dev: {rx/tx packets/bytes/dropped}}, "tbf": {dev:
        {sent_packets, dropped, overlimits, backlog}}, "nft": {counter: {packets, bytes}}},
        "host": {"softnet_dropped": n}}"""
        out: dict[str, Any] = {}
        for role in self.roles():
            n = self.ns(role)
            links: dict[str, Any] = {}
            for dev in json.loads(sh(["ip", "-s", "-j", "link", "show"], ns=n) or "[]"):
                st = dev.get("stats64") or dev.get("stats") or {}
                if dev["ifname"] == "lo":
                    continue
                links[dev["ifname"]] = {
                    "rx_packets": st.get("rx", {}).get("packets", 0),
                    "rx_bytes": st.get("rx", {}).get("bytes", 0),
                    "rx_dropped": st.get("rx", {}).get("dropped", 0),
                    "tx_packets": st.get("tx", {}).get("packets", 0),
                    "tx_bytes": st.get("tx", {}).get("bytes", 0),
                    "tx_dropped": st.get("tx", {}).get("dropped", 0),
                }
            tbf: dict[str, Any] = {}
            for q in json.loads(sh(["tc", "-s", "-j", "qdisc", "show"], ns=n) or "[]"):
                if q.get("kind") == "tbf":
                    tbf[q["dev"]] = {
                        "sent_packets": q.get("packets", 0),
                        "sent_bytes": q.get("bytes", 0),
                        "dropped": q.get("drops", 0),
                        "overlimits": q.get("overlimits", 0),
                        "backlog_bytes": q.get("backlog", 0),
                    }
            nft: dict[str, Any] = {}
            if n in self.impaired():
                doc = json.loads(
                    sh(["nft", "-j", "list", "counters", "table", "inet", NFT_TABLE], ns=n)
                )
                for item in doc.get("nftables", []):
                    c = item.get("counter")
                    if c:
                        nft[c["name"]] = {"packets": c["packets"], "bytes": c["bytes"]}
            out[role] = {"links": links, "tbf": tbf, "nft": nft}
        out["host"] = {"softnet_dropped": softnet_dropped()}
        return out


@dataclass
class MultipathFabric(Fabric):
    """A <-> B over `links` tbf-shaped veths with ECMP by UDP source port, plus `ctl`."""

    links: int = DATA_LINKS
    rate_mbit: int = LINK_RATE_MBIT

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.links <= 16:
            raise ValueError(f"links={self.links}: 1..16 data links")
        if not 1 <= self.rate_mbit <= 100000:
            raise ValueError(f"rate_mbit={self.rate_mbit}: 1..100000 Mbit/s per link")

    def roles(self) -> list[str]:
        return ["a", "b"]

    def data_links(self) -> list[str]:
        return [f"d{i}" for i in range(self.links)]

    def impaired(self) -> dict[str, list[str]]:
        return {self.ns("a"): self.data_links(), self.ns("b"): self.data_links()}

    def data_addr(self, role: str) -> str:
        return MULTIPATH_ADDRS[role]

    def ctl_addr(self, role: str) -> str:
        return CONTROL_ADDRS[role]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "multipath",
            "namespaces": {r: self.ns(r) for r in self.roles()},
            "data_addr": dict(MULTIPATH_ADDRS),
            "data_iface": "data",
            "control_addr": dict(CONTROL_ADDRS),
            "control_iface": "ctl",
            "links": self.data_links(),
            "tbf": {
                "rate_mbit": self.rate_mbit,
                "burst_bytes": LINK_BURST_BYTES,
                "limit_bytes": LINK_LIMIT_BYTES,
                "both_directions": True,
            },
            "aggregate_mbit": self.rate_mbit * self.links,
            "mtu": self.mtu,
            "ecmp": "fib_multipath_hash_policy=1 (L4: addresses, protocol, ports)",
        }

    def build(self) -> None:
        a, b = self.ns("a"), self.ns("b")
        mtu = str(self.mtu)
        # The data address lives on a veth pair looped inside each namespace (this kernel
        # has no dummy driver): an interface of its own, named `data`, that libfabric
        # providers can be pointed at (FI_TCP_IFACE/FI_UDP_IFACE=data).
        for role, n in (("a", a), ("b", b)):
            sh(["ip", "-n", n, "link", "add", "data", "type", "veth", "peer", "name", "datap"])
            for dev in ("data", "datap"):
                sh(["ip", "-n", n, "link", "set", dev, "mtu", mtu, "up"])
            sh(["ip", "-n", n, "addr", "add", f"{self.data_addr(role)}/32", "dev", "data"])
        for dev in self.data_links():
            sh(
                [
                    "ip",
                    "link",
                    "add",
                    dev,
                    "netns",
                    a,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    dev,
                    "netns",
                    b,
                ]
            )
            for n in (a, b):
                sh(["ip", "-n", n, "link", "set", dev, "mtu", mtu, "up"])
                sh(["tc", "-n", n, "qdisc", "add", "dev", dev, *tbf_args(self.rate_mbit)])
        sh(
            [
                "ip",
                "link",
                "add",
                "ctl",
                "netns",
                a,
                "type",
                "veth",
                "peer",
                "name",
                "ctl",
                "netns",
                b,
            ]
        )
        for role, n in (("a", a), ("b", b)):
            sh(["ip", "-n", n, "link", "set", "ctl", "up"])
            sh(["ip", "-n", n, "addr", "add", f"{self.ctl_addr(role)}/24", "dev", "ctl"])
        for role, n in (("a", a), ("b", b)):
            peer = "b" if role == "a" else "a"
            # Device-only nexthops: the data links carry no addresses, so nothing but the
            # ECMP route reaches the peer's data address, and ARP for it is answered on
            # every link (arp_ignore=0 answers for any local address).
            hops: list[str] = []
            for dev in self.data_links():
                hops += ["nexthop", "dev", dev]
            sh(
                ["ip", "-n", n, "route", "add", f"{self.data_addr(peer)}/32", "src",
                 self.data_addr(role), *hops]
            )  # fmt: skip

    def link_for_port(self, sport: int, dport: int, src: str = "a") -> str:
        """The data link the kernel's ECMP hash picks for a UDP flow from `src`."""
        dst = "b" if src == "a" else "a"
        out = sh(
            ["ip", "-n", self.ns(src), "route", "get", self.data_addr(dst), "from",
             self.data_addr(src), "ipproto", "udp", "sport", str(sport), "dport", str(dport)]
        )  # fmt: skip
        return parse_route_dev(out)

    def ports_per_link(self, dport: int, src: str = "a", start: int = 20000) -> dict[str, int]:
        """One source port per data link (the first found from `start`), for floods pinned
        to one link each."""
        found: dict[str, int] = {}
        port = start
        while len(found) < self.links and port < start + 2000:
            found.setdefault(self.link_for_port(port, dport, src), port)
            port += 1
        if len(found) < self.links:
            raise FabricError(f"ECMP put 2000 source ports on only {sorted(found)}")
        return found

    def capacity(
        self, seconds: float = 5.0, payload: int | None = None, src: str = "a"
    ) -> dict[str, Any]:
        """The fabric's measured capacity: one iperf3 UDP flood per data link at once (each
        pinned to its link by its source port, offered 1.3x the tbf rate), the RECEIVED
        payload rate per link and in total (Mbit/s of UDP payload, i.e. what a transport's
        goodput is compared with), plus the wire rate (payload + UDP/IP/Ethernet headers).
        Datagrams carry `payload` bytes, by default the most the MTU allows."""
        payload = payload or self.max_udp_payload()
        dst = "b" if src == "a" else "a"
        base = 5201
        servers: dict[str, subprocess.Popen[str]] = {}
        clients: dict[str, subprocess.Popen[str]] = {}
        try:
            for i, dev in enumerate(self.data_links()):
                servers[dev] = subprocess.Popen(
                    self.exec_argv(dst, ["iperf3", "-s", "-1", "-J", "-p", str(base + i),
                                         "-B", self.data_addr(dst)]),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
            time.sleep(0.5)
            for i, dev in enumerate(self.data_links()):
                # the source port must hash to `dev` for the server's port base + i
                sport = self.ports_per_link(base + i, src, start=21000 + 100 * i)[dev]
                clients[dev] = subprocess.Popen(
                    self.exec_argv(src, ["iperf3", "-u", "-J", "-c", self.data_addr(dst),
                                         "-p", str(base + i), "--cport", str(sport),
                                         "-B", self.data_addr(src), "-l", str(payload),
                                         "-b", f"{int(self.rate_mbit * 1.3)}M",
                                         "-t", str(seconds)]),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
            per_link: dict[str, float] = {}
            offered: dict[str, float] = {}
            for dev in self.data_links():
                sent_out, _ = clients[dev].communicate(timeout=seconds + 30)
                offered[dev] = offered_mbit(sent_out, payload)
                out, _ = servers[dev].communicate(timeout=30)
                doc = json.loads(out)
                if "error" in doc:
                    raise FabricError(f"iperf3 server on {dev}: {doc['error']}")
                summ = doc["end"]["sum"]
                got = (summ["packets"] - summ["lost_packets"]) * payload * 8
                per_link[dev] = got / summ["seconds"] / 1e6
        finally:
            for p in (*servers.values(), *clients.values()):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        total = sum(per_link.values())
        wire = total * (payload + 42) / payload
        return {
            "payload_bytes": payload,
            "seconds": seconds,
            "per_link_mbit": per_link,
            # what each sender managed to offer: on a busy host iperf3 may not reach its
            # 1.3x target, and then the link's received rate says nothing about tbf
            "offered_per_link_mbit": offered,
            "total_mbit": total,
            "total_wire_mbit": wire,
            "configured_mbit": self.rate_mbit * self.links,
        }


@dataclass
class IncastFabric(Fabric):
    """s1..sN -> bridge (namespace sw) -> r, the port toward r shaped with tbf."""

    senders: int = 4
    rate_mbit: int = INCAST_RATE_MBIT

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.senders <= 8:
            raise ValueError(f"senders={self.senders}: 2..8 sender namespaces")
        if not 1 <= self.rate_mbit <= 100000:
            raise ValueError(f"rate_mbit={self.rate_mbit}: 1..100000 Mbit/s")

    def roles(self) -> list[str]:
        return ["sw", "r", *[f"s{i}" for i in range(1, self.senders + 1)]]

    def impaired(self) -> dict[str, list[str]]:
        return {self.ns("r"): ["eth0"]}

    def addr(self, role: str) -> str:
        return INCAST_RECEIVER_ADDR if role == "r" else f"{INCAST_NET}.{int(role[1:])}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "incast",
            "namespaces": {r: self.ns(r) for r in self.roles()},
            "addr": {r: self.addr(r) for r in self.roles() if r != "sw"},
            "iface": "eth0",
            "tbf": {
                "port": "toward r",
                "rate_mbit": self.rate_mbit,
                "burst_bytes": LINK_BURST_BYTES,
                "limit_bytes": LINK_LIMIT_BYTES,
            },
            "mtu": self.mtu,
        }

    def build(self) -> None:
        sw = self.ns("sw")
        mtu = str(self.mtu)
        sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", sw, "link", "set", "br0", "mtu", mtu, "up"])
        for role in self.roles()[1:]:
            n = self.ns(role)
            port = f"p{role}"
            sh(
                [
                    "ip",
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    n,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    sw,
                ]
            )
            sh(["ip", "-n", sw, "link", "set", port, "mtu", mtu, "master", "br0", "up"])
            sh(["ip", "-n", n, "link", "set", "eth0", "mtu", mtu, "up"])
            sh(["ip", "-n", n, "addr", "add", f"{self.addr(role)}/24", "dev", "eth0"])
        sh(["tc", "-n", sw, "qdisc", "add", "dev", "pr", *tbf_args(self.rate_mbit)])

    def capacity(self, seconds: float = 3.0, payload: int | None = None) -> dict[str, Any]:
        """The shaped port's measured capacity: one iperf3 UDP flood from every sender at
        once (together offered 1.3x the tbf rate), the RECEIVED payload rate in total
        (Mbit/s of UDP payload: what a transport's goodput is compared with). As many
        sending processes as an incast run has, so a busy host limits both alike.
        Datagrams carry `payload` bytes, by default the most the MTU allows."""
        payload = payload or self.max_udp_payload()
        senders = self.roles()[2:]
        offered = int(self.rate_mbit * 1.3 / len(senders)) + 1
        servers: dict[str, subprocess.Popen[str]] = {}
        clients: list[subprocess.Popen[str]] = []
        try:
            for i, role in enumerate(senders):
                servers[role] = subprocess.Popen(
                    self.exec_argv("r", ["iperf3", "-s", "-1", "-J", "-p", str(5301 + i),
                                         "-B", self.addr("r")]),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
            time.sleep(0.5)
            for i, role in enumerate(senders):
                flood = ["iperf3", "-u", "-J", "-c", self.addr("r"), "-p", str(5301 + i),
                         "-B", self.addr(role), "-l", str(payload),
                         "-b", f"{offered}M", "-t", str(seconds)]  # fmt: skip
                argv = self.exec_argv(role, flood)
                clients.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
            per: dict[str, float] = {}
            for c in clients:
                c.communicate(timeout=seconds + 30)
            for role, srv in servers.items():
                doc = json.loads(srv.communicate(timeout=30)[0])
                if "error" in doc:
                    raise FabricError(f"iperf3 server for {role}: {doc['error']}")
                summ = doc["end"]["sum"]
                got = (summ["packets"] - summ["lost_packets"]) * payload * 8
                per[role] = got / summ["seconds"] / 1e6
        finally:
            for p in (*servers.values(), *clients):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return {"payload_bytes": payload, "seconds": seconds, "per_sender_mbit": per,
                "total_mbit": sum(per.values()), "configured_mbit": self.rate_mbit}  # fmt: skip


def attach(name: str) -> Fabric:
    """A Fabric object for an existing fabric (made by another process), by its namespaces."""
    have = set(list_netns())
    if f"{name}-sw" in have:
        senders = sum(1 for n in have if re.match(rf"^{name}-s\d+$", n))
        return IncastFabric(name=name, senders=senders)
    if f"{name}-a" in have:
        links = int(sh(["sh", "-c", "ls -d /sys/class/net/d[0-9]* | wc -l"], ns=f"{name}-a"))
        return MultipathFabric(name=name, links=links)
    raise FabricError(f"no fabric named {name!r} (ip netns list shows none of its namespaces)")


# --- traffic tools (run inside a namespace via `ip netns exec ... fabric.py sink|blast`) -----

ECN_CE = 3
ECT0 = 2


def udp_sink(addr: str, port: int, seconds: float, idle: float = 1.0) -> dict[str, Any]:
    """Receive UDP for up to `seconds` (stop after `idle` s of silence once packets came):
    count packets, bytes, CE marks (IP_RECVTOS), packets and CE per source port, and the
    runs of missing sequence numbers (udp_blast numbers its datagrams)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    s.bind((addr, port))
    print("ready", flush=True)
    packets = nbytes = ce = ect = 0
    per_port: dict[int, int] = {}
    ce_port: dict[int, int] = {}
    seqs: set[int] = set()
    end = time.monotonic() + seconds
    last = None
    while True:
        now = time.monotonic()
        if now >= end or (last is not None and now - last > idle):
            break
        r, _, _ = select.select([s], [], [], 0.1)
        if not r:
            continue
        data, anc, _flags, src = s.recvmsg(65536, socket.CMSG_SPACE(4))
        last = time.monotonic()
        packets += 1
        nbytes += len(data)
        per_port[src[1]] = per_port.get(src[1], 0) + 1
        if len(data) >= 8:
            seqs.add(int.from_bytes(data[:8], "big"))
        for level, typ, val in anc:
            if level == socket.IPPROTO_IP and typ == socket.IP_TOS:
                tos = val[0]
                if tos & 3 == ECN_CE:
                    ce += 1
                    ce_port[src[1]] = ce_port.get(src[1], 0) + 1
                elif tos & 3:
                    ect += 1
    return {
        "packets": packets,
        "bytes": nbytes,
        "ce": ce,
        "ect": ect,
        "per_port": per_port,
        "ce_per_port": ce_port,
        "missing_runs": missing_runs(seqs),
    }


def missing_runs(seqs: set[int]) -> dict[int, int]:
    """{run length: how many runs} of sequence numbers missing below the highest seen."""
    runs: dict[int, int] = {}
    if not seqs:
        return runs
    run = 0
    for q in range(max(seqs) + 1):
        if q in seqs:
            if run:
                runs[run] = runs.get(run, 0) + 1
            run = 0
        else:
            run += 1
    return runs


def udp_blast(
    dst: str,
    port: int,
    sports: Sequence[int],
    count: int,
    size: int,
    tos: int,
    src: str,
    pps: int = 15000,
) -> dict[str, Any]:
    """Send `count` datagrams from each source port in turn (round robin), numbered (the
    first 8 bytes: a sequence number over all ports), ECT(0) with tos=2."""
    socks = []
    for sp in sports:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        s.bind((src, sp))
        s.connect((dst, port))
        socks.append(s)
    pad = b"\x5a" * max(0, size - 8)
    # The pacer looks at the clock every `every` datagrams, so at most 64 KiB leave back
    # to back: 32 jumbo frames were 287 KB at once, and the 3-4 of 8 ports one link can
    # hash to overflowed its tbf queue (LINK_LIMIT_BYTES), 23 of 400 dropped in CI.
    every = max(1, min(32, (64 * 1024) // max(size, 1)))
    sent = 0
    seq = 0
    start = time.monotonic()
    for _ in range(count):
        for s in socks:
            try:
                s.send(seq.to_bytes(8, "big") + pad)
                sent += 1
                seq += 1
            except (BlockingIOError, ConnectionRefusedError):
                pass
            if seq % every == 0:
                # paced below one link's rate (15 kpps x 1000 B = 120 Mbit/s): the loss a
                # test counts must be nftables', never a tbf queue overflowing
                ahead = seq / pps - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
    return {"sent": sent, "seconds": time.monotonic() - start}


def _parse_impairments(args: argparse.Namespace) -> list[Impairment]:
    imps: list[Impairment] = []
    if args.drop is not None:
        imps.append(Impairment("drop", args.drop, args.link))
    if args.ce is not None:
        imps.append(Impairment("ce", args.ce, args.link))
    if args.burst is not None:
        try:
            per, length = (int(x) for x in args.burst.split(":"))
        except ValueError:
            raise SystemExit(f"--burst {args.burst!r}: PER10000:LEN, e.g. 100:16") from None
        imps.append(Impairment("burst", per, args.link, length))
    if args.blackhole is not None:
        imps.append(Impairment("blackhole", 0, args.blackhole))
    return imps


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create a fabric and leave it (tear down with `down`)")
    up.add_argument("kind", choices=["multipath", "incast"])
    up.add_argument("--name")
    up.add_argument("--rate-mbit", type=int)
    up.add_argument("--mtu", type=int, default=DEFAULT_MTU)
    up.add_argument("--links", type=int, default=DATA_LINKS)
    up.add_argument("--senders", type=int, default=4)
    dn = sub.add_parser("down")
    dn.add_argument("--name", required=True)
    im = sub.add_parser("impair", help="replace the impairments (none given: clear)")
    im.add_argument("--name", required=True)
    im.add_argument("--drop", type=int, metavar="PER10000")
    im.add_argument("--ce", type=int, metavar="PER10000")
    im.add_argument("--burst", metavar="PER10000:LEN")
    im.add_argument("--blackhole", type=int, metavar="LINK")
    im.add_argument("--link", type=int, help="only this data link (default: all)")
    sp = sub.add_parser("spread", help="send UDP from 64 source ports A->B; per-link packets")
    sp.add_argument("--name", required=True)
    co = sub.add_parser("counters")
    co.add_argument("--name", required=True)
    cl = sub.add_parser("cleanup", help="remove the fabrics of a prefix whose owner is gone")
    cl.add_argument("--prefix", default=NAME_PREFIX)
    cl.add_argument("--all", action="store_true", help="also the fabrics of running owners")
    sk = sub.add_parser("sink", help="(inside a namespace) count UDP, CE marks; JSON")
    sk.add_argument("--addr", required=True)
    sk.add_argument("--port", type=int, required=True)
    sk.add_argument("--seconds", type=float, default=10)
    sk.add_argument("--idle", type=float, default=1.0)
    bl = sub.add_parser("blast", help="(inside a namespace) send UDP from many ports; JSON")
    bl.add_argument("--src", required=True)
    bl.add_argument("--dst", required=True)
    bl.add_argument("--port", type=int, required=True)
    bl.add_argument("--sports", required=True, help="FIRST:COUNT")
    bl.add_argument("--count", type=int, default=100)
    bl.add_argument("--size", type=int, default=1000)
    bl.add_argument("--tos", type=int, default=0)
    bl.add_argument("--pps", type=int, default=15000)
    args = ap.parse_args(argv)

    if args.cmd == "up":
        fab: Fabric
        name = args.name or new_name()
        if args.kind == "multipath":
            fab = MultipathFabric(
                name=name, mtu=args.mtu, links=args.links,
                rate_mbit=args.rate_mbit or LINK_RATE_MBIT,
            )  # fmt: skip
        else:
            fab = IncastFabric(
                name=name, mtu=args.mtu, senders=args.senders,
                rate_mbit=args.rate_mbit or INCAST_RATE_MBIT,
            )  # fmt: skip
        fab.up()
        _live.remove(fab)  # left up on purpose: `down`/`cleanup` removes it
        print(json.dumps(fab.describe(), indent=2))
    elif args.cmd == "down":
        attach(args.name).down()
    elif args.cmd == "impair":
        fab = attach(args.name)
        fab.set_impairments(_parse_impairments(args))
        print(f"{args.name}: {fab.impairments}")
    elif args.cmd == "spread":
        mp = attach(args.name)
        if not isinstance(mp, MultipathFabric):
            raise SystemExit(f"--name {args.name}: spread is for a multipath fabric")
        before = mp.counters()
        res = mp.probe(("a", mp.data_addr("a")), ("b", mp.data_addr("b")), range(30000, 30064), 50)
        after = mp.counters()
        per = {
            d: after["b"]["nft"][f"seen_{d}"]["packets"]
            - before["b"]["nft"][f"seen_{d}"]["packets"]
            for d in mp.data_links()
        }
        print(json.dumps({"sent": res["sent"], "received": res["packets"], "per_link": per}))
    elif args.cmd == "counters":
        print(json.dumps(attach(args.name).counters(), indent=2))
    elif args.cmd == "cleanup":
        gone = cleanup(args.prefix, include_live=args.all)
        print(f"removed {len(gone)} namespaces: {' '.join(gone) or '-'}")
    elif args.cmd == "sink":
        print(json.dumps(udp_sink(args.addr, args.port, args.seconds, args.idle)), flush=True)
    elif args.cmd == "blast":
        first, n = (int(x) for x in args.sports.split(":"))
        res = udp_blast(
            args.dst,
            args.port,
            range(first, first + n),
            args.count,
            args.size,
            args.tos,
            args.src,
            args.pps,
        )
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "BURSTY",
    "Fabric",
    "FabricError",
    "Impairment",
    "IncastFabric",
    "MultipathFabric",
    "attach",
    "cleanup",
    "nft_ruleset",
]


def iter_fabrics(prefix: str = NAME_PREFIX) -> Iterator[str]:
    """Names of the fabrics of `prefix` present now."""
    seen: set[str] = set()
    for ns in list_netns():
        m = re.match(rf"^({prefix}-[0-9a-f]{{6}})-", ns)
        if m and m.group(1) not in seen:
            seen.add(m.group(1))
            yield m.group(1)
