"""The MetaRoCE transport slot: a driver exists so that choosing it fails loudly.

MetaRoCE (no PFC, per-packet spraying, selective retransmit) needs NIC firmware and a
provider this agent version does not ship. Until it does, `transport.mode: metaroce`
gives a clear error on every node: never a silent fallback to RoCEv2 or SoftRoCE.
"""

from __future__ import annotations

from metaroce_agent import __version__
from metaroce_agent.capabilities import Capabilities
from metaroce_agent.discover import Inventory, NetDevice
from metaroce_agent.transport.base import Issue, TransportDriver, TransportPlan
from metaroce_api import AgentConfig


class MetaRoceNotImplemented(NotImplementedError):
    pass


class MetaRoceDriver(TransportDriver):
    mode = "metaroce"

    def plan(
        self,
        config: AgentConfig,
        inventory: Inventory,
        caps: Capabilities,
        netdevs: list[NetDevice],
    ) -> TransportPlan:
        return TransportPlan(
            mode="metaroce",
            errors=(
                Issue(
                    "transport metaroce",
                    f"transport metaroce is not implemented by this agent ({__version__}): "
                    "nothing was changed on this node; set transport.mode to rocev2, "
                    "softroce or auto, or upgrade the agent once MetaRoCE support ships",
                ),
            ),
            message="metaroce: not implemented by this agent",
        )
