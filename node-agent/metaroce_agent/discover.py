"""Discovery: RDMA devices and ports through pyverbs, joined with sysfs.

pyverbs gives the device attributes, port state, active MTU and the GID table with each
entry's type (RoCE v1/v2); sysfs gives the netdev, PCI ids, driver, NUMA node and link
speed. Where pyverbs cannot be imported (the host's own Python has no Debian
dist-packages) or the host is the tests' fixture host, the verbs side is read from sysfs instead
and the inventory says so (`Inventory.source`, `Inventory.warnings`). In the guests and
the agent image pyverbs is there and used; `require_pyverbs=True` makes its absence an
error.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from metaroce_agent.host import Host

log = logging.getLogger("metaroce.agent.discover")

RoceType = Literal["RoCE v2", "IB/RoCE v1", "IB", "unknown"]
RdmaKind = Literal["hardware", "softroce", "software"]
"""`softroce`: an rxe device; `software`: another software device (siw, a MetaRoCE
device), which the agent neither adopts as an rxe link nor counts as hardware RoCE."""

RXE_VENDOR_ID = "0xffffff"
"""The verbs vendor id rdma_rxe reports."""
SOFTWARE_DRIVERS = {"rxe": "rxe", "Software iWARP stack": "siw"}
"""Node descriptions that software RDMA drivers set (rxe: "rxe", siw: a fixed text)."""


def rdma_driver(
    node_desc: str | None, has_parent: bool, vendor_id: str | None, device_driver: str | None
) -> tuple[RdmaKind, str | None]:
    """An RDMA device's kind and driver from what sysfs and verbs show of it.

    rxe is the only driver with a `parent` attribute, describes its node as "rxe" and
    reports vendor id 0xffffff; siw describes itself and links to the NIC's own device
    (so a device link alone does not make hardware); a hardware device's driver is the
    one bound to its device. Anything else without a device link is another software
    device, driver unknown."""
    desc = (node_desc or "").strip()
    if has_parent or desc == "rxe" or vendor_id == RXE_VENDOR_ID:
        return "softroce", "rxe"
    for prefix, driver in SOFTWARE_DRIVERS.items():
        if desc.startswith(prefix):
            return "software", driver
    if device_driver:
        return "hardware", device_driver
    return "software", None


PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
IB_MTU = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
ROCE_HEADER_BYTES = 80
"""Bytes of Ethernet/IP/UDP/BTH headers rdma_rxe and mlx5 subtract from the netdev MTU
before picking the RoCE path MTU (rxe: RXE_MAX_HDR_LENGTH)."""
PCI_ADDRESS_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class DiscoveryError(RuntimeError):
    pass


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: RoceType
    netdev: str | None = None

    @property
    def is_ipv4(self) -> bool:
        """RoCE v2 GIDs of IPv4 addresses are IPv4-mapped IPv6 (::ffff:a.b.c.d)."""
        return self.gid.startswith("0000:0000:0000:0000:0000:ffff:")

    @property
    def ipv4(self) -> str | None:
        if not self.is_ipv4:
            return None
        parts = self.gid.split(":")[-2:]
        raw = bytes.fromhex("".join(parts))
        return ".".join(str(b) for b in raw)


@dataclass(frozen=True)
class Port:
    num: int
    state: str
    """ACTIVE, DOWN, INIT, ARMED (from the verbs port state)."""
    phys_state: str | None = None
    """e.g. LinkUp, Disabled, Polling."""
    active_mtu: int | None = None
    link_layer: str | None = None
    rate: str | None = None
    gids: tuple[Gid, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def roce_v2_gids(self, family: str = "ipv4") -> list[Gid]:
        out = [g for g in self.gids if g.type == "RoCE v2"]
        if family == "ipv4":
            return [g for g in out if g.is_ipv4]
        return [g for g in out if not g.is_ipv4]


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    kind: RdmaKind
    netdev: str | None
    ports: tuple[Port, ...] = ()
    node_guid: str | None = None
    fw_version: str | None = None
    vendor_id: str | None = None
    vendor_part_id: str | None = None
    uverbs: str | None = None
    """The verbs char device, e.g. uverbs0 (/dev/infiniband/uverbs0)."""
    driver: str | None = None
    """rxe, siw, mlx5_core, ... (None: a software device of an unknown driver)."""

    def port(self, num: int = 1) -> Port | None:
        return next((p for p in self.ports if p.num == num), None)


NETDEV_DOWN = frozenset({"down", "lowerlayerdown", "notpresent"})
"""Operstates that mean no traffic (`unknown` is what virtual netdevs report when up)."""


@dataclass(frozen=True)
class NetDevice:
    name: str
    ifindex: int | None = None
    mtu: int | None = None
    operstate: str | None = None
    mac: str | None = None
    pci_address: str | None = None
    vendor_id: str | None = None
    device_id: str | None = None
    driver: str | None = None
    numa_node: int | None = None
    speed_mbps: int | None = None
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    virtual: bool = False


@dataclass(frozen=True)
class Inventory:
    netdevs: tuple[NetDevice, ...] = ()
    rdma_devices: tuple[RdmaDevice, ...] = ()
    source: Literal["pyverbs", "sysfs"] = "sysfs"
    warnings: tuple[str, ...] = ()
    rdma_cm: bool = False
    """/dev/infiniband/rdma_cm exists (rdma_ucm is loaded): pods may be given it."""

    def netdev(self, name: str) -> NetDevice | None:
        return next((n for n in self.netdevs if n.name == name), None)

    def rdma_device(self, name: str) -> RdmaDevice | None:
        return next((d for d in self.rdma_devices if d.name == name), None)

    def rdma_on(self, netdev: str) -> list[RdmaDevice]:
        return [d for d in self.rdma_devices if d.netdev == netdev]


# --- the verbs side -------------------------------------------------------------------------


@dataclass(frozen=True)
class VerbsPort:
    num: int
    state: str
    active_mtu: int | None
    link_layer: str | None
    gids: tuple[Gid, ...]
    phys_state: str | None = None


@dataclass(frozen=True)
class VerbsDevice:
    name: str
    node_guid: str | None
    fw_version: str | None
    vendor_id: str | None
    vendor_part_id: str | None
    ports: tuple[VerbsPort, ...]


class VerbsBackend(Protocol):
    source: Literal["pyverbs", "sysfs"]

    def devices(self) -> list[str]: ...

    def query(self, name: str) -> VerbsDevice: ...


def _first_int(text: str | None) -> int | None:
    if not text:
        return None
    m = re.match(r"\s*(-?\d+)", text)
    return int(m.group(1)) if m else None


def _state_name(text: str | None) -> str:
    """sysfs `4: ACTIVE` -> ACTIVE."""
    if not text:
        return "UNKNOWN"
    return text.split(":", 1)[-1].strip().upper() or "UNKNOWN"


class SysfsVerbs:
    """The verbs view from /sys/class/infiniband (fixture trees, or no pyverbs)."""

    source: Literal["pyverbs", "sysfs"] = "sysfs"

    def __init__(self, host: Host) -> None:
        self.host = host

    def devices(self) -> list[str]:
        return self.host.listdir("/sys/class/infiniband")

    def query(self, name: str) -> VerbsDevice:
        h = self.host
        base = f"/sys/class/infiniband/{name}"
        ports = []
        for p in h.listdir(f"{base}/ports"):
            if not p.isdigit():
                continue
            pbase = f"{base}/ports/{p}"
            mtu_text = h.read_opt(f"{pbase}/active_mtu")
            ports.append(
                VerbsPort(
                    num=int(p),
                    state=_state_name(h.read_opt(f"{pbase}/state")),
                    phys_state=(h.read_opt(f"{pbase}/phys_state") or "").split(":")[-1].strip()
                    or None,
                    active_mtu=_first_int(mtu_text),
                    link_layer=h.read_opt(f"{pbase}/link_layer"),
                    gids=tuple(read_sysfs_gids(h, name, int(p))),
                )
            )
        vendor = h.read_opt(f"{base}/device/vendor")
        part = h.read_opt(f"{base}/device/device")
        return VerbsDevice(
            name=name,
            node_guid=h.read_opt(f"{base}/node_guid"),
            fw_version=h.read_opt(f"{base}/fw_ver"),
            vendor_id=vendor,
            vendor_part_id=part,
            ports=tuple(sorted(ports, key=lambda x: x.num)),
        )


def read_sysfs_gids(host: Host, device: str, port: int) -> list[Gid]:
    """The non-empty GID entries of a port, with type and netdev from gid_attrs."""
    base = f"/sys/class/infiniband/{device}/ports/{port}"
    out: list[Gid] = []
    for entry in host.listdir(f"{base}/gids"):
        if not entry.isdigit():
            continue
        gid = host.read_opt(f"{base}/gids/{entry}")
        if not gid or gid == ZERO_GID:
            continue
        gtype = host.read_opt(f"{base}/gid_attrs/types/{entry}")
        if gtype is None:  # the kernel answers EINVAL for entries without attributes
            continue
        out.append(
            Gid(
                index=int(entry),
                gid=gid,
                type=_roce_type(gtype),
                netdev=host.read_opt(f"{base}/gid_attrs/ndevs/{entry}"),
            )
        )
    return sorted(out, key=lambda g: g.index)


def _roce_type(text: str) -> RoceType:
    t = text.strip().lower()
    if "v2" in t:
        return "RoCE v2"
    if "v1" in t:
        return "IB/RoCE v1"
    if t == "ib":
        return "IB"
    return "unknown"


class PyverbsBackend:
    """The verbs view through pyverbs (Debian's python3-pyverbs in guests and the image)."""

    source: Literal["pyverbs", "sysfs"] = "pyverbs"

    def __init__(self, host: Host) -> None:
        import pyverbs.device  # noqa: F401  (fails early when missing)

        self.host = host

    def devices(self) -> list[str]:
        import pyverbs.device as d

        names = []
        for dev in d.get_device_list():
            raw = dev.name
            names.append(raw.decode() if isinstance(raw, bytes) else str(raw))
        return sorted(names)

    def query(self, name: str) -> VerbsDevice:
        import pyverbs.device as d

        ctx: Any = d.Context(name=name)
        try:
            attr = ctx.query_device()
            ifnames = _ifindex_names(self.host)
            nports = int(attr.phys_port_cnt)
            pattrs = {num: ctx.query_port(num) for num in range(1, nports + 1)}
            table = self._gid_table(ctx, sum(int(p.gid_tbl_len) for p in pattrs.values()))
            ports = []
            for num, pattr in pattrs.items():
                if table is not None:
                    gids = [
                        Gid(g.index, g.gid, g.type, ifnames.get(ifx))
                        for port, g, ifx in table
                        if port == num
                    ]
                else:
                    gids = self._gids_one_by_one(ctx, num, int(pattr.gid_tbl_len))
                ports.append(
                    VerbsPort(
                        num=num,
                        state=PORT_STATES.get(int(pattr.state), str(pattr.state)),
                        active_mtu=IB_MTU.get(int(pattr.active_mtu)),
                        link_layer=LINK_LAYERS.get(int(pattr.link_layer), "Unspecified"),
                        gids=tuple(sorted(gids, key=lambda g: g.index)),
                        phys_state=PHYS_STATES.get(int(pattr.phys_state)),
                    )
                )
            return VerbsDevice(
                name=name,
                node_guid=_guid(int(attr.node_guid)),
                fw_version=str(attr.fw_version) or None,
                vendor_id=f"0x{int(attr.vendor_id):04x}",
                vendor_part_id=f"0x{int(attr.vendor_part_id):04x}",
                ports=tuple(ports),
            )
        finally:
            ctx.close()

    @staticmethod
    def _gid_table(ctx: Any, total: int) -> list[tuple[int, Gid, int]] | None:
        """All valid GID entries in one call (rdma-core >= 32): (port, gid, ndev ifindex).

        gid_type is in the ibv_gid_type enum here: 0 IB, 1 RoCE v1, 2 RoCE v2. The kernel
        refuses a request much larger than the table, so ask for exactly its size.
        """
        try:
            entries = ctx.query_gid_table(max(total, 1))
        except Exception:
            return None
        out = []
        for e in entries:
            gid = _gid_long(str(e.gid_str()))
            if gid == ZERO_GID:
                continue
            gtype: RoceType = GID_TYPES.get(int(e.gid_type), "unknown")
            out.append((int(e.port_num), Gid(int(e.gid_index), gid, gtype), int(e.ndev_ifindex)))
        return out

    @staticmethod
    def _gids_one_by_one(ctx: Any, port: int, table_len: int) -> list[Gid]:
        """Older rdma-core: entry by entry; gid type in the sysfs enum (1 = RoCE v2)."""
        out = []
        for i in range(table_len):
            try:
                gid_obj = ctx.query_gid(port, i)
                gid = _gid_long(str(getattr(gid_obj, "gid", gid_obj)))
                if gid == ZERO_GID:
                    continue
                gtype = int(ctx.query_gid_type(port, i))
            except Exception:
                continue
            out.append(Gid(index=i, gid=gid, type="RoCE v2" if gtype == 1 else "IB/RoCE v1"))
        return out


GID_TYPES: dict[int, RoceType] = {0: "IB", 1: "IB/RoCE v1", 2: "RoCE v2"}
LINK_LAYERS = {1: "InfiniBand", 2: "Ethernet"}
PHYS_STATES = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "PhyTest",
}


def _guid(value: int) -> str:
    raw = value.to_bytes(8, "little")  # verbs GUIDs are big-endian in a little-endian u64
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


def _gid_long(gid: str) -> str:
    """Any GID text form -> the 8 x 4 hex digits form sysfs uses."""
    if gid.count(":") == 7 and all(len(p) == 4 for p in gid.split(":")):
        return gid.lower()
    import ipaddress

    try:
        full = ipaddress.IPv6Address(gid).exploded
    except ValueError:
        return gid.lower()
    return full.lower()


def _ifindex_names(host: Host) -> dict[int, str]:
    out = {}
    for name in host.listdir("/sys/class/net"):
        idx = host.read_int(f"/sys/class/net/{name}/ifindex")
        if idx is not None:
            out[idx] = name
    return out


def verbs_backend(host: Host, *, require_pyverbs: bool = False) -> tuple[VerbsBackend, list[str]]:
    """The backend to use, and warnings about the choice.

    A host without the kernel (the tests' fixture host) is read from sysfs: pyverbs sees
    only the real kernel. On the node, pyverbs is used when importable; otherwise sysfs
    with a warning, or an error when `require_pyverbs`.
    """
    if not host.uses_kernel:
        return SysfsVerbs(host), []
    try:
        return PyverbsBackend(host), []
    except ImportError as e:
        msg = (
            f"pyverbs cannot be imported ({e}): reading RDMA devices from sysfs instead "
            "(port state and GID types only, no device attributes); install Debian's "
            "python3-pyverbs and run the agent with Debian's python3"
        )
        if require_pyverbs:
            raise DiscoveryError(msg.replace("reading RDMA", "refusing to read RDMA")) from e
        log.warning("%s", msg)
        return SysfsVerbs(host), [msg]


# --- the sysfs side -------------------------------------------------------------------------


def read_netdev(host: Host, name: str) -> NetDevice:
    base = f"/sys/class/net/{name}"
    h = host
    dev_path = h.resolve(f"{base}/device")
    pci_address = vendor = device = driver = None
    numa = None
    if dev_path is not None:
        driver = h.readlink_name(f"{base}/device/driver")
        pci_dir = dev_path
        # A virtio netdev's device is virtioN; its PCI function is the parent directory.
        if not PCI_ADDRESS_RE.match(dev_path.rsplit("/", 1)[-1]):
            parent = dev_path.rsplit("/", 1)[0]
            if PCI_ADDRESS_RE.match(parent.rsplit("/", 1)[-1]):
                pci_dir = parent
        last = pci_dir.rsplit("/", 1)[-1]
        if PCI_ADDRESS_RE.match(last):
            pci_address = last
            vendor = h.read_opt(f"{pci_dir}/vendor")
            device = h.read_opt(f"{pci_dir}/device")
            numa = h.read_int(f"{pci_dir}/numa_node")
    virtual = dev_path is None
    if driver is None and virtual:
        driver = host.netlink.link_kind(name) or _virtual_kind(host, name)
    speed = h.read_int(f"{base}/speed")
    if speed is not None and speed < 0:
        speed = None
    return NetDevice(
        name=name,
        ifindex=h.read_int(f"{base}/ifindex"),
        mtu=h.read_int(f"{base}/mtu"),
        operstate=h.read_opt(f"{base}/operstate"),
        mac=h.read_opt(f"{base}/address"),
        pci_address=pci_address,
        vendor_id=vendor,
        device_id=device,
        driver=driver,
        numa_node=numa if numa is None or numa >= 0 else None,
        speed_mbps=speed,
        virtual=virtual,
    )


def _virtual_kind(host: Host, name: str) -> str | None:
    """bridge/vlan/... from sysfs hints (no `device` link): a bridge directory or the
    uevent DEVTYPE."""
    if host.exists(f"/sys/class/net/{name}/bridge"):
        return "bridge"
    uevent = host.read_opt(f"/sys/class/net/{name}/uevent") or ""
    m = re.search(r"^DEVTYPE=(\S+)", uevent, re.M)
    return m.group(1) if m else None


def _rdma_netdev(host: Host, name: str, ports: Iterable[VerbsPort]) -> str | None:
    """The netdev of an RDMA device: GID ndevs, rxe's `parent`, or the PCI function's net/."""
    for p in ports:
        for g in p.gids:
            if g.netdev:
                return g.netdev
    base = f"/sys/class/infiniband/{name}"
    for pnum in host.listdir(f"{base}/ports"):
        for entry in host.listdir(f"{base}/ports/{pnum}/gid_attrs/ndevs"):
            ndev = host.read_opt(f"{base}/ports/{pnum}/gid_attrs/ndevs/{entry}")
            if ndev:
                return ndev
    parent = host.read_opt(f"{base}/parent")
    if parent:
        return parent
    nets = host.listdir(f"{base}/device/net")
    return nets[0] if nets else None


def _uverbs_of(host: Host, name: str) -> str | None:
    for uv in host.listdir("/sys/class/infiniband_verbs"):
        if host.read_opt(f"/sys/class/infiniband_verbs/{uv}/ibdev") == name:
            return uv
    return None


def derived_active_mtu(netdev_mtu: int | None) -> int | None:
    """The RoCE path MTU a netdev MTU allows (largest IB MTU <= mtu - headers)."""
    if netdev_mtu is None:
        return None
    fit = [m for m in IB_MTU.values() if m <= netdev_mtu - ROCE_HEADER_BYTES]
    return max(fit) if fit else None


def discover(host: Host, *, require_pyverbs: bool = False) -> Inventory:
    """Discover the node's netdevs and RDMA devices."""
    backend, warnings = verbs_backend(host, require_pyverbs=require_pyverbs)
    netdevs = []
    for name in host.listdir("/sys/class/net"):
        if name == "lo" or not host.is_dir(f"/sys/class/net/{name}"):
            continue
        nd = read_netdev(host, name)
        nd = replace(
            nd,
            ipv4=tuple(host.netlink.ipv4_addresses(name)),
            ipv6=tuple(host.netlink.ipv6_addresses(name)),
        )
        netdevs.append(nd)
    by_name = {n.name: n for n in netdevs}
    devices = []
    listed = backend.devices()
    # a device verbs cannot list (ib_uverbs not loaded) is still the node's: read it from
    # sysfs, without a verbs device, so the plan can say what is missing
    unlisted = [n for n in host.listdir("/sys/class/infiniband") if n not in listed]
    for name in unlisted:
        warnings.append(
            f"RDMA device {name} is not visible through {backend.source} (no verbs device: "
            "is ib_uverbs loaded?): read from sysfs"
        )
        log.warning("%s", warnings[-1])
    for name in [*listed, *unlisted]:
        try:
            vd = backend.query(name) if name in listed else SysfsVerbs(host).query(name)
        except Exception as e:  # a device that vanished or cannot be opened
            warnings.append(f"cannot query RDMA device {name} through {backend.source}: {e}")
            log.warning("%s", warnings[-1])
            continue
        base = f"/sys/class/infiniband/{name}"
        netdev = _rdma_netdev(host, name, vd.ports)
        kind, driver = rdma_driver(
            host.read_opt(f"{base}/node_desc"),
            host.exists(f"{base}/parent"),
            vd.vendor_id,
            host.readlink_name(f"{base}/device/driver") if host.exists(f"{base}/device") else None,
        )
        parent_nd = by_name.get(netdev or "")
        ports = []
        for vp in vd.ports:
            gids = vp.gids
            if any(g.netdev is None for g in gids):  # older pyverbs: netdevs from sysfs
                sysfs_gids = {g.index: g for g in read_sysfs_gids(host, name, vp.num)}
                gids = tuple(
                    replace(g, netdev=g.netdev or getattr(sysfs_gids.get(g.index), "netdev", None))
                    for g in gids
                )
            active_mtu = vp.active_mtu
            if active_mtu is None and backend.source == "sysfs" and parent_nd is not None:
                active_mtu = derived_active_mtu(parent_nd.mtu)
            ports.append(
                Port(
                    num=vp.num,
                    state=vp.state,
                    phys_state=vp.phys_state
                    or (host.read_opt(f"{base}/ports/{vp.num}/phys_state") or "")
                    .split(":")[-1]
                    .strip()
                    or None,
                    active_mtu=active_mtu,
                    link_layer=vp.link_layer,
                    rate=host.read_opt(f"{base}/ports/{vp.num}/rate"),
                    gids=gids,
                )
            )
        devices.append(
            RdmaDevice(
                name=name,
                kind=kind,
                driver=driver,
                netdev=netdev,
                ports=tuple(ports),
                node_guid=vd.node_guid,
                fw_version=vd.fw_version,
                vendor_id=vd.vendor_id or (parent_nd.vendor_id if parent_nd else None),
                vendor_part_id=vd.vendor_part_id or (parent_nd.device_id if parent_nd else None),
                uverbs=_uverbs_of(host, name),
            )
        )
    inv = Inventory(
        netdevs=tuple(netdevs),
        rdma_devices=tuple(devices),
        source=backend.source,
        warnings=tuple(warnings),
        rdma_cm=host.exists("/dev/infiniband/rdma_cm"),
    )
    log.info(
        "discovered %d netdevs, %d RDMA devices (%s) through %s",
        len(netdevs),
        len(devices),
        ", ".join(f"{d.name}->{d.netdev}" for d in devices) or "none",
        backend.source,
    )
    return inv
