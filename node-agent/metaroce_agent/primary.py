"""The node's primary interfaces: the netdevs that carry its default route or its
Kubernetes InternalIP, which the agent refuses to reconfigure unless the network says
`nics.allowPrimaryInterface: true`.

A wrong MTU, a PFC class or a transport change on the interface the kubelet, SSH and the
default route use can cut the node off the cluster; a selector such as `drivers:
[mlx5_core]` easily matches it on nodes whose management port is a ConnectX too.

The parsers and `primary_interfaces` are pure; `read_primary_facts` gathers the inputs
at the edge (procfs for the routes, sysfs for bond/VLAN lower devices, the inventory's
addresses, the Node object's InternalIP).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from metaroce_agent.discover import Inventory, NetDevice
from metaroce_agent.host import Host
from metaroce_agent.transport.base import Issue

log = logging.getLogger("metaroce.agent.primary")

RTF_UP = 0x0001
RTF_REJECT = 0x0200
ALLOW_FIELD = "spec.nics.allowPrimaryInterface"


def ipv4_default_route_netdevs(proc_net_route: str) -> list[str]:
    """Netdevs of the IPv4 default routes in /proc/net/route (destination and mask 0,
    route up). The kernel shows the first nexthop of a multipath route only."""
    out: list[str] = []
    for line in proc_net_route.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8:
            continue
        iface, dest, flags, mask = cols[0], cols[1], cols[3], cols[7]
        try:
            up = int(flags, 16) & RTF_UP
        except ValueError:
            continue
        if dest == "00000000" and mask == "00000000" and up and iface not in out:
            out.append(iface)
    return out


def ipv6_default_route_netdevs(proc_net_ipv6_route: str) -> list[str]:
    """Netdevs of the IPv6 default routes in /proc/net/ipv6_route (::/0, up, not a
    reject route; the kernel's "unreachable" defaults sit on lo)."""
    out: list[str] = []
    for line in proc_net_ipv6_route.splitlines():
        cols = line.split()
        if len(cols) < 10:
            continue
        dest, plen, flags, iface = cols[0], cols[1], cols[8], cols[9]
        try:
            bits = int(flags, 16)
        except ValueError:
            continue
        if (
            dest == "0" * 32
            and plen == "00"
            and bits & RTF_UP
            and not bits & RTF_REJECT
            and iface != "lo"
            and iface not in out
        ):
            out.append(iface)
    return out


def node_internal_ips(node: Mapping[str, Any] | None) -> list[str]:
    """The InternalIP addresses of a Node object (`status.addresses`)."""
    if not node:
        return []
    addresses = (node.get("status") or {}).get("addresses") or []
    return [
        str(a["address"])
        for a in addresses
        if isinstance(a, dict) and a.get("type") == "InternalIP" and a.get("address")
    ]


@dataclass(frozen=True)
class PrimaryFacts:
    """What the guard needs to know about the node, gathered at the edge."""

    ipv4_default: tuple[str, ...] = ()
    """Netdevs of the IPv4 default routes."""
    ipv6_default: tuple[str, ...] = ()
    """Netdevs of the IPv6 default routes."""
    internal_ips: tuple[str, ...] = ()
    """The node's Kubernetes InternalIP addresses (empty: unknown)."""
    lowers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Lower devices of stacked netdevs (bond0 -> its ports, a VLAN -> its parent)."""


def _same_ip(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.split("/")[0]) == ipaddress.ip_address(b.split("/")[0])
    except ValueError:
        return False


def primary_interfaces(
    facts: PrimaryFacts, netdevs: Iterable[NetDevice]
) -> dict[str, tuple[str, ...]]:
    """Each netdev that carries the node's own traffic, with why (pure).

    `netdevs` is every netdev of the node (with addresses); a netdev under a bond or VLAN
    that carries the traffic counts as well, since changing it changes its upper."""
    direct: dict[str, list[str]] = {}
    for dev in facts.ipv4_default:
        direct.setdefault(dev, []).append("carries the node's IPv4 default route")
    for dev in facts.ipv6_default:
        direct.setdefault(dev, []).append("carries the node's IPv6 default route")
    for nd in netdevs:
        for ip in facts.internal_ips:
            if any(_same_ip(ip, own) for own in (*nd.ipv4, *nd.ipv6)):
                direct.setdefault(nd.name, []).append(f"has the node's Kubernetes InternalIP {ip}")
    out: dict[str, list[str]] = {k: list(v) for k, v in direct.items()}
    for upper, whys in direct.items():
        seen = {upper}
        todo = list(facts.lowers.get(upper, ()))
        while todo:
            lower = todo.pop()
            if lower in seen:
                continue
            seen.add(lower)
            out.setdefault(lower, []).extend(f"is under {upper}, which {why}" for why in whys)
            todo.extend(facts.lowers.get(lower, ()))
    return {k: tuple(v) for k, v in out.items()}


def primary_interface_errors(
    selected: Iterable[NetDevice],
    primary: Mapping[str, tuple[str, ...]],
    *,
    allowed: bool,
) -> list[Issue]:
    """A blocking issue per selected netdev that is a primary interface (pure)."""
    if allowed:
        return []
    return [
        Issue(
            "select nics",
            f"{nd.name} {' and '.join(primary[nd.name])}: the agent does not change QoS, "
            "MTU or the transport on the node's primary interface (a mistake would cut "
            "the node off the cluster). Narrow spec.nics (e.g. interfaceNames) to the "
            f"RDMA NICs, or set {ALLOW_FIELD}: true if this network really runs on it",
        )
        for nd in selected
        if nd.name in primary
    ]


# --- the edge ---------------------------------------------------------------------------


def read_lowers(host: Host, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Lower devices from sysfs (`/sys/class/net/<if>/lower_<dev>` links)."""
    out: dict[str, tuple[str, ...]] = {}
    for name in names:
        lowers = tuple(
            e.removeprefix("lower_")
            for e in host.listdir(f"/sys/class/net/{name}")
            if e.startswith("lower_")
        )
        if lowers:
            out[name] = lowers
    return out


def read_primary_facts(
    host: Host, inventory: Inventory, internal_ips: Iterable[str] = ()
) -> PrimaryFacts:
    """The routes (procfs of the agent's network namespace: the host's, the agent runs
    with hostNetwork) and the lower devices of the node's netdevs."""
    facts = PrimaryFacts(
        ipv4_default=tuple(ipv4_default_route_netdevs(host.read_opt("/proc/net/route") or "")),
        ipv6_default=tuple(ipv6_default_route_netdevs(host.read_opt("/proc/net/ipv6_route") or "")),
        internal_ips=tuple(internal_ips),
        lowers=read_lowers(host, [n.name for n in inventory.netdevs]),
    )
    log.info(
        "primary interfaces: IPv4 default via %s, IPv6 default via %s, InternalIP %s",
        ", ".join(facts.ipv4_default) or "none",
        ", ".join(facts.ipv6_default) or "none",
        ", ".join(facts.internal_ips) or "unknown",
    )
    return facts
