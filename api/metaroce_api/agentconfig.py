"""The agent's configuration: what the operator renders into the per-network ConfigMap.

Only the parts of the spec a node needs, already resolved (resource name), plus the
network generation so the agent can report which configuration it acted on.
"""

from typing import Annotated, Any, Literal

import yaml
from pydantic import Field

from metaroce_api.base import ApiModel, DnsLabel, Duration, defaults_to, defaults_to_model
from metaroce_api.network import (
    DEFAULT_NCCL_ENV,
    DEVICE_NCCL_ENV,
    MetaRoceNetwork,
    NcclVariable,
    NicSelector,
    PodNetworkSpec,
    ProbeSpec,
    QosSpec,
    TransportSpec,
)


class AgentConfig(ApiModel):
    """Per-network agent configuration (ConfigMap key `constants.AGENT_CONFIG_KEY`)."""

    network: DnsLabel
    generation: Annotated[int, Field(ge=0)]
    """`.metadata.generation` of the network this was rendered from."""
    resource_name: Annotated[str, Field(min_length=3, max_length=253)]
    pods_per_device: Annotated[int, Field(ge=1)] = 1
    device_env: Annotated[list[NcclVariable], Field(max_length=16)] = defaults_to(
        [v for v in DEFAULT_NCCL_ENV if v in DEVICE_NCCL_ENV]
    )
    """The per-device NCCL variables of `attachment.ncclEnv` (NCCL_IB_HCA,
    NCCL_IB_GID_INDEX), which the device plugin's Allocate sets. Only these: the pod
    webhook sets the network-wide ones, and changing those must not roll the agents."""
    cleanup_on_delete: bool = False
    nics: NicSelector
    transport: TransportSpec = defaults_to_model(TransportSpec)
    qos: QosSpec = defaults_to_model(QosSpec)
    probe: ProbeSpec = defaults_to_model(ProbeSpec)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    drift_interval: Duration = "5m"
    pod_network: PodNetworkSpec | None = None
    """transport metaroce, `attachment.podNetwork`: with macvlan/ipvlan the agent writes
    the node's CNI configuration of the network's NetworkAttachmentDefinition."""

    @classmethod
    def from_network(cls, network: MetaRoceNetwork) -> "AgentConfig":
        """Render the agent config of `network`."""
        spec = network.spec
        return cls(
            network=network.metadata.name,
            generation=network.metadata.generation or 0,
            resource_name=network.resource_name,
            pods_per_device=spec.attachment.pods_per_device,
            device_env=[v for v in spec.attachment.nccl_env if v in DEVICE_NCCL_ENV],
            cleanup_on_delete=spec.cleanup_on_delete,
            nics=spec.nics,
            transport=spec.transport,
            qos=spec.qos,
            probe=spec.health.probe,
            log_level=spec.agent.log_level,
            drift_interval=spec.agent.drift_interval,
            pod_network=spec.attachment.pod_network,
        )

    def to_yaml(self) -> str:
        """Stable YAML (the ConfigMap's content, hashed to roll the agents on change)."""
        data: dict[str, Any] = self.to_api()
        return yaml.safe_dump(data, sort_keys=True)

    @classmethod
    def from_yaml(cls, text: str) -> "AgentConfig":
        return cls.model_validate(yaml.safe_load(text))
