"""Pure logic of the device plugin: what is advertised, what a container gets, what is preferred.

What one unit of a network's resource is
----------------------------------------
Every RDMA device (NIC port) of the network on a node offers `podsPerDevice` units, with
IDs `<rdma device>-<k>` for k in 0..podsPerDevice-1 (e.g. `mlx5_0-0`, `mlx5_0-1`). With
`podsPerDevice: 1` (the default) one unit is one NIC, exclusively. With N > 1 (shared
mode) up to N pods share a NIC, one unit each.

A container asking for k units gets k *distinct* NICs: `GetPreferredAllocation` picks at
most one unit per NIC (and keeps them on one NUMA node where it can), and the kubelet
follows that preference whenever it is valid. Should a container still be handed two
units of one NIC (only possible when fewer than k NICs have free units), `Allocate`
refuses with a message that says so, instead of silently giving fewer NICs than asked.

MetaRoCE networks
-----------------
A `metaroce` network's units are per netdev (`<netdev>-<k>`): the transport runs in the
pod's own process over UDP, so a unit gives no device node but the network's versioned
library directory, mounted read-only, and the environment of `metaroce_api.metaroce_env`
(the interfaces to bind, FI_PROVIDER_PATH, the transport's settings).

Health
------
A unit is `Healthy` only when its NIC's port is ACTIVE *and* the agent has applied and
read back (verified) the network's QoS on it: a pod never lands on a NIC that would run
its RDMA traffic unmarked or without PFC/ECN. A port going down or a failed verification
turns every unit of that NIC `Unhealthy` (the kubelet then lowers allocatable).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from metaroce_agent.transport.stats import STATS_CONTAINER_DIR, STATS_ENV
from metaroce_api.metaroce_env import CONTAINER_DIR

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
"""The kubelet's health strings (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/constants.go)."""

DEVICE_DIR = "/dev/infiniband"
RDMA_CM = f"{DEVICE_DIR}/rdma_cm"
MAX_ID_LENGTH = 63
"""The kubelet's limit on a device ID."""

ENV_HCA = "NCCL_IB_HCA"
ENV_GID_INDEX = "NCCL_IB_GID_INDEX"
DEVICE_ENV = frozenset({ENV_HCA, ENV_GID_INDEX})
"""The NCCL variables that depend on which devices a container got (set by `Allocate`;
the pod webhook sets the network-wide ones)."""


@dataclass(frozen=True)
class PluginDevice:
    """One RDMA device (port) of the network on this node, as the agent core sees it.

    The agent fills this from discovery and from its apply/verify pass and hands the whole
    list to `DevicePlugin.update()` whenever something changes.
    """

    rdma_device: str
    """RDMA device name, e.g. `mlx5_0` or `rxe_eth1` (what NCCL_IB_HCA names)."""
    uverbs: str
    """Its verbs character device: `uverbs0` or `/dev/infiniband/uverbs0`."""
    netdev: str
    """The netdev the device sits on, e.g. `ens1f0`."""
    numa_node: int | None
    """NUMA node from sysfs; None (or -1 from sysfs) = unknown, no TopologyInfo sent."""
    port_active: bool
    """Port state is ACTIVE (and the netdev is up)."""
    qos_verified: bool
    """The network's QoS/transport settings were applied and read back on this device."""
    gid_index: int | None = None
    """The RoCE v2 GID index the device uses, when fixed; None = not known."""
    rdma_cm: bool = True
    """The node has /dev/infiniband/rdma_cm (rdma_ucm loaded): Allocate hands it out."""
    port: int = 1
    """RDMA port number (NCCL_IB_HCA names `<device>:<port>`)."""
    library_dir: str = ""
    """metaroce: the versioned host directory a unit mounts (`rdma_device` is then the
    netdev's name and there is no device node)."""
    env: tuple[tuple[str, str], ...] = ()
    """metaroce: the environment `Allocate` returns, but for the interface names."""

    @property
    def healthy(self) -> bool:
        return self.port_active and self.qos_verified

    @property
    def uverbs_path(self) -> str:
        name = self.uverbs.rsplit("/", 1)[-1]
        return f"{DEVICE_DIR}/{name}"

    @property
    def numa(self) -> int | None:
        return self.numa_node if self.numa_node is not None and self.numa_node >= 0 else None

    def why_unhealthy(self) -> str:
        reasons = []
        if not self.port_active:
            reasons.append("port is not ACTIVE")
        if not self.qos_verified:
            reasons.append("QoS not applied and verified yet")
        return ", ".join(reasons) or "healthy"


@dataclass(frozen=True)
class Unit:
    """One advertised unit (a kubelet `Device`)."""

    id: str
    device: PluginDevice

    @property
    def health(self) -> str:
        return HEALTHY if self.device.healthy else UNHEALTHY


def unit_id(rdma_device: str, k: int) -> str:
    """`<rdma device>-<k>`, shortened with a hash when it would exceed 63 characters."""
    suffix = f"-{k}"
    if len(rdma_device) + len(suffix) <= MAX_ID_LENGTH:
        return rdma_device + suffix
    digest = hashlib.sha256(rdma_device.encode()).hexdigest()[:8]
    keep = MAX_ID_LENGTH - len(suffix) - len(digest) - 1
    return f"{rdma_device[:keep]}.{digest}{suffix}"


def units(devices: Iterable[PluginDevice], pods_per_device: int) -> list[Unit]:
    """Every unit of every device, sorted by device name then slot (duplicates dropped:
    the first PluginDevice of a name wins)."""
    if pods_per_device < 1:
        raise ValueError(f"pods_per_device is {pods_per_device}: it must be 1 or more")
    seen: set[str] = set()
    out: list[Unit] = []
    for dev in sorted(devices, key=lambda d: d.rdma_device):
        if dev.rdma_device in seen:
            continue
        seen.add(dev.rdma_device)
        out += [Unit(unit_id(dev.rdma_device, k), dev) for k in range(pods_per_device)]
    return out


def index(all_units: Iterable[Unit]) -> dict[str, Unit]:
    return {u.id: u for u in all_units}


# --- Allocate ---------------------------------------------------------------------------


class AllocationError(ValueError):
    """A container's allocation cannot be served; the kubelet fails the pod with this text."""


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerAllocation:
    """What one container gets: device nodes (or mounts) and environment."""

    devices: tuple[DeviceNode, ...]
    envs: Mapping[str, str] = field(default_factory=dict)
    rdma_devices: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()


def allocate(
    ids: Sequence[str],
    by_id: Mapping[str, Unit],
    *,
    resource_name: str,
    device_env: frozenset[str] = DEVICE_ENV,
) -> ContainerAllocation:
    """The device nodes and per-device environment of one container asking for `ids`.

    Every distinct NIC gives `/dev/infiniband/uverbsN`; `rdma_cm` is added once, where the
    node has it.
    `NCCL_IB_HCA` = `=dev:port,...` (exact names, so `mlx5_1` never matches `mlx5_10`);
    `NCCL_IB_GID_INDEX` only when every NIC given uses the same known GID index.
    """
    if not ids:
        raise AllocationError(f"{resource_name}: Allocate called with no device IDs")
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise AllocationError(
            f"{resource_name}: unknown device ID(s) {', '.join(unknown)}: the device went away "
            "after scheduling; the pod must be recreated (its controller does this)"
        )
    devices: dict[str, PluginDevice] = {}
    for i in ids:
        dev = by_id[i].device
        devices.setdefault(dev.rdma_device, dev)
    if len(devices) < len(ids):
        raise AllocationError(
            f"{resource_name}: the container asked for {len(ids)} units but they fall on only "
            f"{len(devices)} NIC(s) ({', '.join(sorted(devices))}); one unit is one distinct "
            "NIC, and this node has too few NICs with free units: request fewer units, or "
            "add NICs to the network"
        )
    ordered = sorted(devices.values(), key=lambda d: d.rdma_device)
    if any(d.library_dir for d in ordered):
        return _allocate_metaroce(ordered, resource_name)
    nodes = [DeviceNode(d.uverbs_path, d.uverbs_path) for d in ordered]
    if all(d.rdma_cm for d in ordered):  # a missing device node fails the container's start
        nodes.append(DeviceNode(RDMA_CM, RDMA_CM))
    envs: dict[str, str] = {}
    if ENV_HCA in device_env:
        envs[ENV_HCA] = "=" + ",".join(f"{d.rdma_device}:{d.port}" for d in ordered)
    gids = {d.gid_index for d in ordered}
    if ENV_GID_INDEX in device_env and len(gids) == 1 and None not in gids:
        envs[ENV_GID_INDEX] = str(gids.pop())
    return ContainerAllocation(
        devices=tuple(nodes), envs=envs, rdma_devices=tuple(d.rdma_device for d in ordered)
    )


def _allocate_metaroce(ordered: Sequence[PluginDevice], resource_name: str) -> ContainerAllocation:
    """The library directory, read-only, and the environment naming the netdevs given."""
    dirs = {d.library_dir for d in ordered}
    if len(dirs) != 1 or "" in dirs:
        raise AllocationError(
            f"{resource_name}: the units asked for carry different transport libraries "
            f"({', '.join(sorted(dirs))}); the agent is between two versions: retry"
        )
    netdevs = [d.rdma_device for d in ordered]
    envs = dict(ordered[0].env)
    envs["MR_NCCL_IFNAME"] = "=" + ",".join(netdevs)
    envs["FI_METAROCE_IFACE"] = netdevs[0]
    return ContainerAllocation(
        devices=(),
        envs=envs,
        rdma_devices=tuple(netdevs),
        mounts=(Mount(CONTAINER_DIR, dirs.pop(), read_only=True),),
    )


def with_stats_dir(got: ContainerAllocation, host_dir: str) -> ContainerAllocation:
    """A metaroce allocation plus its own stats directory, mounted read-write at
    `STATS_CONTAINER_DIR`, named by `MR_STATS_DIR` and added to `MR_CONFIG` as `stats_dir=`.

    The kubelet puts a container's own `env` after the device plugin's, and the runtime
    keeps the last value of a name: a pod spec that sets `MR_CONFIG` (the webhook does, and
    so may the user) replaces this `MR_CONFIG` whole. Such a job keeps its counters
    exported by appending `stats_dir=$MR_STATS_DIR` to its own `MR_CONFIG`.
    """
    envs = dict(got.envs)
    item = f"stats_dir={STATS_CONTAINER_DIR}"
    config = envs.get("MR_CONFIG", "")
    envs["MR_CONFIG"] = f"{config},{item}" if config else item
    envs[STATS_ENV] = STATS_CONTAINER_DIR
    mount = Mount(STATS_CONTAINER_DIR, host_dir, read_only=False)
    return replace(got, envs=envs, mounts=(*got.mounts, mount))


# --- GetPreferredAllocation ------------------------------------------------------------------


def preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    by_id: Mapping[str, Unit],
) -> list[str]:
    """`size` IDs from `available` that include `must_include`: one unit per NIC first, all
    on one NUMA node when one node has enough free NICs (the must-include node first), the
    least-used NICs (most free units) first; then, only when NICs run out, more units of
    NICs already chosen (which `allocate` will refuse with an explanation).
    """
    chosen: list[str] = [i for i in dict.fromkeys(must_include) if i in by_id]
    # Unknown must-include IDs are kept as given: the kubelet insists on them.
    chosen += [i for i in dict.fromkeys(must_include) if i not in by_id]
    if len(chosen) >= size:
        return chosen[:size] if size > 0 else []
    used_devices = {by_id[i].device.rdma_device for i in chosen if i in by_id}
    free: dict[str, list[str]] = {}
    for i in available:
        if i in chosen or i not in by_id:
            continue
        free.setdefault(by_id[i].device.rdma_device, []).append(i)
    for slots in free.values():
        slots.sort()

    def numa_of(dev: str) -> int:
        numa = by_id[free[dev][0]].device.numa
        return -1 if numa is None else numa

    candidates = [d for d in free if d not in used_devices]
    by_numa: dict[int, list[str]] = {}
    for dev in candidates:
        by_numa.setdefault(numa_of(dev), []).append(dev)
    for devs in by_numa.values():
        devs.sort(key=lambda d: (-len(free[d]), d))
    need = size - len(chosen)
    must_numas = {
        -1 if by_id[i].device.numa is None else by_id[i].device.numa for i in chosen if i in by_id
    }
    # NUMA order: must-include nodes first, then nodes that alone can satisfy the rest,
    # then by how many NICs they have; the fake node -1 (unknown) last.
    order = sorted(
        by_numa,
        key=lambda n: (n not in must_numas, len(by_numa[n]) < need, -len(by_numa[n]), n == -1, n),
    )
    for numa in order:
        for dev in by_numa[numa]:
            if len(chosen) >= size:
                break
            chosen.append(free[dev].pop(0))
            used_devices.add(dev)
    # Out of distinct NICs: extra units of chosen NICs (Allocate explains the refusal).
    for dev in sorted(free, key=lambda d: (-len(free[d]), d)):
        while free[dev] and len(chosen) < size:
            chosen.append(free[dev].pop(0))
    return chosen
