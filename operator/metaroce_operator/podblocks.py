"""Per-node blocks of a network's pod subnet (`spec.attachment.podNetwork`), pure.

Each node of the network gets its own `/nodePrefixLength` block of `subnet`, recorded as
the node annotation `podnet.metaroce.io/<network>` (see `metaroce_api.podnet`), which
its agent turns into the node's CNI configuration. Like nv-ipam's per-node blocks:

- a node keeps its block while it holds one that is still a block of the subnet (a
  changed subnet or prefix length re-assigns every node);
- two nodes claiming the same block (an annotation copied by hand): the first by name
  keeps it, the other gets a new one;
- new nodes get the lowest free blocks, in node-name order, so a run is reproducible;
- a node gives its block back only once it is out of the network entirely (not
  selected and without the network's node label, i.e. its agent reverted it or it had
  none): a node still reverting keeps it, so a new node never gets the addresses of pods
  that may still run there;
- when the subnet has fewer blocks than nodes, the nodes left over get none and are
  reported (the network's condition names the fields to change).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass, field
from ipaddress import IPv4Network, ip_network

from metaroce_api.network import PodNetworkSpec


@dataclass(frozen=True)
class BlockPlan:
    changes: dict[str, str | None] = field(default_factory=dict)
    """node -> its new annotation value (None: remove the annotation)."""
    blocks: dict[str, str] = field(default_factory=dict)
    """node -> its block, after the changes, for every node of the network that has one."""
    unassigned: tuple[str, ...] = ()
    """Nodes of the network left without a block: the subnet is too small."""


def _parse(text: str | None) -> IPv4Network | None:
    if not text:
        return None
    try:
        net = ip_network(text, strict=True)
    except ValueError:
        return None
    return net if isinstance(net, IPv4Network) else None


def _all_blocks(subnet: IPv4Network, prefix: int) -> Iterator[IPv4Network]:
    return subnet.subnets(new_prefix=prefix)


def plan_blocks(
    spec: PodNetworkSpec,
    members: Set[str],
    current: Mapping[str, str],
) -> BlockPlan:
    """`members`: the nodes the network holds (selected, or still carrying its node
    label); `current`: node -> the annotation's value, for every node that has one."""
    subnet = spec.network
    changes: dict[str, str | None] = {}
    if subnet is None or not spec.secondary or spec.node_prefix_length < subnet.prefixlen:
        return BlockPlan(changes={n: None for n in current})
    prefix = spec.node_prefix_length
    kept: dict[str, IPv4Network] = {}
    taken: set[IPv4Network] = set()
    for node in sorted(current):
        if node not in members:
            changes[node] = None  # out of the network: its block goes back
            continue
        block = _parse(current[node])
        if (
            block is not None
            and block.prefixlen == prefix
            and block.subnet_of(subnet)
            and block not in taken
        ):
            kept[node] = block
            taken.add(block)
    wanting = sorted(n for n in members if n not in kept)
    free = (b for b in _all_blocks(subnet, prefix) if b not in taken)
    unassigned: list[str] = []
    blocks = {n: str(b) for n, b in kept.items()}
    for node in wanting:
        block = next(free, None)
        if block is None:
            unassigned.append(node)
            if node in current:
                changes[node] = None
            continue
        blocks[node] = str(block)
        changes[node] = str(block)
    return BlockPlan(changes=changes, blocks=blocks, unassigned=tuple(unassigned))


def too_small_message(spec: PodNetworkSpec, members: int, unassigned: Set[str]) -> str:
    """The condition message for a subnet with fewer blocks than nodes."""
    shown = ", ".join(sorted(unassigned)[:5]) + (" ..." if len(unassigned) > 5 else "")
    return (
        f"spec.attachment.podNetwork.subnet {spec.subnet} holds {spec.block_count} blocks of "
        f"/{spec.node_prefix_length} but the network has {members} nodes; nodes without a "
        f"block ({shown}) cannot give pods an address: widen subnet, or raise "
        "nodePrefixLength (smaller blocks, fewer pods per node)"
    )
