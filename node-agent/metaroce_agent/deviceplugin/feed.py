"""What the agent tells its device plugin (pure): `PluginDevice`s from what it knows.

The agent calls `plugin_devices` after every apply, drift and revert pass, and whenever
the ports or addresses change between passes, and hands the list to
`DevicePlugin.update()`. The rules:

- only devices that exist: a planned device (e.g. an `rxe` link) that discovery has not
  found yet, or without its verbs character device, is not advertised at all (the kubelet
  would otherwise count units nobody can open);
- `port_active`: the port is ACTIVE and its netdev is not down;
- `qos_verified`: the last apply pass succeeded (every step applied and read back), or
  it failed and its rollback left the last verified state whole with steps of this
  device (running jobs use it; `engine.verified_state_serving`), and the last drift
  pass found nothing it could not repair on this device, its netdev, or the node
  (node-wide steps such as the rdma_cm mode concern every device);
- `gid_index`: the GID the network uses on the port (pinned `gidIndex`, or the first
  RoCE v2 GID of the address family); `NCCL_IB_GID_INDEX` is set from it when every
  device a container gets agrees;
- NUMA node from the netdev's PCI device.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from metaroce_agent.deviceplugin.devices import PluginDevice
from metaroce_agent.discover import NETDEV_DOWN, Inventory
from metaroce_agent.plan import Plan
from metaroce_agent.steps import Step
from metaroce_agent.transport.base import select_gid
from metaroce_api import AgentConfig
from metaroce_api.metaroce_env import allocation_env


def plugin_devices(
    config: AgentConfig,
    inventory: Inventory,
    plan: Plan | None,
    *,
    applied: bool,
    failing: Collection[str] = (),
    in_force: Sequence[Step] = (),
) -> list[PluginDevice]:
    """The devices to advertise, sorted by name.

    `applied`: the last apply pass succeeded and the node is not reverted.
    `failing`: `Step.device` of every step whose last read-back failed and could not be
    repaired ("" = a node-wide step: then no device is verified).
    `in_force`: after a failed pass, the steps of the last verified state it left whole
    (`engine.verified_state_serving`): a planned device with one of them is verified.
    """
    if plan is None:
        return []
    node_failing = "" in failing
    kept = {s.device for s in in_force}
    if plan.mode == "metaroce":
        return _metaroce_devices(
            config, inventory, plan, applied=applied, failing=failing, kept=kept
        )
    out: dict[str, PluginDevice] = {}
    for td in plan.devices:
        dev = inventory.rdma_device(td.rdma_device)
        if dev is None or not dev.uverbs or td.rdma_device in out:
            continue
        port = dev.port(td.port)
        netdev = inventory.netdev(td.netdev)
        up = netdev is None or (netdev.operstate or "").lower() not in NETDEV_DOWN
        gid = select_gid(config, port) if port is not None else None
        verified = (
            (applied or td.netdev in kept or td.rdma_device in kept)
            and plan.ok
            and not node_failing
            and td.netdev not in failing
            and td.rdma_device not in failing
        )
        out[td.rdma_device] = PluginDevice(
            rdma_device=td.rdma_device,
            uverbs=dev.uverbs,
            netdev=td.netdev,
            numa_node=netdev.numa_node if netdev is not None else None,
            port_active=port is not None and port.active and up,
            qos_verified=verified,
            gid_index=gid.index if gid is not None else None,
            rdma_cm=inventory.rdma_cm,
            port=td.port,
        )
    return [out[name] for name in sorted(out)]


def _metaroce_devices(
    config: AgentConfig,
    inventory: Inventory,
    plan: Plan,
    *,
    applied: bool,
    failing: Collection[str],
    kept: Collection[str],
) -> list[PluginDevice]:
    """One device per netdev of a metaroce network, once its library is installed: usable
    when the netdev is up with an IPv4 address (the transport binds it)."""
    if plan.library is None:
        return []
    env = allocation_env(
        config.transport,
        config.qos,
        ["-"],
        version=plan.library.version,
        checksum=plan.library.checksum,
    )
    out = []
    for td in plan.devices:
        netdev = inventory.netdev(td.netdev)
        if netdev is None:
            continue
        up = (netdev.operstate or "").lower() not in NETDEV_DOWN and bool(netdev.ipv4)
        verified = (
            (applied or td.netdev in kept)
            and plan.ok
            and "" not in failing
            and td.netdev not in failing
        )
        out.append(
            PluginDevice(
                rdma_device=td.netdev,
                uverbs="",
                netdev=td.netdev,
                numa_node=netdev.numa_node,
                port_active=up,
                qos_verified=verified,
                rdma_cm=False,
                library_dir=plan.library.directory,
                env=tuple(sorted(env.items())),
            )
        )
    return sorted(out, key=lambda d: d.rdma_device)
