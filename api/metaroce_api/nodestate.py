"""`MetaRoceNodeState`: what one node's agent reports for one network.

One object per (network, node), cluster-scoped, named `<network>.<node>` and labelled with
both, written only by that node's agent. The operator reads them to build the network's
status and to decide taints; people read them to see why a node is not configured.
A report object (like NFD's NodeFeature), its CRD has no status subresource: the agent's
first report is one create carrying spec and status, later ones merge-patch `status`.
"""

import hashlib
from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from metaroce_api.base import (
    ApiModel,
    Case,
    DnsLabel,
    Fraction,
    ListType,
    NodeName,
    Rule,
    ShortText,
    StatusModel,
)
from metaroce_api.common import Conditions, ObjectMeta
from metaroce_api.constants import (
    API_VERSION,
    MAX_OBJECT_NAME_LENGTH,
    NETWORK_LABEL,
    NODE_LABEL,
    NODESTATE_KIND,
)

Name64 = Annotated[str, Field(max_length=64)]
NodeStatePhase = Literal[
    "Pending", "Applying", "Ready", "Degraded", "Failed", "Reverting", "Reverted"
]


class NodeStateSpec(ApiModel):
    """Which network and node the report is about; set once by the agent."""

    network: DnsLabel
    node: NodeName

    cel_rules = (
        Rule(
            name="nodestate-spec-immutable",
            cel="self == oldSelf",
            message=(
                "a NodeState always reports on the same network and node: create another "
                "NodeState instead of changing spec"
            ),
            check_update=lambda new, old: new == old,
            kind=NODESTATE_KIND,
            rejects=Case({"spec": {"node": "node-b"}}, field="spec"),
            accepts=Case({"spec": {"node": "node-a"}, "metadata": {"labels": {"x": "y"}}}),
        ),
    )


class Device(StatusModel):
    """One NIC of the network on this node, as discovered (pyverbs joined with sysfs)."""

    netdev: Annotated[str, Field(min_length=1, max_length=15)]
    rdma_device: Name64 | None = None
    """RDMA device on the netdev (e.g. `mlx5_0`, `rxe0`); unset = none yet."""
    rdma_kind: Literal["hardware", "softroce", "none"] = "none"
    pci_address: Annotated[str, Field(max_length=16)] | None = None
    vendor_id: Annotated[str, Field(max_length=6)] | None = None
    device_id: Annotated[str, Field(max_length=6)] | None = None
    driver: Name64 | None = None
    numa_node: int | None = None
    link_speed_mbps: Annotated[int, Field(ge=0)] | None = None
    mtu: Annotated[int, Field(ge=0)] | None = None
    """Netdev MTU."""
    active_mtu: Annotated[int, Field(ge=0)] | None = None
    """RDMA port active MTU (256..4096)."""
    port_state: Annotated[str, Field(max_length=32)] | None = None
    """RDMA port state, e.g. ACTIVE, DOWN."""
    gid_index: Annotated[int, Field(ge=0)] | None = None
    """GID index in use (RoCE v2)."""
    gid: Annotated[str, Field(max_length=64)] | None = None


class AppliedKnob(StatusModel):
    """A QoS or transport knob the agent set and read back."""

    name: Name64
    """e.g. `pfc`, `dscp-map`, `ets`, `ecn`, `roce-tos`, `roce-mode`, `mtu`."""
    device: Name64 = ""
    """Netdev or RDMA device; empty = node-wide."""
    value: Annotated[str, Field(max_length=256)] = ""
    method: Name64 | None = None
    """How it was set, e.g. `dcb`, `sysfs`, `configfs`, `tc`, `netlink`."""


class SkippedKnob(StatusModel):
    """A knob the spec asks for that this node cannot set (qos.onUnsupported: skip)."""

    name: Name64
    device: Name64 = ""
    reason: ShortText
    """Why, e.g. `driver rxe has no DCB`."""


class QosReport(StatusModel):
    """The QoS knobs applied and skipped on the node."""

    applied: Annotated[list[AppliedKnob], Field(max_length=128), ListType("atomic")] | None = None
    skipped: Annotated[list[SkippedKnob], Field(max_length=128), ListType("atomic")] | None = None


class TransportLibrary(StatusModel):
    """The transport library the node hands to pods (metaroce)."""

    directory: Annotated[str, Field(max_length=253)]
    """The versioned, read-only host directory pods mount."""
    version: Annotated[str, Field(max_length=64)]
    checksum: Annotated[str, Field(max_length=64)]
    """sha256 of the directory's SHA256SUMS (every file's name and content)."""


class TransportState(StatusModel):
    """The transport the node runs for this network."""

    mode: Literal["rocev2", "softroce", "metaroce", "none"] = "none"
    ready: bool = False
    devices: Annotated[list[Name64], Field(max_length=32), ListType("atomic")] | None = None
    """Devices the device plugin advertises: RDMA devices, or netdevs for metaroce."""
    message: ShortText = ""
    library: TransportLibrary | None = None


class ProbePeer(StatusModel):
    """The last probe result against one peer node."""

    node: NodeName
    reachable: bool
    latency_p50_microseconds: Annotated[float, Field(ge=0)] | None = None
    latency_p99_microseconds: Annotated[float, Field(ge=0)] | None = None
    loss_fraction: Fraction | None = None
    latency_samples: Annotated[int, Field(ge=0)] | None = None
    """RTTs behind the latency verdict (kept across rounds; the p99 is stated and judged
    from 1000); with several rails, the fewest of any rail."""
    loss_datagrams: Annotated[int, Field(ge=0)] | None = None
    """UD datagrams behind the loss verdict (kept across rounds; the fraction is stated
    from 2000); with several rails, the fewest of any rail."""
    message: ShortText = ""


class ProbeSummary(StatusModel):
    """RDMA probe results of this node (see spec.health.probe)."""

    healthy: bool | None = None
    """Whether the node passes the network's thresholds; unset = not judged yet."""
    last_run_time: datetime | None = None
    peers: Annotated[list[ProbePeer], Field(max_length=64), ListType("atomic")] | None = None


class AgentError(StatusModel):
    """An error the agent hit, with the step it was on."""

    step: Annotated[str, Field(max_length=128)]
    """e.g. `apply pfc on ens1f0`, `discover`, `transport softroce`."""
    message: Annotated[str, Field(max_length=4096)]
    time: datetime | None = None


class MetaRoceNodeStateStatus(StatusModel):
    """The agent's report."""

    phase: NodeStatePhase = "Pending"
    config_generation: Annotated[int, Field(ge=0)] | None = None
    """The network `.metadata.generation` the agent last acted on."""
    agent_version: Annotated[str, Field(max_length=64)] | None = None
    inventory: Annotated[list[Device], Field(max_length=64), ListType("atomic")] | None = None
    qos: QosReport | None = None
    transport: TransportState | None = None
    probe: ProbeSummary | None = None
    errors: Annotated[list[AgentError], Field(max_length=16), ListType("atomic")] | None = None
    """The latest errors (at most 16), newest last."""
    drift_corrections: Annotated[int, Field(ge=0)] = 0
    """How many times the agent re-applied a knob someone changed."""
    last_applied_time: datetime | None = None
    reverted: bool = False
    """True once the agent undid its settings because the network was deleted with
    cleanupOnDelete; the operator then drops the network's finalizer."""
    conditions: Conditions | None = None


class MetaRoceNodeState(ApiModel):
    """A MetaRoceNodeState object (cluster-scoped)."""

    api_version: Literal["metaroce.io/v1alpha1"] = API_VERSION
    kind: Literal["MetaRoceNodeState"] = NODESTATE_KIND
    metadata: ObjectMeta
    spec: NodeStateSpec
    status: MetaRoceNodeStateStatus | None = None


def _fit(text: str, limit: int) -> str:
    """`text`, or a prefix plus a hash of it when it is longer than `limit`."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{text[: limit - 11].rstrip('.-')}-{digest}"


def nodestate_name(network: str, node: str) -> str:
    """Object name of the NodeState of (network, node): `<network>.<node>`, made to fit."""
    return _fit(f"{network}.{node}", MAX_OBJECT_NAME_LENGTH)


def nodestate_labels(network: str, node: str) -> dict[str, str]:
    """Labels of a NodeState, so `-l metaroce.io/network=<name>` finds a network's nodes."""
    return {NETWORK_LABEL: network, NODE_LABEL: _fit(node, 63)}
