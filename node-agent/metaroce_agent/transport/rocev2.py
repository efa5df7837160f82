"""Hardware RoCEv2: check the RDMA devices, their ports and RoCE v2 GIDs (nothing to set)."""

from __future__ import annotations

from metaroce_agent.capabilities import Capabilities
from metaroce_agent.discover import Inventory, NetDevice
from metaroce_agent.transport.base import Issue, TransportDevice, TransportDriver, TransportPlan
from metaroce_api import AgentConfig


class RoceV2Driver(TransportDriver):
    mode = "rocev2"

    def plan(
        self,
        config: AgentConfig,
        inventory: Inventory,
        caps: Capabilities,
        netdevs: list[NetDevice],
    ) -> TransportPlan:
        devices = []
        problems = []
        for nd in netdevs:
            hw = [d for d in inventory.rdma_on(nd.name) if d.kind == "hardware"]
            if not hw:
                problems.append(
                    Issue(
                        f"transport rocev2 on {nd.name}",
                        f"{nd.name} has no hardware RDMA device: load its RDMA driver "
                        "(e.g. mlx5_ib), or deselect it in spec.nics",
                    )
                )
                continue
            for dev in hw:
                for port in dev.ports or ():
                    devices.append(TransportDevice(nd.name, dev.name, "hardware", port.num))
                    why = self.device_problem(config, dev, port.num)
                    if why:
                        problems.append(
                            Issue(f"transport rocev2 on {dev.name}", f"{dev.name} {why}")
                        )
        if not devices and not problems:
            problems.append(
                Issue("transport rocev2", "no hardware RoCE device on the selected NICs")
            )
        errors = () if devices else tuple(problems)
        return TransportPlan(
            mode="rocev2",
            devices=tuple(devices),
            errors=errors,
            problems=() if errors else tuple(problems),
            message="hardware RoCEv2 on "
            + (
                ", ".join(f"{d.rdma_device} port {d.port} ({d.netdev})" for d in devices)
                or "nothing"
            ),
        )
