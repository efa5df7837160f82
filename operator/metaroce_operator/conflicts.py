"""NIC conflicts between networks: two networks must not configure the same NIC.

The admission webhook checks this when a network is written, but two writes can race, and
nodes get relabelled later; so the leader re-checks from what is there now:

- static: the two NIC selectors can match the same NIC (every attribute both of them
  constrain has an overlapping pair: globs that can match one name, equal PCI ids, equal
  drivers) on a node both node selectors match;
- observed: both networks' agents report the same netdev on the same node;
- one resource name (`spec.attachment.resourceName`) for two networks, on any nodes;
- selectors on different attributes (drivers on one side, interfaceNames on the other)
  have no static verdict: a NIC that one network's agents report and that the other's
  selector matches (by the reported attributes) is a conflict; without such a NIC there
  is none, and a held network is released.

The network created later (creationTimestamp, then name) yields: the operator does not
create or update its agent DaemonSet while such a conflict stands (`holding_conflicts`),
and resumes when it is gone. The older network keeps its NICs and its Ready condition.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from metaroce_api import LabelSelector, MetaRoceNetwork, NicSelector
from metaroce_operator.observed import ReportedNic

ReportedNics = Mapping[str, Mapping[str, Sequence[ReportedNic]]]
"""network -> node -> the NICs its agent reports."""

# --- glob intersection -------------------------------------------------------------------

_Token = tuple[str, frozenset[str], bool]
"""(kind, chars, negated): kind is 'lit', 'any' (?), 'star' (*) or 'set' ([...])."""


def _bracket(glob: str, i: int) -> tuple[_Token, int] | None:
    """The `[...]` set starting at `i` and the index of its `]`, or None if unclosed."""
    j = i + 1
    negated = glob[j : j + 1] == "!"
    if negated:
        j += 1
    end = glob.find("]", j + 1 if glob[j : j + 1] == "]" else j)
    if end == -1:
        return None
    body = glob[j:end]
    chars: set[str] = set()
    k = 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            chars.update(chr(x) for x in range(ord(body[k]), ord(body[k + 2]) + 1))
            k += 3
        else:
            chars.add(body[k])
            k += 1
    return ("set", frozenset(chars), negated), end


def _tokens(glob: str) -> tuple[_Token, ...]:
    out: list[_Token] = []
    i = 0
    while i < len(glob):
        ch = glob[i]
        bracket = _bracket(glob, i) if ch == "[" else None
        if ch == "*":
            out.append(("star", frozenset(), False))
        elif ch == "?":
            out.append(("any", frozenset(), False))
        elif bracket is not None:
            out.append(bracket[0])
            i = bracket[1]
        else:
            out.append(("lit", frozenset(ch), False))
        i += 1
    return tuple(out)


def _chars_meet(a: _Token, b: _Token) -> bool:
    """Whether one character can match both single-character tokens."""
    if a[0] == "any" or b[0] == "any":
        return True
    (_, sa, na), (_, sb, nb) = a, b
    if not na and not nb:
        return bool(sa & sb)
    if na and nb:
        return True  # the alphabet is larger than any two exclusion sets
    pos, neg = (sa, sb) if not na else (sb, sa)
    return bool(pos - neg)


@cache
def globs_intersect(a: str, b: str) -> bool:
    """Whether some name matches both fnmatch-style globs (`*`, `?`, `[...]`, `[!...]`)."""
    ta, tb = _tokens(a), _tokens(b)
    seen: set[tuple[int, int]] = set()
    stack = [(0, 0)]
    while stack:
        i, j = stack.pop()
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if i == len(ta) and j == len(tb):
            return True
        # A star may match the empty string.
        if i < len(ta) and ta[i][0] == "star":
            stack.append((i + 1, j))
        if j < len(tb) and tb[j][0] == "star":
            stack.append((i, j + 1))
        if i < len(ta) and j < len(tb):
            sa, sb = ta[i][0] == "star", tb[j][0] == "star"
            if sa and sb:
                stack.append((i, j + 1))
                stack.append((i + 1, j))
            elif sa:
                stack.append((i, j + 1))  # the star eats one character of b's token
            elif sb:
                stack.append((i + 1, j))
            elif _chars_meet(ta[i], tb[j]):
                stack.append((i + 1, j + 1))
    return False


# --- NIC selector overlap --------------------------------------------------------------


def _norm_id(value: str) -> str:
    return value.lower().removeprefix("0x")


def nic_overlap(a: NicSelector, b: NicSelector) -> str | None:
    """How the two selectors can pick the same NIC, or None when they cannot."""
    reasons: list[str] = []
    glob_fields = (("interfaceNames", "interface_names"), ("rdmaDevices", "rdma_devices"))
    for label, attr in glob_fields:
        ga, gb = getattr(a, attr), getattr(b, attr)
        if ga is None or gb is None:
            continue
        pair = next(((x, y) for x in ga for y in gb if globs_intersect(x, y)), None)
        if pair is None:
            return None
        reasons.append(f"{label} {pair[0]!r} and {pair[1]!r} can match the same NIC")
    exact_fields = (
        ("pciVendorIds", "pci_vendor_ids", _norm_id),
        ("pciDeviceIds", "pci_device_ids", _norm_id),
        ("drivers", "drivers", str),
    )
    for label, attr, norm in exact_fields:
        va, vb = getattr(a, attr), getattr(b, attr)
        if va is None or vb is None:
            continue
        common = sorted({norm(x) for x in va} & {norm(y) for y in vb})
        if not common:
            return None
        reasons.append(f"both select {label} {', '.join(common)}")
    return "; ".join(reasons) or "the selectors constrain different attributes"


_NIC_ATTRIBUTES = ("interface_names", "pci_vendor_ids", "pci_device_ids", "drivers", "rdma_devices")


def same_attributes(a: NicSelector, b: NicSelector) -> bool:
    """Whether both selectors constrain at least one attribute in common (only then can
    `nic_overlap` rule an overlap out)."""
    return any(getattr(a, f) is not None and getattr(b, f) is not None for f in _NIC_ATTRIBUTES)


def nic_selected(selector: NicSelector, nic: ReportedNic) -> bool:
    """Whether `selector` selects this reported NIC (AND across the lists that are set;
    an attribute the agent did not report cannot match)."""

    def globs(patterns: list[str] | None, value: str | None) -> bool:
        return patterns is None or (
            value is not None and any(fnmatch.fnmatchcase(value, g) for g in patterns)
        )

    def ids(wanted: list[str] | None, value: str | None) -> bool:
        return wanted is None or (
            value is not None and _norm_id(value) in {_norm_id(w) for w in wanted}
        )

    return (
        globs(selector.interface_names, nic.netdev)
        and globs(selector.rdma_devices, nic.rdma_device)
        and ids(selector.pci_vendor_ids, nic.vendor_id)
        and ids(selector.pci_device_ids, nic.device_id)
        and (selector.drivers is None or nic.driver in selector.drivers)
    )


# --- label selectors ---------------------------------------------------------------------


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics (empty selects everything)."""
    for key, value in (selector.match_labels or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.match_expressions or []:
        present = expr.key in labels
        values = set(expr.values or [])
        if expr.operator == "In" and not (present and labels[expr.key] in values):
            return False
        if expr.operator == "NotIn" and present and labels[expr.key] in values:
            return False
        if expr.operator == "Exists" and not present:
            return False
        if expr.operator == "DoesNotExist" and present:
            return False
    return True


# --- conflicts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conflict:
    network: str
    other: str
    nodes: tuple[str, ...]
    detail: str
    observed: bool
    resource: str = ""
    """Set when the two advertise one resource name (not a NIC overlap)."""

    def message(self) -> str:
        shown = ", ".join(self.nodes[:5]) + (" ..." if len(self.nodes) > 5 else "")
        if self.resource:
            return (
                f"network {self.other!r} advertises the same resource {self.resource!r} "
                f"(spec.attachment.resourceName), on {len(self.nodes)} node(s) ({shown}): a "
                "pod asking for it could get either network's NICs. Set another "
                "spec.attachment.resourceName in one of the two"
            )
        if self.observed:
            what = f"network {self.other!r} also configures NICs of this network"
        else:
            what = f"network {self.other!r} can select the same NICs"
        return (
            f"{what} on {len(self.nodes)} node(s) ({shown}): {self.detail}. Make spec.nics "
            "or spec.nodeSelector of the two networks disjoint (or delete one network)"
        )

    def held_message(self) -> str:
        """For the network that yields: why its agents are not rolled out."""
        return (
            f"rollout held: {self.message()}. {self.other!r} was created first, so the "
            "agent DaemonSet of this network is not created or updated until the conflict "
            "is gone; it resumes by itself then"
        )

    def yielded_message(self) -> str:
        """For the network that keeps its NICs."""
        return f"{self.message()}. {self.other!r} was created later: its rollout is held"


def find_conflicts(
    networks: Iterable[MetaRoceNetwork],
    node_labels: Mapping[str, Mapping[str, str]],
    netdevs: Mapping[str, Mapping[str, Iterable[str]]],
    nics: ReportedNics | None = None,
) -> dict[str, list[Conflict]]:
    """Conflicts of each network (both sides of a pair report it).

    `node_labels`: node -> labels; `netdevs`: network -> node -> netdevs its agent reports;
    `nics`: network -> node -> the NICs its agent reports, with their attributes.
    """
    nets = sorted(networks, key=lambda n: n.name)
    members = {
        n.name: {
            node
            for node, labels in node_labels.items()
            if selector_matches(n.spec.node_selector, labels)
        }
        for n in nets
    }
    out: dict[str, list[Conflict]] = {n.name: [] for n in nets}
    for i, a in enumerate(nets):
        for b in nets[i + 1 :]:
            conflict = _pair(a, b, members, netdevs, nics or {})
            if conflict is not None:
                nodes, detail, observed = conflict
                out[a.name].append(Conflict(a.name, b.name, nodes, detail, observed))
                out[b.name].append(Conflict(b.name, a.name, nodes, detail, observed))
            elif a.resource_name == b.resource_name:
                # The webhook refuses this, but two writes can race; on any nodes (a pod
                # asking for the resource lands on either network's).
                nodes = tuple(sorted(members.get(a.name, set()) | members.get(b.name, set())))
                resource = a.resource_name
                out[a.name].append(Conflict(a.name, b.name, nodes, "", False, resource))
                out[b.name].append(Conflict(b.name, a.name, nodes, "", False, resource))
    return out


def _pair(
    a: MetaRoceNetwork,
    b: MetaRoceNetwork,
    members: Mapping[str, set[str]],
    netdevs: Mapping[str, Mapping[str, Iterable[str]]],
    nics: ReportedNics,
) -> tuple[tuple[str, ...], str, bool] | None:
    da, db = netdevs.get(a.name, {}), netdevs.get(b.name, {})
    shared: dict[str, list[str]] = {}
    for node in sorted(set(da) & set(db)):
        common = sorted(set(da[node]) & set(db[node]))
        if common:
            shared[node] = common
    if shared:
        first = next(iter(shared))
        return tuple(shared), f"e.g. {', '.join(shared[first])} on {first}", True
    nodes = tuple(sorted(members.get(a.name, set()) & members.get(b.name, set())))
    if not nodes:
        return None
    if not same_attributes(a.spec.nics, b.spec.nics):
        return _reported_pair(a, b, nodes, nics)
    overlap = nic_overlap(a.spec.nics, b.spec.nics)
    if overlap is None:
        return None
    return nodes, overlap, False


def _reported_pair(
    a: MetaRoceNetwork, b: MetaRoceNetwork, nodes: Sequence[str], nics: ReportedNics
) -> tuple[tuple[str, ...], str, bool] | None:
    """Selectors on different attributes: a NIC one network's agent reports on a shared
    node that the other network's selector matches."""
    found: dict[str, list[str]] = {}
    for node in nodes:
        for mine, theirs in ((a, b), (b, a)):
            for nic in nics.get(mine.name, {}).get(node, ()):
                if nic_selected(theirs.spec.nics, nic):
                    found.setdefault(node, []).append(f"{nic.netdev} ({mine.name}'s)")
    if not found:
        return None
    first = next(iter(found))
    detail = (
        f"e.g. {', '.join(sorted(set(found[first])))} on {first} is selected by both "
        "networks' spec.nics"
    )
    return tuple(found), detail, True


def created_order(body: Mapping[str, object]) -> tuple[str, str]:
    """The order in which a conflict is decided: creationTimestamp (RFC 3339 UTC sorts
    as text), then name."""
    meta = body.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return (str(meta.get("creationTimestamp") or "~"), str(meta.get("name") or ""))


def holding_conflicts(
    name: str,
    networks: Mapping[str, MetaRoceNetwork],
    order: Mapping[str, tuple[str, str]],
    node_labels: Mapping[str, Mapping[str, str]],
    netdevs: Mapping[str, Mapping[str, Iterable[str]]],
    nics: ReportedNics | None = None,
) -> list[Conflict]:
    """The conflicts of network `name` with networks created before it (which win).

    `networks` includes `name`; `order` is `created_order` of each. A network without a
    creationTimestamp yet ("~") sorts last, so it never holds an existing one.
    """
    found = find_conflicts(networks.values(), node_labels, netdevs, nics).get(name, [])
    mine = order.get(name, ("~", name))
    return [conflict for conflict in found if order.get(conflict.other, ("~", "")) < mine]
