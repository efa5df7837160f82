"""Network validation (pure): what the CRD's schema and CEL rules cannot see.

`validate_network_change(obj, others, nodes)` returns `Verdict(problems, warnings)`; any
problem refuses the write. The CRD has already checked each object on its own; this looks
across objects and at what the selected NICs can do:

- NIC conflicts: another network can select the same NICs (`conflicts.nic_overlap`, on an
  attribute both selectors constrain) on a node both node selectors select (from the
  current nodes' labels). When no node is selected by both today but the selectors could
  still meet, or the two select NICs by different attributes (drivers vs names), it is a
  warning: the operator's leader re-checks from what the agents report;
- agent host ports (a warning): another network whose agents run on the same nodes with
  the same `agent.metricsPort` or `agent.probePort` (the agents use the host network, so
  the later agent cannot bind the port and its metrics or probes are missing there);
- resource names: `attachment.resourceName` (after its default) used by another network;
- transport vs NICs: `rocev2` (hardware) on NICs whose drivers or vendors have no RDMA,
  or on SoftRoCE devices (`rxe*`); `auto` on such NICs without `allowSoftRoceFallback`;
  `softroce` with `rdmaDevices` globs that can never match an rxe device; `metaroce` on
  software NICs; `qos.onUnsupported: error` with SoftRoCE and PFC/ETS (rxe has no DCB, so
  every node would fail).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaroce_api import InvalidObject, LabelSelector, MetaRoceNetwork, NicSelector
from metaroce_api import validate_network as parse_network
from metaroce_operator.conflicts import (
    globs_intersect,
    nic_overlap,
    same_attributes,
    selector_matches,
)
from metaroce_operator.images import image_refusal

NO_RDMA_DRIVERS = frozenset(
    {
        "virtio_net",
        "e1000",
        "e1000e",
        "igb",
        "igc",
        "ixgbe",
        "ixgbevf",
        "r8169",
        "tg3",
        "veth",
        "tun",
        "bridge",
        "bonding",
        "macvlan",
        "ipvlan",
        "vxlan",
        "dummy",
        "hv_netvsc",
        "ena",
        "gve",
    }
)
"""Netdev drivers with no RDMA (RoCE) engine: only SoftRoCE can run on them."""
NO_RDMA_VENDORS = frozenset({"1af4", "10ec"})
"""PCI vendors whose NICs have no RDMA: virtio (Red Hat/Qumranet), Realtek."""
SOFTROCE_DEVICE_GLOB = "rxe*"
"""rxe links the agent creates are `rxe_<netdev>`; adopted ones are usually `rxe*` too."""


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    about: str = ""
    """The other network the problem is with, if any (what an UPDATE compares)."""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"

    @property
    def key(self) -> tuple[str, str]:
        """The same problem in an old and a new spec (the message may differ in detail,
        e.g. fewer shared nodes after a step towards the fix)."""
        return (self.field, self.about or self.message)


@dataclass
class Verdict:
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.problems

    def message(self, name: str) -> str:
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"MetaRoceNetwork {name!r} is refused:\n{lines}"


def _norm_id(value: str) -> str:
    return value.lower().removeprefix("0x")


# --- node selectors -------------------------------------------------------------------------


def _requirements(sel: LabelSelector) -> list[tuple[str, str, frozenset[str]]]:
    reqs = [(k, "In", frozenset({v})) for k, v in (sel.match_labels or {}).items()]
    for expr in sel.match_expressions or []:
        reqs.append((expr.key, expr.operator, frozenset(expr.values or ())))
    return reqs


def selectors_disjoint(a: LabelSelector, b: LabelSelector) -> bool:
    """Whether no label set can satisfy both selectors (sound, not complete)."""
    by_key: dict[str, list[tuple[str, frozenset[str]]]] = {}
    for key, op, values in _requirements(a) + _requirements(b):
        by_key.setdefault(key, []).append((op, values))
    for reqs in by_key.values():
        allowed: frozenset[str] | None = None
        excluded: set[str] = set()
        must_exist = must_not_exist = False
        for op, values in reqs:
            if op == "In":
                allowed = values if allowed is None else allowed & values
                must_exist = True
            elif op == "NotIn":
                excluded |= values
            elif op == "Exists":
                must_exist = True
            elif op == "DoesNotExist":
                must_not_exist = True
        if must_exist and must_not_exist:
            return True
        if allowed is not None and not (allowed - excluded):
            return True
    return False


def shared_nodes(
    a: LabelSelector, b: LabelSelector, nodes: Mapping[str, Mapping[str, str]]
) -> list[str]:
    return sorted(
        n
        for n, labels in nodes.items()
        if selector_matches(a, labels) and selector_matches(b, labels)
    )


# --- checks ----------------------------------------------------------------------------------


def _conflicts(
    net: MetaRoceNetwork,
    others: Sequence[MetaRoceNetwork],
    nodes: Mapping[str, Mapping[str, str]] | None,
    verdict: Verdict,
) -> None:
    for other in others:
        overlap = nic_overlap(net.spec.nics, other.spec.nics)
        if overlap is None:
            continue
        a, b = net.spec.node_selector, other.spec.node_selector
        if selectors_disjoint(a, b):
            continue
        both = shared_nodes(a, b, nodes) if nodes is not None else []
        if not same_attributes(net.spec.nics, other.spec.nics):
            # e.g. drivers on one side, interfaceNames on the other: only the NICs the
            # agents find can tell; the leader's re-check flags a real conflict.
            where = f" on {len(both)} node(s)" if both else ""
            verdict.warnings.append(
                f"network {other.name!r} selects NICs by other attributes and may take the "
                f"same NICs{where}; if it does, the operator reports a NicConflict: consider "
                "selecting NICs by the same attribute in both networks"
            )
            continue
        if both:
            shown = ", ".join(both[:5]) + (" ..." if len(both) > 5 else "")
            verdict.problems.append(
                Problem(
                    "spec.nics",
                    f"network {other.name!r} can select the same NICs on {len(both)} node(s) "
                    f"({shown}): {overlap}. Make spec.nics or spec.nodeSelector of the two "
                    "networks disjoint (or delete one of them)",
                    about=other.name,
                )
            )
        elif nodes is None:
            verdict.problems.append(
                Problem(
                    "spec.nics",
                    f"network {other.name!r} can select the same NICs ({overlap}) and the two "
                    "node selectors can select the same nodes. Make spec.nics or "
                    "spec.nodeSelector of the two networks disjoint (or delete one of them)",
                    about=other.name,
                )
            )
        else:
            verdict.warnings.append(
                f"network {other.name!r} can select the same NICs ({overlap}); no node is "
                "selected by both networks today, but a node labelled for both would be "
                "configured twice: consider making the node selectors disjoint"
            )


def _ports(
    net: MetaRoceNetwork,
    others: Sequence[MetaRoceNetwork],
    nodes: Mapping[str, Mapping[str, str]] | None,
    verdict: Verdict,
) -> None:
    mine = {net.spec.agent.metrics_port, net.spec.agent.probe_port}
    for other in others:
        theirs = {other.spec.agent.metrics_port, other.spec.agent.probe_port}
        clash = sorted(mine & theirs)
        a, b = net.spec.node_selector, other.spec.node_selector
        if not clash or selectors_disjoint(a, b):
            continue
        both = shared_nodes(a, b, nodes) if nodes is not None else []
        if nodes is not None and not both:
            continue
        where = f" on {len(both)} node(s) ({', '.join(both[:5])})" if both else ""
        verdict.warnings.append(
            f"network {other.name!r} runs agents on the same nodes{where} with host port(s) "
            f"{', '.join(map(str, clash))}: only one agent per node can bind a port, so set "
            f"other spec.agent.metricsPort and spec.agent.probePort in one of the two (e.g. "
            f"{max(theirs) + 1} and {max(theirs) + 2})"
        )


def _resource_names(
    net: MetaRoceNetwork, others: Sequence[MetaRoceNetwork], verdict: Verdict
) -> None:
    mine = net.resource_name
    for other in others:
        if other.resource_name == mine:
            verdict.problems.append(
                Problem(
                    "spec.attachment.resourceName",
                    f"resource name {mine!r} is already used by network {other.name!r} "
                    "(kubelets would see two device plugins for one resource): set another "
                    "spec.attachment.resourceName",
                    about=other.name,
                )
            )


def _pod_network(
    net: MetaRoceNetwork,
    others: Iterable[MetaRoceNetwork],
    nodes: Mapping[str, Mapping[str, str]] | None,
    verdict: Verdict,
) -> None:
    """podNetwork macvlan/ipvlan: a subnet with fewer node blocks than the nodes the
    network selects now is refused (the operator reports the same later, when nodes are
    added); a subnet overlapping another network's is a warning (on one L2 their pods'
    addresses would collide)."""
    spec = net.spec.attachment.pod_network
    subnet = spec.network if spec is not None and spec.secondary else None
    if spec is None or subnet is None or net.spec.transport.mode != "metaroce":
        return
    if nodes is not None:
        selected = [
            n for n, labels in nodes.items() if selector_matches(net.spec.node_selector, labels)
        ]
        if len(selected) > spec.block_count:
            verdict.problems.append(
                Problem(
                    "spec.attachment.podNetwork.subnet",
                    f"{spec.subnet} holds {spec.block_count} blocks of "
                    f"/{spec.node_prefix_length}, but spec.nodeSelector selects "
                    f"{len(selected)} nodes, each of which needs its own: widen subnet, or "
                    "raise nodePrefixLength (smaller blocks, fewer pods per node)",
                )
            )
    for other in others:
        theirs = other.spec.attachment.pod_network
        their_subnet = theirs.network if theirs is not None and theirs.secondary else None
        if their_subnet is not None and their_subnet.overlaps(subnet):
            verdict.warnings.append(
                f"spec.attachment.podNetwork.subnet {spec.subnet} overlaps network "
                f"{other.name!r}'s {theirs.subnet if theirs else ''}: pods of the two on one "
                "L2 would get the same addresses; give each network its own subnet"
            )


def _only_software(nics: NicSelector) -> str | None:
    """Why the selector can only pick NICs without hardware RDMA, or None."""
    if nics.drivers and all(d in NO_RDMA_DRIVERS for d in nics.drivers):
        return f"spec.nics.drivers selects only drivers without RDMA ({', '.join(nics.drivers)})"
    if nics.pci_vendor_ids and all(_norm_id(v) in NO_RDMA_VENDORS for v in nics.pci_vendor_ids):
        return (
            "spec.nics.pciVendorIds selects only vendors without RDMA NICs "
            f"({', '.join(nics.pci_vendor_ids)})"
        )
    return None


def _only_rxe(nics: NicSelector) -> bool:
    globs = nics.rdma_devices or []
    return bool(globs) and all(g.startswith("rxe") for g in globs)


def _transport(net: MetaRoceNetwork, verdict: Verdict) -> None:
    spec = net.spec
    mode = spec.transport.mode
    nics = spec.nics
    software = _only_software(nics)
    if mode == "rocev2":
        if software:
            verdict.problems.append(
                Problem(
                    "spec.transport.mode",
                    f"rocev2 needs hardware RoCE NICs, but {software}: use mode softroce (or "
                    "auto with allowSoftRoceFallback: true), or select RDMA NICs (e.g. drivers: "
                    "[mlx5_core])",
                )
            )
        elif _only_rxe(nics):
            verdict.problems.append(
                Problem(
                    "spec.transport.mode",
                    f"rocev2 means hardware RoCE, but spec.nics.rdmaDevices "
                    f"({', '.join(nics.rdma_devices or [])}) selects only SoftRoCE (rxe) "
                    "devices: use mode softroce, or select hardware devices (e.g. mlx5_*)",
                )
            )
    elif mode == "auto" and software and not spec.transport.allow_soft_roce_fallback:
        verdict.problems.append(
            Problem(
                "spec.transport.allowSoftRoceFallback",
                f"mode auto uses hardware RoCE, but {software}, so every node would fail: set "
                "allowSoftRoceFallback: true, or mode softroce",
            )
        )
    elif mode == "softroce":
        globs = nics.rdma_devices or []
        if globs and not any(globs_intersect(g, SOFTROCE_DEVICE_GLOB) for g in globs):
            verdict.problems.append(
                Problem(
                    "spec.nics.rdmaDevices",
                    f"softroce creates rxe devices (named rxe_<netdev>), which "
                    f"{', '.join(globs)} can never match: remove rdmaDevices (select the "
                    "netdevs with interfaceNames or drivers) or use a glob such as rxe*",
                )
            )
        if spec.qos.on_unsupported == "error" and (
            spec.qos.effective_pfc_priorities() or spec.qos.ets
        ):
            verdict.problems.append(
                Problem(
                    "spec.qos.onUnsupported",
                    "onUnsupported is error, but SoftRoCE (rxe) has no DCB for the PFC/ETS this "
                    "QoS asks for, so every node would fail: set onUnsupported: skip, or use "
                    "profile lossy (no PFC) without ets",
                )
            )
    elif mode == "metaroce" and _only_rxe(nics):
        # a UDP transport in the jobs' processes: any netdev with an address will do, but
        # rxe devices exist only where SoftRoCE made them, so they select nothing here
        verdict.problems.append(
            Problem(
                "spec.nics.rdmaDevices",
                f"metaroce serves netdevs, not SoftRoCE devices, but spec.nics.rdmaDevices "
                f"({', '.join(nics.rdma_devices or [])}) selects only rxe devices: select the "
                "netdevs with interfaceNames, drivers or PCI ids instead",
            )
        )


# --- entry point --------------------------------------------------------------------------------


def validate_network_change(
    obj: Mapping[str, Any],
    others: Iterable[MetaRoceNetwork],
    nodes: Mapping[str, Mapping[str, str]] | None = None,
    old: Mapping[str, Any] | None = None,
    *,
    allowed_agent_images: Sequence[str] | None = None,
) -> Verdict:
    """Judge a network create/update against the other networks and the nodes.

    `others`: the other networks (one with the same name is skipped); `nodes`: node name ->
    labels, or None when unknown (then NIC overlaps are judged from the selectors alone).
    `allowed_agent_images`: the images `spec.agent.image` may name (see `images`); None
    skips that check (a webhook told no allowlist).
    `old`: on UPDATE, the object before: a problem it had already (with the same network,
    in the same field) is a warning, not a refusal. Two networks that came to conflict
    (a race at admission, nodes relabelled since) must stay editable, or neither could
    be fixed step by step; the leader holds the later one meanwhile.
    """
    others = list(others)
    verdict = _judge(obj, others, nodes, allowed_agent_images)
    if old is None or verdict.allowed:
        return verdict
    before = {p.key for p in _judge(old, others, nodes, allowed_agent_images).problems}
    kept = [p for p in verdict.problems if p.key in before]
    for problem in kept:
        verdict.warnings.append(
            f"{problem} (the network had this problem before this change, so the change is "
            "admitted; fix it)"
        )
    verdict.problems = [p for p in verdict.problems if p.key not in before]
    return verdict


def _judge(
    obj: Mapping[str, Any],
    others: Iterable[MetaRoceNetwork],
    nodes: Mapping[str, Mapping[str, str]] | None,
    allowed_agent_images: Sequence[str] | None,
) -> Verdict:
    verdict = Verdict()
    try:
        net = parse_network(obj)
    except InvalidObject as exc:
        verdict.problems += [Problem(i.path or "<object>", i.message) for i in exc.issues]
        return verdict
    rest = sorted((o for o in others if o.name != net.name), key=lambda o: o.name)
    _conflicts(net, rest, nodes, verdict)
    _ports(net, rest, nodes, verdict)
    _resource_names(net, rest, verdict)
    _transport(net, verdict)
    _pod_network(net, rest, nodes, verdict)
    if allowed_agent_images is not None:
        refusal = image_refusal(net, allowed_agent_images)
        if refusal:
            verdict.problems.append(Problem("spec.agent.image", refusal))
    return verdict
