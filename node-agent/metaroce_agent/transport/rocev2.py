"""Hardware RoCEv2: load the verbs modules, check the RDMA devices, ports and RoCE v2 GIDs.

The NIC's own RDMA driver (mlx5_ib, ...) is the node's business; the verbs user space
needs ib_uverbs (without it pyverbs lists no device) and rdma_ucm (/dev/infiniband/
rdma_cm, which pods get). Discovery still sees a device verbs cannot open, so a missing
ib_uverbs is reported as such, and loaded by the plan's first steps."""

from __future__ import annotations

from metaroce_agent.capabilities import Capabilities
from metaroce_agent.discover import Inventory, NetDevice
from metaroce_agent.modules import ModuleStep
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
                if dev.uverbs is None:
                    problems.append(
                        Issue(
                            f"transport rocev2 on {dev.name}",
                            f"{dev.name} has no verbs device: ib_uverbs is not loaded (this "
                            "pass loads it; if that is refused, modprobe ib_uverbs on the node)",
                        )
                    )
                    continue
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
        missing_uverbs = any(d.uverbs is None for nd in netdevs for d in inventory.rdma_on(nd.name))
        if missing_uverbs and devices == []:
            # the modules load even though nothing is usable yet: the pass after (on the
            # new verbs devices) plans the devices
            errors = ()
        return TransportPlan(
            mode="rocev2",
            steps=(ModuleStep("ib_uverbs"), ModuleStep("rdma_ucm")),
            devices=tuple(devices),
            errors=errors,
            problems=() if errors else tuple(problems),
            message="hardware RoCEv2 on "
            + (
                ", ".join(f"{d.rdma_device} port {d.port} ({d.netdev})" for d in devices)
                or "nothing"
            ),
        )
