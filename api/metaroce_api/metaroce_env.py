"""The environment a pod of a `metaroce` network gets: one function for the webhook (the
network-wide part) and the device plugin (that and the per-node part), so they agree.

Network-wide (`network_env`; the webhook writes it into the pod spec, the user's own
values win):

- `FI_PROVIDER=metaroce` (libfabric, so Open MPI and aws-ofi-nccl take it),
- `NCCL_NET_PLUGIN=metaroce` (NCCL dlopens `libnccl-net-metaroce.so` by that name),
- `MR_CONFIG`: the transport's settings from `spec.transport.metaroce` and the data DSCP
  (`ports=`, `paths=`, `mtu=`, `dscp=`, `queue_target_us=`, `min_rto_us=`, `rate_mbps=`).

Per node (`allocation_env`; `Allocate` returns it with the library directory mounted
read-only at `CONTAINER_DIR`):

- `FI_PROVIDER_PATH` = `CONTAINER_DIR/lib` then libfabric's usual provider directories
  (`FI_PROVIDER_PATH` replaces libfabric's default directory, and the device plugin
  cannot read the image's environment): an image with providers elsewhere sets
  `FI_PROVIDER_PATH=$MR_FI_PROVIDER_PATH:<its own>` itself (its value wins);
- `MR_FI_PROVIDER_PATH` = `CONTAINER_DIR/lib`, for appending as above;
- `MR_LIB_DIR` = `CONTAINER_DIR/lib`: NCCL finds the plugin by name through the
  loader's path, so the job appends it to `LD_LIBRARY_PATH`
  (`LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$MR_LIB_DIR`), which the device
  plugin must not overwrite (CUDA images set it);
- `MR_NCCL_IFNAME` = `=<netdev>[,...]` (exact names) and `FI_METAROCE_IFACE` = the first:
  the interfaces the plugin and the provider bind;
- `MR_TRANSPORT_VERSION`, `MR_TRANSPORT_CHECKSUM`: which library the pod got.

With `spec.attachment.podNetwork` macvlan/ipvlan, a pod not on the host network binds
its Multus interface (`mr0`) instead: the webhook sets `FI_METAROCE_IFACE` and
`MR_NCCL_IFNAME` in the pod spec (`interface_env`), which win over the device plugin's
values (the kubelet puts the pod's own env after the plugin's).
"""

from collections.abc import Sequence

from metaroce_api.network import QosSpec, TransportSpec

CONTAINER_DIR = "/opt/metaroce-transport"
"""Where a pod sees the network's versioned library directory (read-only)."""
LIBFABRIC_PROVIDER_DIRS = (
    "/usr/lib/x86_64-linux-gnu/libfabric",
    "/usr/lib/aarch64-linux-gnu/libfabric",
    "/usr/lib64/libfabric",
    "/usr/local/lib/libfabric",
    "/opt/amazon/efa/lib/libfabric",
)
"""libfabric's default provider directories of Debian/Ubuntu, RHEL, a source build and
EFA's installer, kept on FI_PROVIDER_PATH after the transport's own directory."""
NETWORK_ENV = ("FI_PROVIDER", "NCCL_NET_PLUGIN", "MR_CONFIG")
INTERFACE_ENV = ("FI_METAROCE_IFACE", "MR_NCCL_IFNAME")
"""The interface the provider and the NCCL plugin bind."""
SELECTING_ENV = ("FI_PROVIDER", "NCCL_NET_PLUGIN", *INTERFACE_ENV)
"""Variables whose other values take a job off metaroce (the webhook warns)."""


def transport_config(transport: TransportSpec, qos: QosSpec) -> str:
    """`MR_CONFIG` for the network (no `addr=`: the plugin and the provider take the
    address of the interface they are given)."""
    m = transport.effective_metaroce()
    c = m.congestion
    items = [
        f"ports={m.port_range}",
        f"paths={m.paths}",
        f"mtu={m.datagram_size(transport.mtu)}",
        f"dscp={qos.data.dscp}",
        f"queue_target_us={c.queue_target_micros}",
        f"min_rto_us={c.min_rto_micros}",
    ]
    if c.rate_hint_mbps:
        items.append(f"rate_mbps={c.rate_hint_mbps}")
    return ",".join(items)


def network_env(transport: TransportSpec, qos: QosSpec) -> dict[str, str]:
    return {
        "FI_PROVIDER": "metaroce",
        "NCCL_NET_PLUGIN": "metaroce",
        "MR_CONFIG": transport_config(transport, qos),
    }


def interface_env(interface: str) -> dict[str, str]:
    """`FI_METAROCE_IFACE` and `MR_NCCL_IFNAME` for one interface (exact name)."""
    return {"FI_METAROCE_IFACE": interface, "MR_NCCL_IFNAME": f"={interface}"}


def allocation_env(
    transport: TransportSpec,
    qos: QosSpec,
    netdevs: Sequence[str],
    *,
    version: str,
    checksum: str,
) -> dict[str, str]:
    lib = f"{CONTAINER_DIR}/lib"
    return {
        **network_env(transport, qos),
        "FI_PROVIDER_PATH": ":".join((lib, *LIBFABRIC_PROVIDER_DIRS)),
        "MR_FI_PROVIDER_PATH": lib,
        "MR_LIB_DIR": lib,
        "MR_NCCL_IFNAME": "=" + ",".join(netdevs),
        "FI_METAROCE_IFACE": netdevs[0],  # pods with a Multus interface: the webhook's
        "MR_TRANSPORT_VERSION": version,
        "MR_TRANSPORT_CHECKSUM": checksum,
    }
