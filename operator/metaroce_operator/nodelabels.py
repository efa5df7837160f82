"""The operator-managed node label of a network (issue 15 finding 4).

An agent cannot tell its node leaving the network's nodeSelector from a rollout or an
eviction (each is a SIGTERM), so the operator says it: every node a `cleanupOnDelete`
network selects carries `metaroce.io/agent-<network>=selected`, and the DaemonSet places
agents on the selected nodes OR on nodes with that label (render/daemonset.py). When a
node leaves the selector, the label keeps its agent there: the operator sets it to
`revert`, the agent reverts the node and reports it, and only then is the label removed
(the agent goes). A node without a NodeState has nothing to revert.

A network without `cleanupOnDelete` leaves a node's settings in place when the node
leaves it (as when such a network is deleted), so the label would keep nothing: its
nodes carry none, and a label left from a time with `cleanupOnDelete` is removed. That
saves one Node write per node on every such network (issue 16, the scale bench: the
label was the operator arm's whole surplus of apiserver writes over the limit arm).

`plan_labels` is pure: what to set (a value) or remove (None) on which node.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from metaroce_api import constants as c

REVERTED_PHASES = frozenset({"Reverted"})


def plan_labels(
    label: str,
    selected: Set[str],
    node_labels: Mapping[str, Mapping[str, str]],
    phases: Mapping[str, str],
    cleanup_on_delete: bool,
    timed_out: Set[str] = frozenset(),
) -> dict[str, str | None]:
    """node -> the label's new value (None: remove it), for the nodes whose label must
    change. `phases`: each node's NodeState phase; `timed_out`: nodes asked to revert
    longer ago than the cleanup timeout (let go like a deleted network's)."""
    out: dict[str, str | None] = {}
    for node, labels in node_labels.items():
        value = labels.get(label)
        if not cleanup_on_delete:
            if value is not None:
                out[node] = None  # nothing to revert: the node keeps its settings
            continue
        if node in selected:
            if value != c.NODE_SELECTED:
                out[node] = c.NODE_SELECTED
        elif value is not None:
            phase = phases.get(node)
            done = phase is None or phase in REVERTED_PHASES or node in timed_out
            if done:
                out[node] = None
            elif value != c.NODE_REVERT:
                out[node] = c.NODE_REVERT
    return out


def orphaned_labels(
    node_labels: Mapping[str, Mapping[str, str]], labels_of_live: Set[str]
) -> dict[str, list[str]]:
    """node -> the operator's labels on it whose network is gone."""
    out: dict[str, list[str]] = {}
    for node, labels in node_labels.items():
        gone = [k for k in labels if k.startswith(c.NODE_LABEL_PREFIX) and k not in labels_of_live]
        if gone:
            out[node] = gone
    return out
