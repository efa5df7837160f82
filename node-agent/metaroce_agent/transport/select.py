"""Pick the transport driver; resolve `auto`."""

from __future__ import annotations

from metaroce_agent.discover import Inventory, NetDevice
from metaroce_agent.transport.base import Issue, TransportDriver
from metaroce_agent.transport.metaroce import MetaRoceDriver
from metaroce_agent.transport.rocev2 import RoceV2Driver
from metaroce_agent.transport.softroce import SoftRoceDriver
from metaroce_api import AgentConfig

DRIVERS: dict[str, type[TransportDriver]] = {
    "rocev2": RoceV2Driver,
    "softroce": SoftRoceDriver,
    "metaroce": MetaRoceDriver,
}


def driver_for(
    config: AgentConfig, inventory: Inventory, netdevs: list[NetDevice]
) -> tuple[TransportDriver | None, str, Issue | None]:
    """(driver, why it was chosen, blocking issue). `auto` takes hardware RoCE where the
    selected NICs have it and SoftRoCE only with allowSoftRoceFallback."""
    mode = config.transport.mode
    if mode != "auto":
        return DRIVERS[mode](), f"transport.mode is {mode}", None
    hw = [d.name for nd in netdevs for d in inventory.rdma_on(nd.name) if d.kind == "hardware"]
    if hw:
        return RoceV2Driver(), f"auto: hardware RDMA found ({', '.join(hw)})", None
    if config.transport.allow_soft_roce_fallback:
        return SoftRoceDriver(), "auto: no hardware RDMA, falling back to SoftRoCE", None
    return (
        None,
        "auto: no hardware RDMA",
        Issue(
            "transport auto",
            "no hardware RDMA device on the selected NICs "
            f"({', '.join(n.name for n in netdevs) or 'none'}) and "
            "transport.allowSoftRoceFallback is false: set it to true, or set "
            "transport.mode to softroce",
        ),
    )
