"""MetaRoCE: the software transport from `transport/`, run inside the jobs' processes.

The agent prepares the node and hands pods the library; it carries no traffic itself, so
an agent restart or upgrade never cuts a job's transfers. Its steps:

- the transport's libraries, from the agent image into the network's versioned,
  read-only host directory, verified by a self-test of the installed files
  (`library.MetaRoceLibraryStep`);
- the lossy profile's host part, planned with the other QoS knobs (`plan._netdev_qos`):
  where the NIC has DCB, the DSCP to priority map with PFC off (and ETS shares when
  set); where it has none, tc marking of the network's UDP port range, as destination
  and as source port, with the data DSCP. The NIC's ECN knobs drive hardware RoCE
  congestion control and do nothing for UDP: ECN here is the transport's ECT on its
  sockets and the switches' marking.

The devices it serves are netdevs (it needs an IP address, not an RDMA device), of
their own kind `metaroce`: never an rxe link, never confused with SoftRoCE.
"""

from __future__ import annotations

from metaroce_agent.capabilities import Capabilities
from metaroce_agent.discover import NETDEV_DOWN, Inventory, NetDevice
from metaroce_agent.steps import Step
from metaroce_agent.transport.base import (
    Issue,
    Library,
    TransportDevice,
    TransportDriver,
    TransportPlan,
)
from metaroce_agent.transport.library import MetaRoceLibraryStep, install_dir
from metaroce_api import AgentConfig


class MetaRoceDriver(TransportDriver):
    mode = "metaroce"

    def plan(
        self,
        config: AgentConfig,
        inventory: Inventory,
        caps: Capabilities,
        netdevs: list[NetDevice],
    ) -> TransportPlan:
        bundle = caps.metaroce_bundle
        if bundle is None:
            return TransportPlan(
                mode="metaroce",
                errors=(Issue("transport metaroce", caps.metaroce_bundle_problem),),
                message="metaroce: the agent image carries no transport library",
            )
        library = Library(
            directory=install_dir(config.network, bundle.dir_name),
            version=bundle.version,
            checksum=bundle.checksum,
        )
        steps: list[Step] = [
            MetaRoceLibraryStep(
                "",
                source=bundle.source,
                version=bundle.version,
                checksum=bundle.checksum,
                sums=bundle.sums,
                network=config.network,
            )
        ]
        devices = tuple(TransportDevice(nd.name, "", "metaroce") for nd in netdevs)
        problems = tuple(
            Issue(f"transport metaroce on {nd.name}", f"{nd.name} {why}")
            for nd in netdevs
            if (why := netdev_problem(nd)) is not None
        )
        settings = config.transport.effective_metaroce()
        msg = (
            f"MetaRoCE {bundle.version} ({library.directory}) on "
            f"{', '.join(nd.name for nd in netdevs)}: UDP ports {settings.port_range}, "
            f"{settings.paths} paths"
        )
        return TransportPlan(
            mode="metaroce",
            steps=tuple(steps),
            devices=devices,
            problems=problems,
            message=msg,
            library=library,
        )

    def served_problem(
        self, config: AgentConfig, inventory: Inventory, served: TransportDevice
    ) -> str | None:
        nd = inventory.netdev(served.netdev)
        return "does not exist" if nd is None else netdev_problem(nd)


def netdev_problem(nd: NetDevice) -> str | None:
    """Why the transport cannot use a netdev (None = usable): it binds UDP sockets to
    the netdev's address, so it must be up with an IPv4 address."""
    if (nd.operstate or "").lower() in NETDEV_DOWN:
        return f"is {nd.operstate}: bring it up (`ip link set {nd.name} up`) and check the cable"
    if not nd.ipv4:
        return f"has no IPv4 address: the transport binds its UDP ports to it; give {nd.name} one"
    return None
