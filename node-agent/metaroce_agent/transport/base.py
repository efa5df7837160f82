"""The transport driver interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from metaroce_agent.capabilities import Capabilities
from metaroce_agent.discover import Gid, Inventory, NetDevice, Port, RdmaDevice
from metaroce_agent.steps import Step
from metaroce_api import AgentConfig

Mode = Literal["rocev2", "softroce", "metaroce", "none"]


@dataclass(frozen=True)
class Issue:
    """Something in the way: `where` names the step or device, `message` says what to do."""

    where: str
    message: str


@dataclass(frozen=True)
class TransportDevice:
    """A device the transport serves: an RDMA device (its name is known before it
    exists), or for `metaroce` a netdev alone (`rdma_device` empty)."""

    netdev: str
    rdma_device: str
    kind: Literal["hardware", "softroce", "metaroce"]
    port: int = 1

    @property
    def name(self) -> str:
        """What the device plugin and the NodeState call it."""
        return self.rdma_device or self.netdev


@dataclass(frozen=True)
class Library:
    """The transport library a node hands to pods (metaroce): its versioned directory."""

    directory: str
    version: str
    checksum: str


@dataclass(frozen=True)
class TransportPlan:
    mode: Mode
    steps: tuple[Step, ...] = ()
    devices: tuple[TransportDevice, ...] = ()
    errors: tuple[Issue, ...] = ()
    """Blocking: nothing is applied."""
    problems: tuple[Issue, ...] = ()
    """Non-blocking: the rest is applied, the node reports Degraded."""
    message: str = ""
    notes: tuple[str, ...] = field(default=())
    library: Library | None = None


class TransportDriver(ABC):
    """A transport: plans its own steps and judges whether its devices are usable."""

    mode: ClassVar[Mode]

    @abstractmethod
    def plan(
        self,
        config: AgentConfig,
        inventory: Inventory,
        caps: Capabilities,
        netdevs: list[NetDevice],
    ) -> TransportPlan: ...

    def served_problem(
        self, config: AgentConfig, inventory: Inventory, served: TransportDevice
    ) -> str | None:
        """Why a served device is not usable yet (None = usable)."""
        return self.device_problem(config, inventory.rdma_device(served.rdma_device), served.port)

    def device_problem(
        self, config: AgentConfig, device: RdmaDevice | None, port: int
    ) -> str | None:
        """Why a served device is not usable yet (None = usable)."""
        if device is None:
            return "does not exist"
        p = device.port(port)
        if p is None:
            return f"has no port {port}"
        if not p.active:
            phys = f" (physical state {p.phys_state})" if p.phys_state else ""
            return (
                f"port {port} is {p.state}{phys}: check the cable, the switch port and "
                f"`ip link show {device.netdev}`"
            )
        if select_gid(config, p) is None:
            family = config.transport.roce.address_family
            pinned = config.transport.roce.gid_index
            version = config.transport.roce.version
            if pinned is not None:
                return (
                    f"GID index {pinned} of port {port} is not a RoCE v{version} "
                    "GID: unset transport.roce.gidIndex or pick an index from "
                    f"/sys/class/infiniband/{device.name}/ports/{port}/gid_attrs/types"
                )
            return (
                f"port {port} has no RoCE v2 {family} GID: give {device.netdev or 'its netdev'} "
                f"an {family} address"
            )
        return None


def select_gid(config: AgentConfig, port: Port) -> Gid | None:
    """The GID the network uses on a port: the pinned index, or the first RoCE v2 GID of
    the address family (RoCE v1 GIDs when roce.version is 1)."""
    roce = config.transport.roce
    want_type = "RoCE v2" if roce.version == 2 else "IB/RoCE v1"
    if roce.gid_index is not None:
        return next(
            (g for g in port.gids if g.index == roce.gid_index and g.type == want_type), None
        )
    candidates = [g for g in port.gids if g.type == want_type]
    if roce.address_family == "ipv4":
        candidates = [g for g in candidates if g.is_ipv4]
    else:
        candidates = [g for g in candidates if not g.is_ipv4]
    return candidates[0] if candidates else None
