"""Fixture sysfs trees and a recording command runner for the agent's unit tests.

`SysfsTree` builds a node's /sys (netdevs with PCI or virtio devices, RDMA devices with
ports, GID tables and counters, configfs) under a tmp root, with relative symlinks so
`Host(root)` resolves them like the kernel's. `FakeKernel` is a `CommandRunner` that
records every argv and answers `dcb`, `tc`, `rdma` and `modprobe` the way iproute2 and
kmod do (JSON shapes copied from real runs in the SoftRoCE guests), keeping their state
in memory and in the tree (an `rdma link add` makes the rxe device appear in sysfs).
`FixtureHost` makes configfs `mkdir` behave like rdma_cm's (ports/N appear).
Unit tests only: the agent itself always uses the real runner.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shlex
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metaroce_agent.host import CommandError, CommandResult, CommandRunner, Host, HostError
from metaroce_agent.loop import Agent, AgentOptions
from metaroce_agent.probe import Local
from metaroce_api import AgentConfig

ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"

RXE_HW_COUNTERS = [
    "sent_pkts",
    "rcvd_pkts",
    "duplicate_request",
    "out_of_seq_request",
    "rcvd_rnr_err",
    "send_rnr_err",
    "rcvd_seq_err",
    "ack_deferred",
    "retry_exceeded_err",
    "retry_rnr_exceeded_err",
    "completer_retry_err",
    "send_err",
    "link_downed",
    "rdma_sends",
    "rdma_recvs",
    "lifespan",
]
MLX5_PORT_COUNTERS = [
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "multicast_rcv_packets",
    "multicast_xmit_packets",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
    "unicast_rcv_packets",
    "unicast_xmit_packets",
    "VL15_dropped",
]
MLX5_HW_COUNTERS = [
    "duplicate_request",
    "implied_nak_seq_err",
    "lifespan",
    "local_ack_timeout_err",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "req_cqe_flush_error",
    "req_remote_access_errors",
    "req_remote_invalid_request",
    "resp_cqe_error",
    "resp_cqe_flush_error",
    "resp_local_length_error",
    "resp_remote_access_errors",
    "rnr_nak_retry_err",
    "roce_adp_retrans",
    "roce_adp_retrans_to",
    "roce_slow_restart",
    "roce_slow_restart_cnps",
    "roce_slow_restart_trans",
    "rp_cnp_handled",
    "rp_cnp_ignored",
    "rx_atomic_requests",
    "rx_icrc_encapsulated",
    "rx_read_requests",
    "rx_write_requests",
]


def ipv4_gid(addr: str) -> str:
    a, b, c, d = (int(x) for x in addr.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def link_local_gid(mac: str) -> str:
    b = [int(x, 16) for x in mac.split(":")]
    b[0] ^= 2
    return "fe80:0000:0000:0000:{:02x}{:02x}:{:02x}ff:fe{:02x}:{:02x}{:02x}".format(*b)


class SysfsTree:
    """Builds /sys (and /proc, /dev) of a fake node under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._ifindex = 1
        self._uverbs = 0
        self.mkdir("/sys/class/net")
        self.mkdir("/sys/class/infiniband")
        self.mkdir("/sys/class/infiniband_verbs")
        self.mkdir("/sys/module")
        self.mkdir("/proc")
        self.mkdir("/run/metaroce/agent")

    # --- plumbing --------------------------------------------------------------------
    def p(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def mkdir(self, path: str) -> None:
        self.p(path).mkdir(parents=True, exist_ok=True)

    def write(self, path: str, value: object) -> None:
        target = self.p(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"{value}\n")

    def symlink(self, path: str, target: str) -> None:
        link = self.p(path)
        link.parent.mkdir(parents=True, exist_ok=True)
        rel = os.path.relpath(self.p(target), link.parent)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(rel)

    # --- parts -----------------------------------------------------------------------
    def module(self, name: str) -> None:
        self.mkdir(f"/sys/module/{name}")

    def configfs(self, rdma_cm: bool = True) -> None:
        self.mkdir("/sys/kernel/config")
        if rdma_cm:
            self.mkdir("/sys/kernel/config/rdma_cm")
            self.module("rdma_cm")

    def netdev(
        self,
        name: str,
        *,
        mtu: int = 1500,
        mac: str | None = None,
        pci: str | None = None,
        vendor: str = "0x15b3",
        device: str = "0x101d",
        driver: str | None = "mlx5_core",
        numa: int = 0,
        speed: int | None = 100000,
        operstate: str = "up",
        virtio: bool = False,
        kind: str | None = None,
        ipv4: Sequence[str] = (),
        ecn: bool = False,
        cnp: bool = False,
        max_mtu: int | None = None,
    ) -> str:
        base = f"/sys/class/net/{name}"
        idx = self._ifindex = self._ifindex + 1
        mac = mac or f"52:54:00:00:00:{idx:02x}"
        self.write(f"{base}/ifindex", idx)
        self.write(f"{base}/mtu", mtu)
        self.write(f"{base}/operstate", operstate)
        self.write(f"{base}/address", mac)
        self.write(f"{base}/speed", speed if speed is not None else -1)
        if max_mtu is not None:
            self.write(f"{base}/fixture_max_mtu", max_mtu)
        if ipv4:
            self.write(f"{base}/fixture_ipv4", "\n".join(ipv4))
        if kind is not None:  # a virtual link: no device symlink
            self.write(f"{base}/fixture_kind", kind)
            return mac
        pci = pci or f"0000:{idx:02x}:00.0"
        pdir = f"/sys/devices/pci0000:00/{pci}"
        self.write(f"{pdir}/vendor", "0x1af4" if virtio else vendor)
        self.write(f"{pdir}/device", "0x1000" if virtio else device)
        self.write(f"{pdir}/numa_node", numa)
        dev_dir = f"{pdir}/virtio{idx}" if virtio else pdir
        if virtio:
            self.write(f"{dev_dir}/vendor", "0x1af4")
            self.write(f"{dev_dir}/device", "0x0001")
            self.mkdir("/sys/bus/virtio/drivers/virtio_net")
            self.symlink(f"{dev_dir}/driver", "/sys/bus/virtio/drivers/virtio_net")
        elif driver:
            self.mkdir(f"/sys/bus/pci/drivers/{driver}")
            self.symlink(f"{dev_dir}/driver", f"/sys/bus/pci/drivers/{driver}")
        self.symlink(f"{base}/device", dev_dir)
        self.mkdir(f"{dev_dir}/net/{name}")
        if ecn:
            for point in ("roce_np", "roce_rp"):
                for prio in range(8):
                    self.write(f"{base}/ecn/{point}/enable/{prio}", 0)
        if cnp:
            self.write(f"{base}/ecn/roce_np/cnp_dscp", 0)
            self.write(f"{base}/ecn/roce_np/cnp_802p_prio", 0)
        return mac

    def rdma(
        self,
        name: str,
        *,
        netdev: str,
        software: bool = False,
        ports: int = 1,
        state: str = "4: ACTIVE",
        phys_state: str = "5: LinkUp",
        gids: Sequence[tuple[int, str, str]] | None = None,
        gid_table_len: int = 16,
        counters: bool | None = None,
        hw_counters: Sequence[str] | None = None,
        device_hw_counters: Sequence[str] = (),
        counter_value: int = 0,
        driver: str | None = None,
    ) -> None:
        """An RDMA device on `netdev`. `software=True` is rxe (a `parent` attribute, node
        description "rxe", no device link); `driver="siw"` is Software iWARP (its device
        link is the netdev's own device, if any), another name a software device with
        neither (a future MetaRoCE device)."""
        base = f"/sys/class/infiniband/{name}"
        nbase = f"/sys/class/net/{netdev}"
        mac = (self.p(f"{nbase}/address").read_text().strip()) if self.p(nbase).exists() else None
        self.write(f"{base}/node_guid", "5054:00ff:fe00:010b")
        self.write(f"{base}/fw_ver", "0.0.0" if software or driver else "22.31.1014")
        self.write(f"{base}/node_type", "1: CA")
        if driver == "siw":
            software = True
            self.write(f"{base}/node_desc", "Software iWARP stack")
            if self.p(f"{nbase}/device").exists():
                self.symlink(
                    f"{base}/device",
                    os.path.realpath(self.p(f"{nbase}/device")).replace(str(self.root), "", 1),
                )
        elif driver is not None:
            software = True
            self.write(f"{base}/node_desc", driver)
        elif software:
            self.write(f"{base}/parent", netdev)
            self.write(f"{base}/node_desc", "rxe")
        else:
            self.symlink(
                f"{base}/device",
                os.path.realpath(self.p(f"{nbase}/device")).replace(str(self.root), "", 1),
            )
        if gids is None:
            gids = []
            if mac:
                gids.append((0, link_local_gid(mac), "RoCE v2"))
                if not software:
                    gids.insert(0, (0, link_local_gid(mac), "IB/RoCE v1"))
                    gids[1] = (1, gids[1][1], "RoCE v2")
            addr_file = self.p(f"{nbase}/fixture_ipv4")
            if addr_file.exists():
                for addr in addr_file.read_text().split():
                    ip = addr.split("/")[0]
                    if not software:
                        gids.append((len(gids), ipv4_gid(ip), "IB/RoCE v1"))
                    gids.append((len(gids), ipv4_gid(ip), "RoCE v2"))
        counters = (not software) if counters is None else counters
        hw = (
            list(hw_counters)
            if hw_counters is not None
            else (RXE_HW_COUNTERS if software else MLX5_HW_COUNTERS)
        )
        for port in range(1, ports + 1):
            pb = f"{base}/ports/{port}"
            self.write(f"{pb}/state", state)
            self.write(f"{pb}/phys_state", phys_state)
            self.write(f"{pb}/link_layer", "Ethernet")
            self.write(f"{pb}/rate", "2.5 Gb/sec (1X SDR)" if software else "100 Gb/sec (4X EDR)")
            table = {i: (ZERO, None) for i in range(gid_table_len)}
            for idx, gid, gtype in gids:
                table[idx] = (gid, gtype)
            for idx, (gid, gtype) in table.items():
                self.write(f"{pb}/gids/{idx}", gid)
                if gtype is not None:
                    self.write(f"{pb}/gid_attrs/types/{idx}", gtype)
                    self.write(f"{pb}/gid_attrs/ndevs/{idx}", netdev)
            if counters:
                for c in MLX5_PORT_COUNTERS:
                    self.write(f"{pb}/counters/{c}", counter_value)
            for c in hw:
                self.write(f"{pb}/hw_counters/{c}", 10 if c == "lifespan" else counter_value)
        for c in device_hw_counters:
            self.write(f"{base}/hw_counters/{c}", counter_value)
        uv = f"uverbs{self._uverbs}"
        self._uverbs += 1
        self.write(f"/sys/class/infiniband_verbs/{uv}/ibdev", name)

    def remove_rdma(self, name: str) -> None:
        shutil.rmtree(self.p(f"/sys/class/infiniband/{name}"), ignore_errors=True)
        for uv in os.listdir(self.p("/sys/class/infiniband_verbs")):
            f = self.p(f"/sys/class/infiniband_verbs/{uv}/ibdev")
            if f.exists() and f.read_text().strip() == name:
                shutil.rmtree(f.parent)

    def process(self, pid: int, comm: str, fds: Sequence[str]) -> None:
        """A process with open files (e.g. /dev/infiniband/uverbs0)."""
        self.write(f"/proc/{pid}/comm", comm)
        self.mkdir(f"/proc/{pid}/fd")
        for i, target in enumerate(fds):
            (self.p(f"/proc/{pid}/fd") / str(i + 3)).symlink_to(target)


class FixtureNetlink:
    """Netlink over a fixture tree: MTU in /sys/class/net/<if>/mtu, addresses in
    /sys/class/net/<if>/fixture_ipv4 (one per line; a fixture-only file)."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def set_mtu(self, ifname: str, mtu: int) -> None:
        if not self.host.exists(f"/sys/class/net/{ifname}"):
            raise HostError(f"no network interface {ifname}")
        limit = self.host.read_int(f"/sys/class/net/{ifname}/fixture_max_mtu")
        if limit is not None and mtu > limit:
            raise HostError(
                f"netlink: cannot set mtu {mtu} on {ifname}: {os.strerror(errno.EINVAL)}"
            )
        self.host.write(f"/sys/class/net/{ifname}/mtu", str(mtu))

    def link_kind(self, ifname: str) -> str | None:
        return self.host.read_opt(f"/sys/class/net/{ifname}/fixture_kind")

    def qdisc_kinds(self, ifname: str) -> list[str]:
        """From `tc -j qdisc show` (the fixture's runner plays tc)."""
        import json

        res = self.host.run(["tc", "-j", "qdisc", "show", "dev", ifname], check=False)
        try:
            data = json.loads(res.stdout or "[]")
        except ValueError:
            return []
        return [str(q.get("kind")) for q in data if isinstance(q, dict)]

    def ipv4_addresses(self, ifname: str) -> list[str]:
        text = self.host.read_opt(f"/sys/class/net/{ifname}/fixture_ipv4") or ""
        return [line.strip() for line in text.splitlines() if line.strip()]

    def ipv6_addresses(self, ifname: str) -> list[str]:
        text = self.host.read_opt(f"/sys/class/net/{ifname}/fixture_ipv6") or ""
        return [line.strip() for line in text.splitlines() if line.strip()]


class FixtureHost(Host):
    """A Host over a fixture tree whose configfs behaves like rdma_cm's.

    `unwritable` holds host paths whose writes fail (EACCES), to make a step fail;
    `read_only` host directories mounted read-only (`mount -o ro`): creating, removing or
    writing anything under them fails with EROFS before any lookup, so removing what is
    not there fails too, as rmdir(2) does on a read-only mount.
    """

    unwritable: set[str]
    read_only: set[str]

    uses_kernel = False

    def __init__(
        self, root: Path | str, runner: CommandRunner | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("netlink", FixtureNetlink(self))
        super().__init__(root, runner, **kwargs)
        self.unwritable = set()
        self.read_only = set()

    def _refuse_on_read_only(self, path: str, what: str) -> None:
        if any(path == top or path.startswith(f"{top}/") for top in self.read_only):
            raise HostError(f"cannot {what} {path}: Read-only file system")

    def write(self, path: str, value: str) -> None:
        if path in self.unwritable:
            raise HostError(f"cannot write {value!r} to {path}: Permission denied")
        self._refuse_on_read_only(path, f"write {value!r} to")
        super().write(path, value)

    def mkdir(self, path: str) -> None:
        self._refuse_on_read_only(path, "create")
        super().mkdir(path)
        prefix = "/sys/kernel/config/rdma_cm/"
        if path.startswith(prefix) and "/" not in path[len(prefix) :]:
            dev = path[len(prefix) :]
            for port in self.listdir(f"/sys/class/infiniband/{dev}/ports"):
                pdir = self.path(f"{path}/ports/{port}")
                pdir.mkdir(parents=True, exist_ok=True)
                (pdir / "default_roce_mode").write_text("RoCE v2\n")
                (pdir / "default_roce_tos").write_text("0\n")

    def rmdir(self, path: str) -> None:
        self._refuse_on_read_only(path, "remove")
        shutil.rmtree(self.path(path), ignore_errors=True)


@dataclass
class FakeKernel:
    """A recording `CommandRunner` that plays dcb/tc/rdma/modprobe against fake state."""

    tree: SysfsTree
    dcb_devices: set[str] = field(default_factory=set)
    modules_available: set[str] = field(
        default_factory=lambda: {"rdma_rxe", "rdma_cm", "rdma_ucm", "ib_uverbs"}
    )
    tools: set[str] = field(default_factory=lambda: {"dcb", "tc", "rdma", "modprobe"})
    fail: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Command prefix (as a shell string) -> (exit code, stderr) to inject failures."""
    calls: list[list[str]] = field(default_factory=list)
    dscp_prio: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    pfc: dict[str, list[bool]] = field(default_factory=dict)
    ets: dict[str, dict[str, list[object]]] = field(default_factory=dict)
    qdiscs: dict[str, set[str]] = field(default_factory=dict)
    tc_filters: dict[tuple[str, str], dict[int, dict[str, object]]] = field(default_factory=dict)

    @property
    def commands(self) -> list[str]:
        return [shlex.join(c) for c in self.calls]

    def mutating(self) -> list[str]:
        """Commands that change state (not show/-V/modprobe -n)."""
        ro = (" show", " -V", "modprobe -n")
        return [c for c in self.commands if not any(r in c for r in ro)]

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0
    ) -> CommandResult:
        args = [str(a) for a in argv]
        self.calls.append(args)
        joined = shlex.join(args)
        rc, out, err = 0, "", ""
        for prefix, (code, msg) in self.fail.items():
            if joined.startswith(prefix):
                rc, err = code, msg
                break
        else:
            if args[0] not in self.tools:
                rc, err = 127, f"{args[0]}: command not found"
            else:
                try:
                    out = getattr(self, f"_{args[0]}")(args[1:]) or ""
                except _Fail as e:
                    rc, err = e.rc, e.msg
        result = CommandResult(tuple(args), rc, out, err)
        if check and rc != 0:
            raise CommandError(result)
        return result

    # --- modprobe ----------------------------------------------------------------------
    def _modprobe(self, args: list[str]) -> str:
        dry = "-n" in args
        name = next(a for a in args if not a.startswith("-"))
        if name not in self.modules_available:
            raise _Fail(1, f"modprobe: FATAL: Module {name} not found")
        if not dry:
            self.tree.module(name)
            if name == "rdma_cm" and self.tree.p("/sys/kernel/config").exists():
                self.tree.mkdir("/sys/kernel/config/rdma_cm")
            if name == "rdma_ucm":  # devtmpfs makes its device node
                self.tree.write("/dev/infiniband/rdma_cm", "")
        return ""

    # --- rdma --------------------------------------------------------------------------
    def _rdma(self, args: list[str]) -> str:
        if args == ["-V"]:
            return "rdma utility, iproute2-6.1.0\n"
        if args[:3] == ["-j", "link", "show"]:
            links = []
            for i, name in enumerate(sorted(os.listdir(self.tree.p("/sys/class/infiniband")))):
                parent = self.tree.p(f"/sys/class/infiniband/{name}/parent")
                state = self.tree.p(f"/sys/class/infiniband/{name}/ports/1/state")
                links.append(
                    {
                        "ifindex": i,
                        "ifname": name,
                        "port": 1,
                        "state": state.read_text().split(":")[-1].strip()
                        if state.exists()
                        else "DOWN",
                        "netdev": parent.read_text().strip() if parent.exists() else "",
                    }
                )
            return json.dumps(links)
        if args[:3] == ["-j", "res", "show"]:
            names = sorted(os.listdir(self.tree.p("/sys/class/infiniband")))
            return json.dumps(
                [
                    {"ifindex": i, "ifname": name, "pd": 1, "cq": 1, "qp": 1,
                     "ctx": self._contexts(name)}
                    for i, name in enumerate(names)
                ]
            )  # fmt: skip
        if args[:2] == ["link", "add"]:
            name, netdev = args[2], args[args.index("netdev") + 1]
            if not self.tree.p(f"/sys/class/net/{netdev}").exists():
                raise _Fail(1, f"error: No such device {netdev}")
            for other in os.listdir(self.tree.p("/sys/class/infiniband")):
                parent = self.tree.p(f"/sys/class/infiniband/{other}/parent")
                if other == name or (parent.exists() and parent.read_text().strip() == netdev):
                    raise _Fail(1, "error: File exists")
            if "rdma_rxe" not in os.listdir(self.tree.p("/sys/module")):
                raise _Fail(1, "error: Operation not supported")
            self.tree.rdma(name, netdev=netdev, software=True)
            return ""
        if args[:2] == ["link", "delete"]:
            name = args[2]
            if not self.tree.p(f"/sys/class/infiniband/{name}").exists():
                raise _Fail(1, f"Wrong device name - {name}")
            self.tree.remove_rdma(name)
            return ""
        raise _Fail(1, f"fake rdma: unsupported {args}")

    def _contexts(self, device: str) -> int:
        """Verbs contexts open on `device`, as the kernel counts them whatever the caller's
        PID namespace: the fixture processes holding its uverbs node, plus
        `fixture_hidden_contexts` (processes a PID namespace hides from /proc)."""
        paths = set()
        verbs = self.tree.p("/sys/class/infiniband_verbs")
        for uv in os.listdir(verbs) if verbs.exists() else []:
            ibdev = verbs / uv / "ibdev"
            if ibdev.exists() and ibdev.read_text().strip() == device:
                paths.add(f"/dev/infiniband/{uv}")
        count = 0
        proc = self.tree.p("/proc")
        for pid in os.listdir(proc) if proc.exists() else []:
            fd_dir = proc / pid / "fd"
            for fd in os.listdir(fd_dir) if fd_dir.is_dir() else []:
                if os.readlink(fd_dir / fd) in paths:
                    count += 1
        hidden = self.tree.p(f"/sys/class/infiniband/{device}/fixture_hidden_contexts")
        return count + (int(hidden.read_text()) if hidden.exists() else 0)

    # --- dcb ---------------------------------------------------------------------------
    def _dcb(self, args: list[str]) -> str:
        if args == ["-V"]:
            return "dcb utility, iproute2-6.1.0\n"
        flags = [a for a in args if a.startswith("-")]
        rest = [a for a in args if not a.startswith("-")]
        obj, cmd = rest[0], rest[1]
        dev = rest[rest.index("dev") + 1]
        if dev not in self.dcb_devices:
            raise _Fail(1, "Attribute read: Operation not supported")
        params = rest[rest.index("dev") + 2 :]
        if cmd == "show":
            assert "-j" in flags
            if obj == "app":
                return json.dumps(
                    {"dscp_prio": [[d, p] for d, p in sorted(self.dscp_prio.get(dev, set()))]}
                )
            if obj == "pfc":
                return json.dumps({"pfc_cap": 8, "prio_pfc": self.pfc.get(dev, [False] * 8)})
            if obj == "ets":
                state = self.ets.get(
                    dev,
                    {
                        "tc_bw": [100, 0, 0, 0, 0, 0, 0, 0],
                        "tc_tsa": ["ets"] + ["strict"] * 7,
                        "prio_tc": [0] * 8,
                    },
                )
                return json.dumps({"willing": False, "ets_cap": 8, "cbs": False, **state})
        if obj == "app" and cmd in ("add", "del", "replace"):
            pairs = {(int(d), int(p)) for d, p in (x.split(":") for x in params[1:])}
            table = self.dscp_prio.setdefault(dev, set())
            if cmd == "add":
                table |= pairs
            elif cmd == "del":
                table -= pairs
            else:
                dscps = {d for d, _ in pairs}
                table -= {e for e in table if e[0] in dscps}
                table |= pairs
            return ""
        if obj == "pfc" and cmd == "set":
            state = self.pfc.setdefault(dev, [False] * 8)
            for item in params[1:]:
                p, v = item.split(":")
                state[int(p)] = v == "on"
            return ""
        if obj == "ets" and cmd == "set":
            state = self.ets.setdefault(
                dev,
                {
                    "tc_bw": [100, 0, 0, 0, 0, 0, 0, 0],
                    "tc_tsa": ["ets"] + ["strict"] * 7,
                    "prio_tc": [0] * 8,
                },
            )
            key = None
            for item in params:
                if item in ("prio-tc", "tc-tsa", "tc-bw"):
                    key = item.replace("-", "_")
                    continue
                i, v = item.split(":")
                assert key is not None
                state[key][int(i)] = v if key == "tc_tsa" else int(v)
            return ""
        raise _Fail(1, f"fake dcb: unsupported {args}")

    # --- tc ----------------------------------------------------------------------------
    def _tc(self, args: list[str]) -> str:
        if args == ["-V"]:
            return "tc utility, iproute2-6.1.0\n"
        j = "-j" in args
        args = [a for a in args if a != "-j"]
        dev = args[args.index("dev") + 1]
        if not self.tree.p(f"/sys/class/net/{dev}").exists():
            raise _Fail(1, f'Cannot find device "{dev}"')
        qd = self.qdiscs.setdefault(dev, set())
        if args[0] == "qdisc":
            if args[1] == "show":
                assert j
                out = [{"kind": "fq_codel", "handle": "0:", "root": True}]
                if "clsact" in qd:
                    out.append({"kind": "clsact", "handle": "ffff:", "parent": "ffff:fff1"})
                return json.dumps(out)
            if args[1] == "add" and args[-1] == "clsact":
                if "clsact" in qd:
                    raise _Fail(2, "Error: Exclusivity flag on, cannot modify.")
                qd.add("clsact")
                return ""
            if args[1] == "del" and args[-1] == "clsact":
                qd.discard("clsact")
                self.tc_filters.pop((dev, "egress"), None)
                self.tc_filters.pop((dev, "ingress"), None)
                return ""
        if args[0] == "filter":
            direction = "egress" if "egress" in args else "ingress"
            table = self.tc_filters.setdefault((dev, direction), {})
            if args[1] == "show":
                out: list[dict[str, object]] = []
                for pref, entry in sorted(table.items()):
                    proto = entry.get("protocol", "ip")
                    head = {"protocol": proto, "pref": pref, "kind": "flower", "chain": 0}
                    out.append(head)
                    out.append({"pref": pref, **entry, "protocol": proto})
                return json.dumps(out)
            if "clsact" not in qd:
                raise _Fail(2, "Error: Parent Qdisc doesn't exists.")
            pref = int(args[args.index("pref") + 1])
            protocol = args[args.index("protocol") + 1] if "protocol" in args else "all"
            held = table.get(pref, {}).get("protocol")
            if held is not None and held != protocol:  # one protocol per pref, as the kernel
                if args[1] == "del":
                    raise _Fail(2, "Error: Cannot find specified filter chain.")
                raise _Fail(2, "Error: Specified filter protocol doesn't match.")
            if args[1] in ("replace", "add"):
                handle = int(args[args.index("handle") + 1], 0)
                val = int(args[args.index("set") + 1], 16)
                prio = args[args.index("priority") + 1]
                v6 = protocol == "ipv6"
                assert (("ip6" in args) == v6) and (("csum" in args) != v6), args
                # iproute2's pedit keys: the ToS byte at bits 16-23 of word 0 of the IPv4
                # header; the traffic class at bits 20-27 of word 0 of the IPv6 header
                pedit = (
                    {"htype": "ipv6", "val": f"{val << 20:x}", "mask": "f03fffff"}
                    if v6
                    else {"htype": "ipv4", "val": f"{val << 16:x}", "mask": "ff03ffff"}
                )
                actions: list[dict[str, object]] = [
                    {"order": 1, "kind": "pedit", "keys": [{"offset": 0, "cmd": "set", **pedit}]}
                ]
                if not v6:  # IPv6 has no header checksum
                    actions.append({"order": 2, "kind": "csum", "csum": "iph"})
                actions.append(
                    {"order": len(actions) + 1, "kind": "skbedit", "priority": f":{int(prio):x}"}
                )
                table[pref] = {
                    "kind": "flower",
                    "chain": 0,
                    "protocol": protocol,
                    "options": {
                        "handle": handle,
                        "keys": {
                            "eth_type": "ipv6" if v6 else "ipv4",
                            "ip_proto": "udp",
                            **_port_keys(args),
                        },
                        "not_in_hw": True,
                        "actions": actions,
                    },
                }
                return ""
            if args[1] == "del":
                if pref not in table:
                    raise _Fail(2, "Error: Filter with specified priority/protocol not found.")
                del table[pref]
                return ""
        raise _Fail(1, f"fake tc: unsupported {args}")


def _port_keys(args: list[str]) -> dict[str, object]:
    """flower's port keys as iproute2 prints them: a number, or {start, end} for a range."""
    out: dict[str, object] = {}
    for key in ("dst_port", "src_port"):
        if key in args:
            value = args[args.index(key) + 1]
            first, _, last = value.partition("-")
            out[key] = {"start": int(first), "end": int(last)} if last else int(first)
    return out


class _Fail(Exception):
    def __init__(self, rc: int, msg: str) -> None:
        super().__init__(msg)
        self.rc = rc
        self.msg = msg


# --- the standard cases ----------------------------------------------------------------------


def mellanox_node(root: Path) -> tuple[SysfsTree, FakeKernel]:
    """One ConnectX-6 Dx port with DCB and mlx5-style ECN/CNP knobs."""
    t = SysfsTree(root)
    t.configfs()
    t.netdev("ens1f0", pci="0000:3b:00.0", ipv4=["192.168.10.5/24"], ecn=True, cnp=True, mtu=9000)
    t.netdev("eno1", pci="0000:01:00.0", vendor="0x8086", device="0x1521", driver="igb")
    t.rdma("mlx5_0", netdev="ens1f0")
    k = FakeKernel(t, dcb_devices={"ens1f0", "eno1"})
    return t, k


def softroce_node(root: Path, *, veth: bool = False) -> tuple[SysfsTree, FakeKernel]:
    """A guest: virtio (or veth) netdev, no DCB, no RDMA device yet."""
    t = SysfsTree(root)
    t.configfs(rdma_cm=False)
    if veth:
        t.netdev("veth0", kind="veth", ipv4=["192.168.77.11/24"], speed=10000)
    else:
        t.netdev("eth0", virtio=True, ipv4=["192.168.77.11/24"], speed=None)
    t.netdev("mgmt0", virtio=True, ipv4=["10.0.2.15/24"], speed=None)
    k = FakeKernel(t)
    return t, k


def no_rdma_node(root: Path) -> tuple[SysfsTree, FakeKernel]:
    t = SysfsTree(root)
    t.configfs()
    t.netdev("eno1", pci="0000:01:00.0", vendor="0x8086", device="0x1521", driver="igb")
    return t, FakeKernel(t, dcb_devices=set())


def port_down_node(root: Path) -> tuple[SysfsTree, FakeKernel]:
    t = SysfsTree(root)
    t.configfs()
    t.netdev("ens1f0", pci="0000:3b:00.0", ipv4=["192.168.10.5/24"], ecn=True)
    t.netdev("ens1f1", pci="0000:3b:00.1", ipv4=["192.168.11.5/24"], ecn=True, operstate="down")
    t.rdma("mlx5_0", netdev="ens1f0")
    t.rdma("mlx5_1", netdev="ens1f1", state="1: DOWN", phys_state="3: Disabled")
    return t, FakeKernel(t, dcb_devices={"ens1f0", "ens1f1"})


def two_numa_node(root: Path) -> tuple[SysfsTree, FakeKernel]:
    t = SysfsTree(root)
    t.configfs()
    t.netdev("ens1f0", pci="0000:3b:00.0", numa=0, ipv4=["192.168.10.5/24"], ecn=True)
    t.netdev("ens7f0", pci="0000:af:00.0", numa=1, ipv4=["192.168.20.5/24"], ecn=True)
    t.rdma("mlx5_0", netdev="ens1f0")
    t.rdma("mlx5_1", netdev="ens7f0")
    return t, FakeKernel(t, dcb_devices={"ens1f0", "ens7f0"})


class SilentEndpoint:
    """The verbs side of a probe session, without RDMA: nothing ever completes. Records
    the device of each one made (subclasses give themselves their own `made` list)."""

    made: list[str] = []

    def __init__(self, local: Local) -> None:
        type(self).made.append(local.device)
        self.e = type("e", (), {"IBV_WC_RECV": 128, "IBV_WC_SUCCESS": 0})
        self.rc_cq = self.ud_cq = object()

    def post_rc_recv(self, n: int) -> None: ...

    def post_ud_recv(self, n: int) -> None: ...

    def connect(self, remote: dict[str, Any]) -> None: ...

    def hello(self) -> dict[str, Any]:
        return {"gid": "::", "rc_qpn": 1, "ud_qpn": 2, "psn": 0}

    def poll(self, cq: Any, n: int = 16) -> list[tuple[int, int]]:
        return []

    def wait(self, timeout: float, extra: tuple[Any, ...] = ()) -> list[Any]:
        r, _, _ = select.select(list(extra), [], [], min(timeout, 0.05))
        return list(r)

    def rc_send(self) -> None: ...

    def close(self) -> None: ...


# --- a whole agent over a fake node, its loop in a thread --------------------------------


def until(check: Callable[[], bool], seconds: float) -> bool:
    """Whether `check` holds within `seconds` (asked every 50 ms, and once at the end)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def fixture_agent(
    tmp_path: Path, tree: SysfsTree, kernel: FakeKernel, config: AgentConfig, **options: Any
) -> Agent:
    """An `Agent` over the fake node (`tree`, `kernel`) with `config` written where the
    agent reads it; node-1, no NodeState reports, no metrics server unless `options`
    (AgentOptions fields) say otherwise."""
    path = tmp_path / "agent.yaml"
    path.write_text(config.to_yaml())
    defaults: dict[str, Any] = {"node_name": "node-1", "report": False, "metrics_port": None}
    opts = AgentOptions(config_path=path, **{**defaults, **options})
    return Agent(opts, host=FixtureHost(tree.root, runner=kernel))


@contextlib.contextmanager
def running(agent: Agent) -> Iterator[Agent]:
    """The agent's loop in a thread for the `with` block; stopped and joined after."""
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        yield agent
    finally:
        agent.stop()
        t.join(10)


class WiredEndpoint:
    """The verbs side of a probe session over an in-process "wire": a client and a
    server endpoint (made by `probe_peer` and `ProbeServer`) find each other by QP
    number; an RC send arrives at once as the peer's receive, a UD datagram arrives
    `ud_delay` seconds later (a TCG guest's late completions), and only the first
    `ud_delivered` datagrams of a session arrive (None: all). Completions wake `wait`
    through a pipe, as a completion channel's descriptor does."""

    ud_delay = 0.0
    ud_delivered: int | None = None
    _by_qpn: dict[int, WiredEndpoint] = {}
    _next_qpn = 100

    def __init__(self, local: Local) -> None:
        cls = WiredEndpoint
        self.e = type("e", (), {"IBV_WC_SEND": 0, "IBV_WC_RECV": 128, "IBV_WC_SUCCESS": 0})
        self.rc_cq: list[tuple[int, int]] = []
        self.ud_cq: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        self.qpn = cls._next_qpn
        cls._next_qpn += 2
        cls._by_qpn[self.qpn] = self
        self.peer: WiredEndpoint | None = None
        self.ud_sent = 0

    def _complete(self, cq: list[tuple[int, int]], opcode: int) -> None:
        with self._lock:
            cq.append((opcode, 0))
        with contextlib.suppress(OSError):
            os.write(self._w, b"x")

    def post_rc_recv(self, n: int) -> None: ...

    def post_ud_recv(self, n: int) -> None: ...

    def hello(self) -> dict[str, Any]:
        return {"gid": "::", "rc_qpn": self.qpn, "ud_qpn": self.qpn + 1, "psn": 0}

    def connect(self, remote: dict[str, Any]) -> None:
        self.peer = WiredEndpoint._by_qpn[int(remote["rc_qpn"])]

    def rc_send(self) -> None:
        assert self.peer is not None
        self._complete(self.rc_cq, 0)
        self.peer._complete(self.peer.rc_cq, 128)

    def ud_send(self) -> None:
        assert self.peer is not None
        self._complete(self.ud_cq, 0)
        self.ud_sent += 1
        limit = type(self).ud_delivered
        if limit is None or self.ud_sent <= limit:
            peer = self.peer
            timer = threading.Timer(type(self).ud_delay, peer._complete, (peer.ud_cq, 128))
            timer.daemon = True
            timer.start()

    def poll(self, cq: list[tuple[int, int]], n: int = 16) -> list[tuple[int, int]]:
        with self._lock:
            out, cq[:] = cq[:n], cq[n:]
        return out

    def wait(self, timeout: float, extra: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            pending = bool(self.rc_cq or self.ud_cq)
        r, _, _ = select.select([self._r, *extra], [], [], 0 if pending else max(0.0, timeout))
        if self._r in r:
            os.read(self._r, 4096)
        return [x for x in r if x in extra]

    def close(self) -> None:
        WiredEndpoint._by_qpn.pop(self.qpn, None)
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
