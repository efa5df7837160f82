"""`MetaRoceNetwork`: one RDMA network, as the platform team describes it (spec) and as the
operator reports it (status).

Defaults follow common practice: classic RoCEv2 runs the `lossless` profile (trust DSCP,
data DSCP 26 on priority 3 with PFC on 3, CNPs DSCP 48 on priority 6, ECN for DCQCN);
MetaRoCE-style transports run `lossy` (no PFC, ECN on).
"""

from ipaddress import IPv4Network, ip_network
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from metaroce_api.base import (
    RESOURCE_NAME_RE,
    ApiModel,
    Case,
    Dscp,
    Duration,
    Fraction,
    ListType,
    NodeName,
    Priority,
    Quantity,
    Rule,
    ShortText,
    StatusModel,
    defaults_to,
    defaults_to_model,
    parse_duration,
)
from metaroce_api.common import Conditions, LabelSelector, NetworkMeta, Toleration
from metaroce_api.constants import API_VERSION, NETWORK_KIND, RESOURCE_NAME_TEMPLATE

TransportMode = Literal["auto", "rocev2", "softroce", "metaroce"]
ActiveTransport = Literal["rocev2", "softroce", "metaroce", "mixed", "none"]
QosProfile = Literal["lossless", "lossy", "custom"]
NcclVariable = Literal[
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_TC",
    "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
    "NCCL_SOCKET_IFNAME",
]
DEFAULT_NCCL_ENV: list[NcclVariable] = [
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_TC",
    "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
]
"""Everything the network determines; NCCL_SOCKET_IFNAME needs `socketInterface`."""
DEVICE_NCCL_ENV: tuple[NcclVariable, ...] = ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX")
"""The ones that depend on the devices a container gets: set by the device plugin."""

Glob = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[-A-Za-z0-9_.:*?\[\]!]+$")]
PciId = Annotated[str, Field(min_length=4, max_length=6, pattern=r"^(0x)?[0-9a-fA-F]{4}$")]
DriverName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
InterfaceName = Annotated[str, Field(min_length=1, max_length=15, pattern=r"^[^\s/:]+$")]


def _spec(**spec: Any) -> dict[str, Any]:
    """A Case patch on the spec (keeps the rule tables short)."""
    return {"spec": spec}


# --- nics ----------------------------------------------------------------------------------


class NicSelector(ApiModel):
    """Which NICs of a node belong to the network.

    A NIC must match one entry of every list that is set (OR inside a list, AND across
    lists). At least one list must be set: a network never takes every NIC of a node.
    """

    interface_names: (
        Annotated[list[Glob], Field(min_length=1, max_length=32), ListType("set")] | None
    ) = None
    """Netdev name globs, e.g. `ens1f*`."""
    pci_vendor_ids: (
        Annotated[list[PciId], Field(min_length=1, max_length=16), ListType("set")] | None
    ) = None
    """PCI vendor ids as in sysfs, e.g. `0x15b3` (NVIDIA/Mellanox)."""
    pci_device_ids: (
        Annotated[list[PciId], Field(min_length=1, max_length=32), ListType("set")] | None
    ) = None
    """PCI device ids, e.g. `0x101d` (ConnectX-6 Dx)."""
    drivers: (
        Annotated[list[DriverName], Field(min_length=1, max_length=16), ListType("set")] | None
    ) = None
    """Kernel drivers of the netdev, e.g. `mlx5_core`, `virtio_net`."""
    rdma_devices: (
        Annotated[list[Glob], Field(min_length=1, max_length=32), ListType("set")] | None
    ) = None
    """RDMA device name globs, e.g. `mlx5_*`, `rxe*`."""
    allow_primary_interface: bool = False
    """Let the agent configure a selected NIC that carries the node's default route
    (IPv4 or IPv6) or its Kubernetes InternalIP. Off: such a NIC fails the node with an
    error naming it, since a wrong MTU or PFC class there can cut the node off."""

    cel_rules = (
        Rule(
            name="nics-select-something",
            cel=(
                "has(self.interfaceNames) || has(self.pciVendorIds) || has(self.pciDeviceIds)"
                " || has(self.drivers) || has(self.rdmaDevices)"
            ),
            message=(
                "nics selects no NIC: set at least one of interfaceNames, pciVendorIds, "
                "pciDeviceIds, drivers, rdmaDevices"
            ),
            check=lambda s: any(
                (s.interface_names, s.pci_vendor_ids, s.pci_device_ids, s.drivers, s.rdma_devices)
            ),
            rejects=Case(_spec(nics={"interfaceNames": None}), field="spec.nics"),
            accepts=Case(_spec(nics={"interfaceNames": None, "drivers": ["mlx5_core"]})),
        ),
    )


# --- transport -------------------------------------------------------------------------------


class RoceSettings(ApiModel):
    """RoCE addressing, for the `rocev2` and `softroce` transports."""

    version: Literal[1, 2] = 2
    """RoCE version (rdma_cm `default_roce_mode`); v1 is not routable."""
    gid_index: Annotated[int, Field(ge=0, le=255)] | None = None
    """Pin a GID index; unset = the first RoCE v2 GID of `addressFamily` on each port."""
    address_family: Literal["ipv4", "ipv6"] = "ipv4"
    """Which GIDs to use when `gidIndex` is unset."""


METAROCE_IPV4_OVERHEAD = 84
"""Bytes of a MetaRoCE DATA datagram besides its payload over IPv4: IP + UDP (28) and the
transport's headers and CRC (56; `transport/crates/metaroce-core/src/wire.rs`)."""
METAROCE_DEFAULT_MTU = 1500
"""The datagram size the transport uses when it is not told (`Config::default().mtu`)."""


class PortRange(ApiModel):
    """An inclusive range of UDP ports."""

    first: Annotated[int, Field(ge=1024, le=65535)]
    last: Annotated[int, Field(ge=1024, le=65535)]

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    cel_rules = (
        Rule(
            name="port-range-ordered",
            cel="self.first <= self.last",
            field=".last",
            message="the port range ends before it starts: set last >= first",
            check=lambda s: s.first <= s.last,
            rejects=Case(
                _spec(
                    transport={
                        "mode": "metaroce",
                        "metaroce": {"portRange": {"first": 21000, "last": 20000}},
                    },
                    qos={"profile": "lossy"},
                ),
                field="spec.transport.metaroce.portRange.last",
            ),
            accepts=Case(
                _spec(
                    transport={
                        "mode": "metaroce",
                        "metaroce": {"portRange": {"first": 21000, "last": 21999}},
                    },
                    qos={"profile": "lossy"},
                )
            ),
        ),
    )


class MetaRoceCongestion(ApiModel):
    """Congestion control of the MetaRoCE transport (per-path AIMD on loss, CE marks and
    queueing delay). The defaults are the transport's own."""

    queue_target_micros: Annotated[int, Field(ge=10, le=100_000)] = 500
    """Queueing delay a path may build over its minimum RTT before its window comes down
    (`queue_target_us`; the transport's default is 500)."""
    min_rto_micros: Annotated[int, Field(ge=100, le=1_000_000)] = 5000
    """Least retransmission timeout (`min_rto_us`; 5000 = 5 ms, the transport's default;
    the largest is 1 s)."""
    rate_hint_mbps: Annotated[int, Field(ge=0, le=1_600_000)] = 0
    """A receiver's capacity in Mbit/s, shared among its senders as a rate hint
    (`rate_mbps`); 0 = no hint (the transport's default)."""


class MetaRoceSettings(ApiModel):
    """The MetaRoCE transport's settings, handed to every pod of the network (MR_CONFIG)."""

    port_range: PortRange = defaults_to_model(lambda: PortRange(first=20000, last=23999))
    """UDP ports the transport binds: every endpoint takes `paths` ports of it, so every
    process of a pod (and every endpoint of a process) has its own; the node marks this
    range with the network's DSCP where the NIC has no DCB. Keep it outside the kernel's
    ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999 by default)."""
    paths: Annotated[int, Field(ge=1, le=16)] = 16
    """Paths (UDP source ports) each connection sprays its packets over (16, the
    transport's default and most)."""
    mss: Annotated[int, Field(ge=492, le=9132)] | None = None
    """Payload bytes per packet; unset = what the MTU allows (transport.mtu, else 1500,
    less 84 bytes of IPv4, UDP and transport headers: 1416 at MTU 1500)."""
    congestion: MetaRoceCongestion = defaults_to_model(MetaRoceCongestion)

    def datagram_size(self, mtu: int | None) -> int:
        """The transport's `mtu=`: the largest datagram, IP header included."""
        if self.mss is not None:
            return self.mss + METAROCE_IPV4_OVERHEAD
        return mtu or METAROCE_DEFAULT_MTU

    cel_rules = (
        Rule(
            name="metaroce-ports-fit-paths",
            cel="self.portRange.last - self.portRange.first + 1 >= self.paths",
            field=".portRange",
            message=(
                "portRange holds fewer ports than one endpoint needs (one per path): widen "
                "portRange or lower paths"
            ),
            check=lambda s: s.port_range.size >= s.paths,
            rejects=Case(
                _spec(
                    transport={
                        "mode": "metaroce",
                        "metaroce": {"portRange": {"first": 20000, "last": 20003}, "paths": 8},
                    },
                    qos={"profile": "lossy"},
                ),
                field="spec.transport.metaroce.portRange",
            ),
            accepts=Case(
                _spec(
                    transport={
                        "mode": "metaroce",
                        "metaroce": {"portRange": {"first": 20000, "last": 20003}, "paths": 4},
                    },
                    qos={"profile": "lossy"},
                )
            ),
        ),
    )


class TransportSpec(ApiModel):
    """The RDMA transport the nodes run."""

    mode: TransportMode = "auto"
    """`auto` uses hardware RoCEv2 where a node has it; `rocev2` requires hardware;
    `softroce` creates rdma_rxe devices on the selected netdevs; `metaroce` runs the
    MetaRoCE transport (no PFC, multipath spraying, selective retransmit)."""
    mtu: Annotated[int, Field(ge=1280, le=9216)] | None = None
    """Netdev MTU to set on the selected interfaces; unset = leave it. The RoCE path MTU
    becomes the largest of 1024/2048/4096 that fits (4096 needs >= 4200)."""
    roce: RoceSettings = defaults_to_model(RoceSettings)
    qps_per_connection: Annotated[int, Field(ge=1, le=128)] = 1
    """Queue pairs per connection (NCCL_IB_QPS_PER_CONNECTION): more QPs give ECMP more
    entropy on classic RoCEv2; MetaRoCE sprays within one connection."""
    ack_timeout: Annotated[int, Field(ge=1, le=31)] = 20
    """Local ACK timeout exponent: 4.096 us x 2^n (NCCL_IB_TIMEOUT; 20 is about 4 s)."""
    retry_count: Annotated[int, Field(ge=0, le=7)] = 7
    """Transport retries before a QP fails (NCCL_IB_RETRY_CNT)."""
    allow_soft_roce_fallback: bool = False
    """With mode `auto`: a node without hardware RoCE gets SoftRoCE instead of failing."""
    metaroce: MetaRoceSettings | None = None
    """Settings of the MetaRoCE transport (mode `metaroce` only); unset = its defaults.
    `auto` never picks MetaRoCE: the jobs must load its library, so it is chosen by name."""

    def effective_metaroce(self) -> MetaRoceSettings:
        """`metaroce`, after its defaults."""
        return self.metaroce or MetaRoceSettings()

    cel_rules = (
        Rule(
            name="metaroce-settings-need-metaroce",
            cel="!has(self.metaroce) || self.mode == 'metaroce'",
            field=".metaroce",
            message=(
                "transport.metaroce applies only to mode metaroce (auto never picks it): "
                "remove transport.metaroce, or set mode: metaroce"
            ),
            check=lambda s: s.metaroce is None or s.mode == "metaroce",
            rejects=Case(
                _spec(transport={"mode": "softroce", "metaroce": {"paths": 4}}),
                field="spec.transport.metaroce",
            ),
            accepts=Case(
                _spec(
                    transport={"mode": "metaroce", "metaroce": {"paths": 4}},
                    qos={"profile": "lossy"},
                )
            ),
        ),
        Rule(
            name="metaroce-mss-fits-mtu",
            cel=(
                "self.mode != 'metaroce' || !has(self.metaroce) || !has(self.metaroce.mss)"
                " || self.metaroce.mss + 84 <= (has(self.mtu) ? self.mtu : 1500)"
            ),
            field=".metaroce.mss",
            message=(
                "metaroce.mss plus 84 bytes of IPv4, UDP and transport headers exceeds the "
                "MTU (transport.mtu, 1500 when unset): lower mss, raise transport.mtu, or "
                "unset mss to use what the MTU allows"
            ),
            check=lambda s: (
                s.mode != "metaroce"
                or s.metaroce is None
                or s.metaroce.mss is None
                or s.metaroce.mss + METAROCE_IPV4_OVERHEAD <= (s.mtu or METAROCE_DEFAULT_MTU)
            ),
            rejects=Case(
                _spec(
                    transport={"mode": "metaroce", "metaroce": {"mss": 1450}},
                    qos={"profile": "lossy"},
                ),
                field="spec.transport.metaroce.mss",
            ),
            accepts=Case(
                _spec(
                    transport={"mode": "metaroce", "mtu": 9000, "metaroce": {"mss": 8916}},
                    qos={"profile": "lossy"},
                )
            ),
        ),
        Rule(
            name="softroce-fallback-needs-auto",
            cel="!self.allowSoftRoceFallback || self.mode == 'auto'",
            field=".allowSoftRoceFallback",
            message="allowSoftRoceFallback applies only to mode auto: remove it or set mode: auto",
            check=lambda s: not s.allow_soft_roce_fallback or s.mode == "auto",
            rejects=Case(
                _spec(transport={"mode": "rocev2", "allowSoftRoceFallback": True}),
                field="spec.transport.allowSoftRoceFallback",
            ),
            accepts=Case(_spec(transport={"mode": "auto", "allowSoftRoceFallback": True})),
        ),
        Rule(
            name="softroce-is-roce-v2",
            cel="self.mode != 'softroce' || self.roce.version == 2",
            field=".roce.version",
            message="SoftRoCE (rdma_rxe) speaks RoCE v2 only: set roce.version: 2",
            check=lambda s: s.mode != "softroce" or s.roce.version == 2,
            rejects=Case(
                _spec(transport={"mode": "softroce", "roce": {"version": 1}}),
                field="spec.transport.roce.version",
            ),
            accepts=Case(_spec(transport={"mode": "rocev2", "roce": {"version": 1}})),
        ),
    )


# --- qos ---------------------------------------------------------------------------------------


class DataMarking(ApiModel):
    """How RDMA data packets are marked."""

    dscp: Dscp = 26
    """DSCP of RoCE data (26 by common convention; rdma_cm `default_roce_tos` = dscp << 2)."""
    priority: Priority = 3
    """802.1p priority the DSCP maps to (3 by common convention)."""


class CnpMarking(ApiModel):
    """How congestion notification packets (DCQCN CNPs) are marked."""

    dscp: Dscp = 48
    """DSCP of CNPs (48 by common convention)."""
    priority: Priority = 6
    """802.1p priority of CNPs (6 by common convention)."""


class EtsShare(ApiModel):
    """The minimum bandwidth share of one priority (each priority in its own class)."""

    priority: Priority
    bandwidth_percent: Annotated[int, Field(ge=1, le=100)]


class QosSpec(ApiModel):
    """Node QoS for RDMA traffic."""

    profile: QosProfile = "lossless"
    """`lossless` (classic RoCEv2): trust DSCP, PFC on the data priority, ECN for DCQCN.
    `lossy` (MetaRoCE-style): no PFC, ECN on. `custom`: only what is written here."""
    data: DataMarking = defaults_to_model(DataMarking)
    cnp: CnpMarking = defaults_to_model(CnpMarking)
    pfc_priorities: Annotated[list[Priority], Field(max_length=8), ListType("set")] | None = None
    """Priorities with PFC. Unset = what the profile implies (lossless: the data priority;
    lossy and custom: none). Only the data priority may have PFC."""
    ets: (
        Annotated[list[EtsShare], Field(min_length=1, max_length=8), ListType("map", ("priority",))]
        | None
    ) = None
    """ETS bandwidth shares, summing to 100; unset = leave the NIC's ETS as it is."""
    ecn: bool = True
    """ECN marking and reaction (DCQCN on RoCEv2 NICs); both profiles need it."""
    on_unsupported: Literal["error", "skip"] = "skip"
    """A knob the NIC or driver lacks (e.g. PFC on SoftRoCE): `skip` reports it in the
    NodeState and goes on; `error` fails the node."""

    def effective_pfc_priorities(self) -> list[int]:
        """PFC priorities after the profile's default."""
        if self.pfc_priorities is not None:
            return sorted(self.pfc_priorities)
        return [self.data.priority] if self.profile == "lossless" else []

    cel_rules = (
        Rule(
            name="lossy-has-no-pfc",
            cel=(
                "self.profile != 'lossy' || !has(self.pfcPriorities)"
                " || size(self.pfcPriorities) == 0"
            ),
            field=".pfcPriorities",
            message=(
                "profile lossy runs without PFC: remove pfcPriorities, or use profile "
                "lossless (PFC on the data priority)"
            ),
            check=lambda s: s.profile != "lossy" or not s.pfc_priorities,
            rejects=Case(
                _spec(qos={"profile": "lossy", "pfcPriorities": [3]}),
                field="spec.qos.pfcPriorities",
            ),
            accepts=Case(_spec(qos={"profile": "lossy", "pfcPriorities": []})),
        ),
        Rule(
            name="pfc-only-on-data-priority",
            cel="!has(self.pfcPriorities) || self.pfcPriorities.all(p, p == self.data.priority)",
            field=".pfcPriorities",
            message=(
                "PFC may be enabled only on the RDMA data priority (qos.data.priority): "
                "remove the other priorities from pfcPriorities"
            ),
            check=lambda s: all(p == s.data.priority for p in s.pfc_priorities or ()),
            rejects=Case(
                _spec(qos={"profile": "custom", "pfcPriorities": [3, 4]}),
                field="spec.qos.pfcPriorities",
            ),
            accepts=Case(_spec(qos={"profile": "custom", "pfcPriorities": [3]})),
        ),
        Rule(
            name="lossless-needs-pfc",
            cel=(
                "self.profile != 'lossless' || !has(self.pfcPriorities)"
                " || self.data.priority in self.pfcPriorities"
            ),
            field=".pfcPriorities",
            message=(
                "profile lossless needs PFC on the data priority: add qos.data.priority to "
                "pfcPriorities (or remove pfcPriorities), or use profile lossy"
            ),
            check=lambda s: (
                s.profile != "lossless"
                or s.pfc_priorities is None
                or s.data.priority in s.pfc_priorities
            ),
            rejects=Case(
                _spec(qos={"profile": "lossless", "pfcPriorities": []}),
                field="spec.qos.pfcPriorities",
            ),
            accepts=Case(
                _spec(qos={"profile": "lossless", "data": {"priority": 5}, "pfcPriorities": [5]})
            ),
        ),
        Rule(
            name="profiles-need-ecn",
            cel="self.profile == 'custom' || self.ecn",
            field=".ecn",
            message=(
                "profiles lossless (DCQCN) and lossy both rely on ECN: set ecn: true, "
                "or use profile custom"
            ),
            check=lambda s: s.profile == "custom" or s.ecn,
            rejects=Case(_spec(qos={"profile": "lossy", "ecn": False}), field="spec.qos.ecn"),
            accepts=Case(_spec(qos={"profile": "custom", "ecn": False})),
        ),
        Rule(
            name="cnp-dscp-differs-from-data",
            cel="self.cnp.dscp != self.data.dscp",
            field=".cnp.dscp",
            message=(
                "CNPs must not share the data DSCP (they would queue behind the traffic "
                "they throttle): pick another cnp.dscp (48 by convention)"
            ),
            check=lambda s: s.cnp.dscp != s.data.dscp,
            rejects=Case(_spec(qos={"cnp": {"dscp": 26}}), field="spec.qos.cnp.dscp"),
            accepts=Case(_spec(qos={"cnp": {"dscp": 46}})),
        ),
        Rule(
            name="ets-sums-to-100",
            cel="!has(self.ets) || self.ets.map(e, e.bandwidthPercent).sum() == 100",
            field=".ets",
            message="ETS bandwidth shares must add up to 100: fix bandwidthPercent values",
            check=lambda s: s.ets is None or sum(e.bandwidth_percent for e in s.ets) == 100,
            rejects=Case(
                _spec(qos={"ets": [{"priority": 3, "bandwidthPercent": 60}]}),
                field="spec.qos.ets",
            ),
            accepts=Case(
                _spec(
                    qos={
                        "ets": [
                            {"priority": 3, "bandwidthPercent": 60},
                            {"priority": 0, "bandwidthPercent": 40},
                        ]
                    }
                )
            ),
        ),
    )


# --- attachment, health, agent ---------------------------------------------------------------


PodNetworkMode = Literal["macvlan", "ipvlan", "hostNetwork"]
PodInterfaceName = Annotated[str, Field(min_length=1, max_length=15, pattern=r"^[a-z][a-z0-9]*$")]
Ipv4Cidr = Annotated[
    str, Field(min_length=9, max_length=18, pattern=r"^[0-9]+(\.[0-9]+){3}/[0-9]+$")
]
"""An IPv4 network in CIDR notation (`10.56.0.0/16`); the CEL rules check the numbers."""


def _ipv4_network(text: str) -> IPv4Network | None:
    """`text` as an IPv4 network without host bits, or None (as CEL's isCIDR/masked)."""
    try:
        net = ip_network(text, strict=True)
    except ValueError:
        return None
    return net if isinstance(net, IPv4Network) else None


class PodNetworkSpec(ApiModel):
    """How a metaroce network's pods reach the selected netdev from their own network
    namespace (the transport's UDP sockets belong to a network namespace).

    `macvlan` / `ipvlan`: a secondary interface `interface` on the node's selected netdev,
    made by Multus from the NetworkAttachmentDefinition the operator renders per network
    (the webhook adds the pod's `k8s.v1.cni.cncf.io/networks` entry). Addresses come from
    `subnet`, which the operator splits into one block of `/nodePrefixLength` per node
    (stable while the node stays in the network), so pods on different nodes never
    collide. `hostNetwork`: no secondary interface; pods that run with `hostNetwork: true`
    use the netdev itself. Needs Multus (thin plugin, v4) in the cluster."""

    mode: PodNetworkMode = "macvlan"
    """`macvlan` (default: its own MAC per pod, bridge mode), `ipvlan` (L2, the netdev's
    MAC: for NICs or switches that allow one MAC per port) or `hostNetwork`."""
    subnet: Ipv4Cidr | None = None
    """The pods' addresses on the data network (macvlan/ipvlan), e.g. `10.56.0.0/16`. Must
    not overlap the nodes' or the cluster's pod and service networks."""
    node_prefix_length: Annotated[int, Field(ge=8, le=30)] = 24
    """The size of each node's block of `subnet` (`/24`: 254 pod addresses per node)."""
    interface: PodInterfaceName = "mr0"
    """The interface name inside the pod; the webhook points the transport at it
    (`FI_METAROCE_IFACE`, `MR_NCCL_IFNAME`)."""

    @property
    def secondary(self) -> bool:
        """Whether pods get a secondary interface (macvlan/ipvlan)."""
        return self.mode != "hostNetwork"

    @property
    def network(self) -> IPv4Network | None:
        return _ipv4_network(self.subnet) if self.subnet else None

    @property
    def block_count(self) -> int:
        """How many nodes `subnet` has blocks for (0 without a usable subnet)."""
        net = self.network
        if net is None or self.node_prefix_length < net.prefixlen:
            return 0
        return 1 << (self.node_prefix_length - net.prefixlen)

    cel_rules = (
        Rule(
            name="pod-network-needs-subnet",
            cel="self.mode == 'hostNetwork' || has(self.subnet)",
            field=".subnet",
            message=(
                "podNetwork.mode macvlan/ipvlan gives pods addresses from subnet, which is "
                "unset: set subnet (e.g. 10.56.0.0/16), or mode: hostNetwork"
            ),
            check=lambda s: s.mode == "hostNetwork" or s.subnet is not None,
            rejects=Case(
                _spec(
                    transport={"mode": "metaroce"},
                    qos={"profile": "lossy"},
                    attachment={"podNetwork": {"mode": "macvlan"}},
                ),
                field="spec.attachment.podNetwork.subnet",
            ),
            accepts=Case(
                _spec(
                    transport={"mode": "metaroce"},
                    qos={"profile": "lossy"},
                    attachment={"podNetwork": {"mode": "hostNetwork"}},
                )
            ),
        ),
        Rule(
            name="pod-network-subnet-cidr",
            cel=(
                "!has(self.subnet) || (isCIDR(self.subnet) && cidr(self.subnet).ip().family() "
                "== 4 && cidr(self.subnet) == cidr(self.subnet).masked())"
            ),
            field=".subnet",
            message=(
                "podNetwork.subnet is not an IPv4 network in CIDR notation without host bits: "
                "write it like 10.56.0.0/16 (the address ending in zeros for its prefix)"
            ),
            check=lambda s: s.subnet is None or s.network is not None,
            rejects=Case(
                _spec(
                    transport={"mode": "metaroce"},
                    qos={"profile": "lossy"},
                    attachment={"podNetwork": {"subnet": "10.56.1.0/16"}},
                ),
                field="spec.attachment.podNetwork.subnet",
            ),
            accepts=Case(
                _spec(
                    transport={"mode": "metaroce"},
                    qos={"profile": "lossy"},
                    attachment={"podNetwork": {"subnet": "10.56.0.0/16"}},
                )
            ),
        ),
        Rule(
            name="pod-network-block-fits-subnet",
            cel=(
                "!has(self.subnet) || !isCIDR(self.subnet) || "
                "cidr(self.subnet).prefixLength() <= self.nodePrefixLength"
            ),
            field=".nodePrefixLength",
            message=(
                "podNetwork.nodePrefixLength is shorter than subnet's prefix, so no node "
                "block fits in subnet: set nodePrefixLength to at least subnet's prefix "
                "length (e.g. 24 for a /16), or widen subnet"
            ),
            check=lambda s: s.network is None or s.node_prefix_length >= s.network.prefixlen,
            rejects=Case(
                _spec(
                    transport={"mode": "metaroce"},
                    qos={"profile": "lossy"},
                    attachment={"podNetwork": {"subnet": "10.56.0.0/24", "nodePrefixLength": 16}},
                ),
                field="spec.attachment.podNetwork.nodePrefixLength",
            ),
            accepts=Case(
                _spec(
                    transport={"mode": "metaroce"},
                    qos={"profile": "lossy"},
                    attachment={"podNetwork": {"subnet": "10.56.0.0/24", "nodePrefixLength": 24}},
                )
            ),
        ),
    )


class AttachmentSpec(ApiModel):
    """How pods attach to the network."""

    resource_name: (
        Annotated[str, Field(min_length=3, max_length=253, pattern=RESOURCE_NAME_RE)] | None
    ) = None
    """Extended resource pods request; unset = `metaroce.io/<network>`. Immutable: pods and
    kubelets already use it."""
    pods_per_device: Annotated[int, Field(ge=1, le=1024)] = 1
    """How many pods may share one RDMA device (more than 1 = shared mode)."""
    nccl_env: Annotated[list[NcclVariable], Field(max_length=16), ListType("set")] = defaults_to(
        DEFAULT_NCCL_ENV
    )
    """NCCL variables the webhook injects into pods, computed from this network."""
    socket_interface: InterfaceName | None = None
    """Pod interface for NCCL's bootstrap sockets (NCCL_SOCKET_IFNAME), e.g. `eth0`."""
    pod_network: PodNetworkSpec | None = None
    """transport metaroce: how pods reach the selected netdev (a Multus secondary
    interface, or hostNetwork). Unset: pods use their cluster network interface (`eth0`),
    which reaches the data NIC only through the node's routing, not as its own interface."""

    def effective_resource_name(self, network: str) -> str:
        """The resource name, after the `metaroce.io/<network>` default."""
        return self.resource_name or RESOURCE_NAME_TEMPLATE.format(network=network)

    cel_rules = (
        Rule(
            name="socket-ifname-needs-interface",
            cel="!('NCCL_SOCKET_IFNAME' in self.ncclEnv) || has(self.socketInterface)",
            field=".socketInterface",
            message=(
                "ncclEnv lists NCCL_SOCKET_IFNAME but socketInterface is unset: set "
                "socketInterface (e.g. eth0) or remove NCCL_SOCKET_IFNAME from ncclEnv"
            ),
            check=lambda s: "NCCL_SOCKET_IFNAME" not in s.nccl_env or s.socket_interface,
            rejects=Case(
                _spec(attachment={"ncclEnv": ["NCCL_SOCKET_IFNAME"]}),
                field="spec.attachment.socketInterface",
            ),
            accepts=Case(
                _spec(attachment={"ncclEnv": ["NCCL_SOCKET_IFNAME"], "socketInterface": "eth0"})
            ),
        ),
        Rule(
            name="resource-name-immutable",
            cel=(
                "(has(self.resourceName) ? self.resourceName : '') == "
                "(has(oldSelf.resourceName) ? oldSelf.resourceName : '')"
            ),
            field=".resourceName",
            message=(
                "attachment.resourceName is immutable (pods request it, kubelets advertise "
                "it): keep the old value, or create a new network"
            ),
            check_update=lambda new, old: new.resource_name == old.resource_name,
            rejects=Case(
                _spec(attachment={"resourceName": "example.com/other"}),
                field="spec.attachment.resourceName",
                before=_spec(attachment={"resourceName": "example.com/rdma"}),
            ),
            accepts=Case(
                _spec(attachment={"resourceName": "example.com/rdma", "podsPerDevice": 2}),
                before=_spec(attachment={"resourceName": "example.com/rdma"}),
            ),
        ),
    )


class ProbeSpec(ApiModel):
    """The probe each agent runs to a few peers: RDMA (RC for latency, UD for loss), or
    for transport metaroce UDP from the served netdevs (echoed pings for latency, a
    counted burst for loss)."""

    enabled: bool = True
    peers_per_node: Annotated[int, Field(ge=1, le=64)] = 3
    """How many peers each node probes (chosen so every node is probed by others too)."""
    interval: Duration = "30s"
    """Time between probe rounds (at least 1s)."""
    max_latency_microseconds: Annotated[int, Field(ge=1, le=10_000_000)] = 1000
    """A peer slower than this (p99 round trip) counts as failing."""
    max_loss_fraction: Fraction = 0.01
    """A peer losing more than this fraction of probes counts as failing."""

    cel_rules = (
        Rule(
            name="probe-interval-at-least-1s",
            cel="duration(self.interval) >= duration('1s')",
            field=".interval",
            message="health.probe.interval must be at least 1s: probes cost the fabric bandwidth",
            check=lambda s: parse_duration(s.interval).total_seconds() >= 1,
            rejects=Case(
                _spec(health={"probe": {"interval": "500ms"}}),
                field="spec.health.probe.interval",
            ),
            accepts=Case(_spec(health={"probe": {"interval": "1s"}})),
        ),
    )


class HealthSpec(ApiModel):
    """How node RDMA health is judged and what a failing node gets."""

    probe: ProbeSpec = defaults_to_model(ProbeSpec)
    action: Literal["condition", "taint"] = "condition"
    """`condition`: failing nodes are reported; `taint`: also tainted
    `metaroce.io/rdma-unhealthy:NoSchedule` (capped by `maxTaintedFraction`)."""
    max_tainted_fraction: Fraction = 0.1
    """At most this fraction of the network's nodes is tainted at once, so one bad peer
    cannot taint everyone."""
    ready_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Ready is True when at least this fraction of the desired nodes is configured and
    healthy (rounded up); 1.0: every node. Failing nodes are named in Degraded anyway."""

    cel_rules = (
        Rule(
            name="taint-needs-probe",
            cel="self.action != 'taint' || self.probe.enabled",
            field=".action",
            message=(
                "action taint acts on probe results: enable health.probe or use action: condition"
            ),
            check=lambda s: s.action != "taint" or s.probe.enabled,
            rejects=Case(
                _spec(health={"action": "taint", "probe": {"enabled": False}}),
                field="spec.health.action",
            ),
            accepts=Case(_spec(health={"action": "condition", "probe": {"enabled": False}})),
        ),
    )


class AgentResources(ApiModel):
    """Requests and limits of the agent container."""

    requests: Annotated[dict[str, Quantity], Field(max_length=8)] = defaults_to(
        {"cpu": "50m", "memory": "64Mi"}
    )
    limits: Annotated[dict[str, Quantity], Field(max_length=8)] = defaults_to({"memory": "256Mi"})


def _max_unavailable_ok(value: int | str) -> bool:
    if isinstance(value, int):
        return value >= 1
    digits = value.removesuffix("%")
    return value.endswith("%") and digits.isdigit() and 1 <= int(digits) <= 100


class UpdateStrategy(ApiModel):
    """Rolling update of the agent DaemonSet."""

    max_unavailable: Annotated[int | str, Field(json_schema_extra={"maxLength": 4})] = 1
    """Agents restarted at once: a count (>= 1) or a percentage such as `10%`."""
    paused: bool = False
    """Replace no agent (the DaemonSet's `OnDelete`): a changed spec reaches a node only
    when its agent pod is deleted. Unpause to let the rollout go on."""
    max_hold: Duration = "24h"
    """The longest a node may hold off agent updates with the label
    `metaroce.io/hold-agent-update=<deadline>` (a job running there); a hold further ahead
    is not honoured, and an expired one ends by itself. Between 1m and 168h."""

    cel_rules = (
        Rule(
            name="max-unavailable-count-or-percent",
            cel=(
                "type(self.maxUnavailable) == int ? self.maxUnavailable >= 1 : "
                "self.maxUnavailable.matches('^([1-9][0-9]?|100)%$')"
            ),
            field=".maxUnavailable",
            message=(
                "maxUnavailable is neither a count >= 1 nor a percentage 1%-100%: "
                "write e.g. 1 or 10%"
            ),
            check=lambda s: _max_unavailable_ok(s.max_unavailable),
            rejects=Case(
                _spec(agent={"updateStrategy": {"maxUnavailable": "0%"}}),
                field="spec.agent.updateStrategy.maxUnavailable",
            ),
            accepts=Case(_spec(agent={"updateStrategy": {"maxUnavailable": "25%"}})),
        ),
        Rule(
            name="max-hold-range",
            cel="duration(self.maxHold) >= duration('1m') && duration(self.maxHold) <= "
            "duration('168h')",
            field=".maxHold",
            message=(
                "maxHold must be between 1m and 168h (a week): a node cannot hold off agent "
                "updates for longer; write e.g. 24h"
            ),
            check=lambda s: 60 <= parse_duration(s.max_hold).total_seconds() <= 168 * 3600,
            rejects=Case(
                _spec(agent={"updateStrategy": {"maxHold": "200h"}}),
                field="spec.agent.updateStrategy.maxHold",
            ),
            accepts=Case(_spec(agent={"updateStrategy": {"maxHold": "48h"}})),
        ),
    )


class AgentSpec(ApiModel):
    """The per-node agent DaemonSet."""

    image: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")] | None = None
    """Agent image; unset = the image the chart pins for this operator version."""
    resources: AgentResources = defaults_to_model(AgentResources)
    update_strategy: UpdateStrategy = defaults_to_model(UpdateStrategy)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    drift_interval: Duration = "5m"
    """How often the agent reads every applied knob back and re-applies what changed."""
    metrics_port: Annotated[int, Field(ge=1024, le=65535)] = 9478
    """Host port of the agent's /metrics (the agents use the host network): two networks on
    one node need different ports."""
    probe_port: Annotated[int, Field(ge=1024, le=65535)] = 47911
    """Host port of the agent's RDMA probe endpoint (TCP); per network, like metricsPort."""

    cel_rules = (
        Rule(
            name="agent-ports-differ",
            cel="self.metricsPort != self.probePort",
            field=".probePort",
            message="agent.probePort must differ from agent.metricsPort: both are host ports "
            "of the same agent",
            check=lambda s: s.metrics_port != s.probe_port,
            rejects=Case(
                _spec(agent={"metricsPort": 9478, "probePort": 9478}),
                field="spec.agent.probePort",
            ),
            accepts=Case(_spec(agent={"metricsPort": 9479, "probePort": 47912})),
        ),
    )


# --- spec, status, object ------------------------------------------------------------------------


class MetaRoceNetworkSpec(ApiModel):
    """What one RDMA network is: the nodes and NICs it takes, and how they are configured."""

    node_selector: LabelSelector = defaults_to_model(LabelSelector)
    """Nodes that run the network's agent; empty = every node."""
    tolerations: Annotated[list[Toleration], Field(max_length=32), ListType("atomic")] | None = None
    """Tolerations of the agent pods (e.g. for GPU node taints)."""
    nics: NicSelector
    transport: TransportSpec = defaults_to_model(TransportSpec)
    qos: QosSpec = defaults_to_model(QosSpec)
    attachment: AttachmentSpec = defaults_to_model(AttachmentSpec)
    health: HealthSpec = defaults_to_model(HealthSpec)
    agent: AgentSpec = defaults_to_model(AgentSpec)
    cleanup_on_delete: bool = False
    """Revert node settings when the network is deleted (and only then: an agent stopped by
    a rollout, eviction or shutdown leaves the node as it is for the jobs using it)."""

    cel_rules = (
        Rule(
            name="metaroce-is-not-lossless",
            cel="self.transport.mode != 'metaroce' || self.qos.profile != 'lossless'",
            field=".qos.profile",
            message=(
                "transport metaroce runs without PFC (it tolerates loss): set qos.profile "
                "to lossy (or custom)"
            ),
            check=lambda s: s.transport.mode != "metaroce" or s.qos.profile != "lossless",
            rejects=Case(
                _spec(transport={"mode": "metaroce"}, qos={"profile": "lossless"}),
                field="spec.qos.profile",
            ),
            accepts=Case(_spec(transport={"mode": "metaroce"}, qos={"profile": "lossy"})),
        ),
        Rule(
            name="pod-network-needs-metaroce",
            cel="!has(self.attachment.podNetwork) || self.transport.mode == 'metaroce'",
            field=".attachment.podNetwork",
            message=(
                "attachment.podNetwork is for transport metaroce (a UDP transport in the "
                "pod's network namespace); RDMA transports reach the NIC through the RDMA "
                "device: remove podNetwork, or set transport.mode: metaroce"
            ),
            check=lambda s: s.attachment.pod_network is None or s.transport.mode == "metaroce",
            rejects=Case(
                _spec(
                    transport={"mode": "softroce"},
                    attachment={"podNetwork": {"mode": "hostNetwork"}},
                ),
                field="spec.attachment.podNetwork",
            ),
            accepts=Case(
                _spec(
                    transport={"mode": "metaroce"},
                    qos={"profile": "lossy"},
                    attachment={"podNetwork": {"mode": "hostNetwork"}},
                )
            ),
        ),
    )


class NodeCounts(StatusModel):
    """Node counts of a network; `summary` is `configured/desired` for `kubectl get`."""

    desired: Annotated[int, Field(ge=0)] = 0
    """Nodes the selector matches."""
    configured: Annotated[int, Field(ge=0)] = 0
    """Nodes whose agent applied the current generation."""
    healthy: Annotated[int, Field(ge=0)] = 0
    """Configured nodes whose probe passes."""
    failed: Annotated[int, Field(ge=0)] = 0
    """Nodes whose agent reports an error."""
    summary: Annotated[str, Field(max_length=32)] = "0/0"
    """Filled in from the counts; input is ignored."""

    @model_validator(mode="after")
    def _summarise(self) -> "NodeCounts":
        self.summary = f"{self.configured}/{self.desired}"
        return self


class FailingNode(StatusModel):
    """One node that fails, and why."""

    node: NodeName
    reason: Annotated[str, Field(min_length=1, max_length=128)]
    message: ShortText = ""


class TransportSummary(StatusModel):
    """Which transport the network's nodes actually run."""

    active: ActiveTransport = "none"
    """The one transport all configured nodes run, or `mixed`."""
    nodes_by_mode: Annotated[dict[str, Annotated[int, Field(ge=0)]], Field(max_length=8)] | None = (
        None
    )
    """Configured nodes per transport, e.g. {rocev2: 30, softroce: 2}."""


class HeldNode(StatusModel):
    """A node holding off agent updates (`metaroce.io/hold-agent-update`)."""

    node: NodeName
    until: Annotated[str, Field(max_length=32)] = ""
    """The hold's deadline (RFC 3339), empty when the label's value is not one."""
    state: Literal["holding", "expired", "refused"] = "holding"
    """`holding`: its agent is not replaced until `until`; `expired`: past the deadline,
    updated like any node; `refused`: the label's value is not honoured (see message)."""
    message: ShortText = ""


class AgentUpdateStatus(StatusModel):
    """How the agents' rollout proceeds (spec.agent.updateStrategy)."""

    strategy: Literal["RollingUpdate", "OnDelete"] = "RollingUpdate"
    """The DaemonSet's: `OnDelete` while paused or while a node holds (the operator then
    replaces the other nodes' agents itself, maxUnavailable at a time)."""
    paused: bool = False
    holding: Annotated[int, Field(ge=0)] = 0
    """Nodes whose hold is honoured now."""
    held_nodes: (
        Annotated[list[HeldNode], Field(max_length=10), ListType("map", ("node",))] | None
    ) = None
    """Up to 10 nodes with the hold label, holding ones first."""


class MetaRoceNetworkStatus(StatusModel):
    """What the operator observes; written through the status subresource."""

    observed_generation: Annotated[int, Field(ge=0)] | None = None
    conditions: Conditions | None = None
    """Ready, Progressing, Degraded."""
    nodes: NodeCounts | None = None
    failing_nodes: (
        Annotated[list[FailingNode], Field(max_length=10), ListType("map", ("node",))] | None
    ) = None
    """Up to 10 failing nodes; `nodes.failed` has the full count."""
    transport: TransportSummary | None = None
    agent_update: AgentUpdateStatus | None = None


class MetaRoceNetwork(ApiModel):
    """A MetaRoceNetwork object (cluster-scoped)."""

    api_version: Literal["metaroce.io/v1alpha1"] = API_VERSION
    kind: Literal["MetaRoceNetwork"] = NETWORK_KIND
    metadata: NetworkMeta
    spec: MetaRoceNetworkSpec
    status: MetaRoceNetworkStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def resource_name(self) -> str:
        """The extended resource pods request for this network."""
        return self.spec.attachment.effective_resource_name(self.metadata.name)
