"""What this node can do: DCB per netdev, ECN knobs, rdma_cm configfs, tc, rdma_rxe.

`probe_capabilities` asks the host (sysfs reads and a few harmless `show` commands);
the result is plain data that the pure planner takes as input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from metaroce_agent.discover import Inventory
from metaroce_agent.host import Host
from metaroce_agent.transport.library import Bundle, read_bundle

log = logging.getLogger("metaroce.agent.capabilities")

CONFIGFS = "/sys/kernel/config"
RDMA_CM_CONFIGFS = "/sys/kernel/config/rdma_cm"


@dataclass(frozen=True)
class NetdevCaps:
    dcb: bool = False
    """The driver implements DCB netlink (dcbnl): `dcb app/pfc/ets` work."""
    dcb_reason: str = ""
    """Why not, when `dcb` is False."""
    ecn_sysfs: bool = False
    """mlx5-style per-priority ECN knobs in /sys/class/net/<if>/ecn/roce_{np,rp}/enable/."""
    cnp_sysfs: bool = False
    """CNP marking knobs /sys/class/net/<if>/ecn/roce_np/{cnp_dscp,cnp_802p_prio}."""


@dataclass(frozen=True)
class Capabilities:
    netdevs: dict[str, NetdevCaps] = field(default_factory=dict)
    rdma_cm_configfs: bool = False
    """/sys/kernel/config/rdma_cm exists (configfs mounted, rdma_cm loaded)."""
    configfs_mounted: bool = False
    rdma_cm_loadable: bool = False
    tc: bool = False
    rdma_tool: bool = False
    rxe_loaded: bool = False
    rxe_loadable: bool = False
    pyverbs: bool = False
    metaroce_bundle: Bundle | None = None
    """The MetaRoCE transport the agent image carries (transport/library.py)."""
    metaroce_bundle_problem: str = "the MetaRoCE transport was not looked for"
    notes: tuple[str, ...] = ()

    def of(self, netdev: str) -> NetdevCaps:
        return self.netdevs.get(netdev, NetdevCaps(dcb_reason=f"{netdev} was not probed"))

    @property
    def rocecm(self) -> bool:
        """rdma_cm configfs is usable now or after `modprobe rdma_cm`."""
        return self.rdma_cm_configfs or (self.configfs_mounted and self.rdma_cm_loadable)


def _tool_ok(host: Host, argv: list[str]) -> bool:
    return host.run(argv, check=False, timeout=10).rc == 0


def _module_loaded(host: Host, name: str) -> bool:
    return host.exists(f"/sys/module/{name}")


def _module_loadable(host: Host, name: str) -> bool:
    if _module_loaded(host, name):
        return True
    return host.run(["modprobe", "-n", "-q", name], check=False, timeout=10).rc == 0


def probe_netdev(host: Host, name: str, *, dcb_tool: bool) -> NetdevCaps:
    ecn = host.is_dir(f"/sys/class/net/{name}/ecn/roce_np/enable") and host.is_dir(
        f"/sys/class/net/{name}/ecn/roce_rp/enable"
    )
    cnp = host.exists(f"/sys/class/net/{name}/ecn/roce_np/cnp_dscp") and host.exists(
        f"/sys/class/net/{name}/ecn/roce_np/cnp_802p_prio"
    )
    if not dcb_tool:
        return NetdevCaps(False, "the dcb tool (iproute2) is not installed", ecn, cnp)
    res = host.run(["dcb", "-j", "pfc", "show", "dev", name], check=False, timeout=10)
    if res.ok:
        return NetdevCaps(True, "", ecn, cnp)
    why = (res.stderr or res.stdout).strip().splitlines()
    detail = why[-1] if why else f"exit {res.rc}"
    return NetdevCaps(False, f"{name} has no DCB ({detail})", ecn, cnp)


def probe_capabilities(host: Host, inventory: Inventory, netdevs: list[str]) -> Capabilities:
    """Probe what `netdevs` (the selected ones) and the node support."""
    dcb_tool = _tool_ok(host, ["dcb", "-V"])
    caps = {n: probe_netdev(host, n, dcb_tool=dcb_tool) for n in netdevs}
    configfs = host.is_dir(CONFIGFS)
    bundle, bundle_problem = read_bundle()
    result = Capabilities(
        netdevs=caps,
        rdma_cm_configfs=host.is_dir(RDMA_CM_CONFIGFS),
        configfs_mounted=configfs,
        rdma_cm_loadable=_module_loadable(host, "rdma_cm"),
        tc=_tool_ok(host, ["tc", "-V"]),
        rdma_tool=_tool_ok(host, ["rdma", "-V"]),
        rxe_loaded=_module_loaded(host, "rdma_rxe"),
        rxe_loadable=_module_loadable(host, "rdma_rxe"),
        pyverbs=inventory.source == "pyverbs",
        metaroce_bundle=bundle,
        metaroce_bundle_problem=bundle_problem,
    )
    log.info(
        "capabilities: %s; rdma_cm configfs %s, tc %s, rdma %s, rdma_rxe %s",
        ", ".join(
            f"{n}: dcb {'yes' if c.dcb else 'no'}, ecn {'yes' if c.ecn_sysfs else 'no'}"
            for n, c in caps.items()
        )
        or "no netdevs selected",
        "yes" if result.rocecm else "no",
        "yes" if result.tc else "no",
        "yes" if result.rdma_tool else "no",
        "loaded" if result.rxe_loaded else ("loadable" if result.rxe_loadable else "missing"),
    )
    return result
