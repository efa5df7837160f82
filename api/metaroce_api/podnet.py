"""Pod networking of a metaroce network through Multus: names, per-node blocks, the CNI
configuration and the pod's `k8s.v1.cni.cncf.io/networks` entry.

Shared by the operator (the NetworkAttachmentDefinition and the node blocks), the agent
(the per-node CNI configuration file) and the webhook (the pod's annotation), so they
agree on every name.

How it fits together (`spec.attachment.podNetwork`, mode macvlan or ipvlan):

- the operator renders one NetworkAttachmentDefinition per network, `metaroce-<network>`
  in the agents' namespace, WITHOUT `spec.config`. Multus (thin plugin, v4) then reads
  the CNI configuration from its `confDir` (`/etc/cni/multus/net.d` by default): the
  first `.conf`/`.json`/`.conflist` file there whose `name` equals the NAD's name
  (network-attachment-definition-client v1.7.5 `utils.GetCNIConfig`, which Multus
  v4.1.4's `k8sclient.getKubernetesDelegate` calls). So one cluster object stands for a
  configuration that differs per node: the macvlan/ipvlan master is the node's selected
  netdev, and the addresses come from the node's own block;
- the operator gives each node a block of `subnet` (`/nodePrefixLength`), recorded as
  the node annotation `podnet.metaroce.io/<network>` (like nv-ipam's per-node blocks):
  stable while the node stays in the network, never the same for two nodes, so pods on
  different nodes never collide; a node that left the network (its label gone) gives
  its block back;
- the agent writes `/etc/cni/multus/net.d/metaroce-<network>.conf` (a step with apply,
  verify and undo): host-local hands out addresses of the node's block with the prefix
  of the whole subnet, so every pod of the network reaches every other one on-link;
- the webhook (and the admission policy) add `<agents namespace>/metaroce-<network>@mr0`
  to the pod's `k8s.v1.cni.cncf.io/networks` and point the transport at `mr0`.

The NAD lives in the agents' namespace, referenced across namespaces: one object per
network, no write access to the users' namespaces. A Multus configured with
`namespaceIsolation: true` refuses references to other namespaces except those in its
`globalNamespaces`: list the agents' namespace there (the harness does).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from ipaddress import IPv4Network
from typing import Any

from metaroce_api.constants import GROUP
from metaroce_api.network import PodNetworkSpec

NAD_GROUP = "k8s.cni.cncf.io"
NAD_VERSION = "v1"
NAD_API_VERSION = f"{NAD_GROUP}/{NAD_VERSION}"
NAD_KIND = "NetworkAttachmentDefinition"
NAD_PLURAL = "network-attachment-definitions"
NAD_CRD = f"{NAD_PLURAL}.{NAD_GROUP}"
MULTUS_NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
MULTUS_STATUS_ANNOTATION = "k8s.v1.cni.cncf.io/network-status"
MULTUS_CONF_DIR = "/etc/cni/multus/net.d"
"""Multus's default `confDir`, where a config-less NAD's configuration is looked up."""
BLOCK_ANNOTATION_PREFIX = f"podnet.{GROUP}"
NAD_PREFIX = "metaroce-"
CNI_VERSION = "0.4.0"


def nad_name(network: str) -> str:
    """`metaroce-<network>`, cut to 63 characters with a hash suffix when longer."""
    text = NAD_PREFIX + network
    if len(text) <= 63:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{text[:52].rstrip('-')}-{digest}"


def conf_path(network: str) -> str:
    """The per-node CNI configuration file Multus reads for the network's NAD."""
    return f"{MULTUS_CONF_DIR}/{nad_name(network)}.conf"


def block_annotation(network: str) -> str:
    """The node annotation with the node's block of the network's subnet."""
    return f"{BLOCK_ANNOTATION_PREFIX}/{network}"


def nad_reference(namespace: str, network: str, interface: str) -> str:
    """The pod annotation's short form: `<namespace>/<nad>@<interface>`."""
    return f"{namespace}/{nad_name(network)}@{interface}"


def block_range(subnet: IPv4Network, block: IPv4Network) -> tuple[str, str]:
    """(first, last) address host-local may hand out in `block`: not the block's first
    and last address (one is the subnet's network or broadcast address at the ends, and
    the subnet's gateway, its first host, is in the first block anyway)."""
    first = block.network_address + 1
    last = block.broadcast_address - 1
    if first == subnet.network_address + 1:
        first += 1  # host-local reserves the range's gateway (the subnet's first host)
    return str(first), str(last)


def cni_config(network: str, spec: PodNetworkSpec, master: str, block: str) -> dict[str, Any]:
    """The CNI configuration (one plugin) of the network's NAD on one node: a
    macvlan (bridge mode) or ipvlan (l2) interface on `master`, addresses from `block`
    with the whole subnet's prefix (on-link to every node's pods)."""
    subnet = spec.network
    if subnet is None or not spec.secondary:
        raise ValueError(f"network {network}: podNetwork has no secondary interface")
    cidr = IPv4Network(block)
    if not cidr.subnet_of(subnet) or cidr.prefixlen != spec.node_prefix_length:
        raise ValueError(f"block {block} is not a /{spec.node_prefix_length} of {subnet}")
    first, last = block_range(subnet, cidr)
    return {
        "cniVersion": CNI_VERSION,
        "name": nad_name(network),
        "type": spec.mode,
        "master": master,
        "mode": "bridge" if spec.mode == "macvlan" else "l2",
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": str(subnet), "rangeStart": first, "rangeEnd": last}]],
        },
    }


def cni_config_text(config: Mapping[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


# --- the pod's k8s.v1.cni.cncf.io/networks annotation ----------------------------------------
#
# The webhook (Python) and the admission policy (CEL, render/podpolicy.py) change the
# annotation alike, so string surgery both can do, not a JSON round trip: absent or
# blank -> the short form `ns/nad@iface`; Multus's JSON list form (it starts with `[`)
# -> the entry appended before the closing `]`; the comma form -> `,ns/nad@iface`
# appended. An entry for the network's NAD that the user wrote (with any interface) is
# kept as written.


def json_entry(namespace: str, network: str, interface: str) -> str:
    """The JSON form's entry for the network's attachment (no spaces)."""
    return f'{{"name":"{nad_name(network)}","namespace":"{namespace}","interface":"{interface}"}}'


def lists_attachment(value: str, namespace: str, network: str) -> bool:
    """Whether the annotation (stripped, not blank) already lists the network's NAD."""
    name = nad_name(network)
    if value.startswith("["):
        return f'"name":"{name}"' in value.replace(" ", "")
    return any(
        part.strip().split("@")[0] in (name, f"{namespace}/{name}") for part in value.split(",")
    )


def merge_networks_annotation(
    value: str | None, namespace: str, network: str, interface: str
) -> str | None:
    """The annotation with the network's attachment added; None = it lists it already."""
    text = (value or "").strip()
    if not text:
        return nad_reference(namespace, network, interface)
    if lists_attachment(text, namespace, network):
        return None
    if text.startswith("["):
        if malformed_list(text):
            return None  # Multus refuses it anyway; the webhook warns
        entry = json_entry(namespace, network, interface)
        if not text[1:-1].strip():
            return f"[{entry}]"
        return f"{text[:-1]},{entry}]"
    return f"{text},{nad_reference(namespace, network, interface)}"


def malformed_list(text: str) -> bool:
    """A JSON-form annotation (stripped) that does not end its list."""
    return text.startswith("[") and not text.endswith("]")


def attachment_interface(value: str | None, namespace: str, network: str) -> str | None:
    """The interface name the annotation gives the network's attachment (None when it has
    none, or names none: Multus then calls it net1, net2, ...)."""
    text = (value or "").strip()
    if not text:
        return None
    name = nad_name(network)
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            return None
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and item.get("name") == name:
                iface = item.get("interface")
                return str(iface) if iface else None
        return None
    for part in (p.strip() for p in text.split(",")):
        ref, _, iface = part.partition("@")
        if ref in (name, f"{namespace}/{name}"):
            return iface or None
    return None
