"""`metaroce status [NETWORK]`: the networks, their nodes, what fails and what to do, read
from the cluster (the network's status and conditions, each node's MetaRoceNodeState).

Pure functions turn the objects into lines (`overview`, `network_report`); `main` only
fetches them. Exit status: 0 every shown network is Ready, 1 one is not, 2 the cluster
could not be asked or the network does not exist.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from metaroce_api import constants as c
from metaroce_cli.cluster import connect

CONDITION_FIXES: dict[str, str] = {
    c.REASON_NO_MATCHING_NODES: "label the nodes spec.nodeSelector names, or change the selector "
    "(`kubectl get nodes --show-labels`)",
    c.REASON_WAITING_FOR_NODES: "wait for the agents to start; if it lasts, `kubectl -n <agents' "
    "namespace> get pods -l metaroce.io/network=<network>` shows why they do not run",
    c.REASON_ROLLING_OUT: "wait: the agents are being updated one maxUnavailable at a time",
    c.REASON_NODES_FAILED: "see the failing nodes below, and `metaroce doctor --node <node>`",
    c.REASON_NODES_UNHEALTHY: "the RDMA probes between nodes fail: check the switch ports and "
    "cables of the nodes below, and `metaroce test-rdma --nodes A,B`",
    c.REASON_INVALID_SPEC: "fix the field the message names (`kubectl edit mrn <network>`)",
    c.REASON_NIC_CONFLICT: "two networks claim the same NIC: make their spec.nics disjoint",
    c.REASON_RENDER_FAILED: "read the operator's log (`kubectl logs deploy/<release>-metaroce`)",
    c.REASON_AGENT_IMAGE_NOT_ALLOWED: "remove spec.agent.image, or add the image to the chart's "
    "agent.allowedImages",
    c.REASON_CLEANUP_TIMED_OUT: "the agents did not report their nodes reverted: see the nodes "
    "below; if the operator is gone, remove the finalizer (README: Uninstalling)",
    c.REASON_LOSSY_ON_GO_BACK_N: "a lossy profile needs a transport that recovers from loss: use "
    "qos.profile lossless for RoCEv2/SoftRoCE, or transport.mode metaroce",
}
STEP_FIXES: tuple[tuple[str, str], ...] = (
    ("primary", "the NIC carries the node's default route or InternalIP: choose other NICs in "
     "spec.nics, or set spec.nics.allowPrimaryInterface: true if the RDMA network runs there"),
    ("apply", "the step failed and the node was rolled back to its last verified state: "
     "`metaroce doctor --node {node}` shows the device and the fix"),
    ("rollback", "undoing a step failed: the node may be half-configured; "
     "`metaroce doctor --node {node}`"),
    ("journal", "the agent cannot write its journal under /run/metaroce: check the node's disk"),
    ("nics", "no NIC of the node matches spec.nics: compare with "
     "`kubectl get mrns <network>.{node} -o yaml` (status.inventory)"),
    ("transport", "`metaroce doctor --node {node}` shows the RDMA devices, ports and GIDs"),
)  # fmt: skip
GOOD_STATUS = {"Ready": "True", "Progressing": "False", c.CONDITION_DEGRADED: "False"}
DEFAULT_STEP_FIX = "`metaroce doctor --node {node}` shows the node's devices and the fix for each"


def step_fix(step: str, node: str) -> str | None:
    """What to do about an agent error of `step` (None for notes that are no error)."""
    if step == "retry":
        return None
    for word, fix in STEP_FIXES:
        if word in step:
            return fix.format(node=node)
    return DEFAULT_STEP_FIX.format(node=node)


def _conditions(obj: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(k.get("type")): dict(k) for k in (obj.get("status") or {}).get("conditions") or []}


def is_ready(network: Mapping[str, Any]) -> bool:
    return _conditions(network).get("Ready", {}).get("status") == "True"


def overview(networks: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per network: ready, nodes, transport, the reason when not ready."""
    if not networks:
        return ["no MetaRoceNetwork in this cluster (samples/ has some to start from)"]
    lines = [f"{'NETWORK':<24} {'READY':<6} {'NODES':<9} {'TRANSPORT':<10} REASON"]
    for net in sorted(networks, key=lambda n: str(n["metadata"]["name"])):
        status = net.get("status") or {}
        ready = _conditions(net).get("Ready", {})
        nodes = status.get("nodes") or {}
        mode = ((net.get("spec") or {}).get("transport") or {}).get("mode", "auto")
        lines.append(
            f"{net['metadata']['name']:<24} {ready.get('status', 'Unknown'):<6} "
            f"{nodes.get('configured', 0)}/{nodes.get('desired', 0):<7} {mode:<10} "
            f"{'' if ready.get('status') == 'True' else ready.get('reason', 'not reported yet')}"
        )
    return lines


def network_report(
    network: Mapping[str, Any], nodestates: Sequence[Mapping[str, Any]]
) -> list[str]:
    """The network, its conditions with a fix for each bad one, and every node."""
    name = str(network["metadata"]["name"])
    status = network.get("status") or {}
    nodes = status.get("nodes") or {}
    mode = ((network.get("spec") or {}).get("transport") or {}).get("mode", "auto")
    generation = network["metadata"].get("generation")
    observed = status.get("observedGeneration")
    lines = [
        f"network {name}: transport {mode}, nodes desired {nodes.get('desired', 0)}, "
        f"configured {nodes.get('configured', 0)}, healthy {nodes.get('healthy', 0)}, "
        f"failed {nodes.get('failed', 0)}"
    ]
    if network["metadata"].get("deletionTimestamp"):
        lines.append("  being deleted (cleanupOnDelete: waiting for the agents to revert nodes)")
    if observed != generation:
        lines.append(
            f"  the operator has not seen generation {generation} yet (observed: {observed}): "
            "is it running? `metaroce version` shows where"
        )
    conditions = _conditions(network)
    if not conditions:
        lines.append("  no conditions yet: the operator has not reconciled this network")
    for kind in ("Ready", "Progressing", c.CONDITION_DEGRADED):
        cond = conditions.get(kind)
        if cond is None:
            continue
        bad = cond.get("status") != GOOD_STATUS[kind]
        lines.append(
            f"  {kind}={cond.get('status')} {cond.get('reason', '')}: {cond.get('message', '')}"
        )
        fix = CONDITION_FIXES.get(str(cond.get("reason")))
        if bad and fix:
            lines.append(f"    fix: {fix}")
    lines.append("nodes:")
    states = sorted(nodestates, key=lambda s: str((s.get("spec") or {}).get("node", "")))
    if not states:
        lines.append("  no NodeState yet: no agent of this network has reported")
    failing = {str(f.get("node")): f for f in status.get("failingNodes") or []}
    for state in states:
        node = str((state.get("spec") or {}).get("node", "?"))
        st = state.get("status") or {}
        transport = st.get("transport") or {}
        probe = st.get("probe") or {}
        devices = ", ".join(
            f"{d.get('rdmaDevice') or '-'}/{d.get('netdev')} {d.get('portState') or ''}".strip()
            for d in st.get("inventory") or []
        )
        health = {True: "probe ok", False: "probe FAILING", None: "probe -"}[probe.get("healthy")]
        lines.append(
            f"  {node:<20} {st.get('phase', 'Pending'):<9} transport "
            f"{'ready' if transport.get('ready') else 'not ready'}, {health}"
            + (f", devices {devices}" if devices else "")
        )
        if transport.get("message") and not transport.get("ready"):
            lines.append(f"    transport: {transport['message']}")
        for err in st.get("errors") or []:
            step = str(err.get("step", ""))
            lines.append(f"    {step}: {err.get('message', '')}")
            fix = step_fix(step, node)
            if fix:
                lines.append(f"    fix: {fix}")
        for peer in probe.get("peers") or []:
            if not peer.get("reachable", True) or peer.get("message"):
                lines.append(
                    f"    probe to {peer.get('node')}: {peer.get('message', 'unreachable')}"
                )
        for skip in (st.get("qos") or {}).get("skipped") or []:
            lines.append(f"    skipped {skip.get('name')} on {skip.get('device') or 'node'}: "
                         f"{skip.get('reason', '')}")  # fmt: skip
        failing.pop(node, None)
    for node, f in sorted(failing.items()):  # failing without a NodeState (no agent report)
        lines.append(f"  {node:<20} failing: {f.get('reason')}: {f.get('message', '')}")
        lines.append(f"    fix: {DEFAULT_STEP_FIX.format(node=node)}")
    return lines


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="metaroce status", description=__doc__.split("\n\n")[0])
    p.add_argument("network", nargs="?", help="one network (default: an overview of all)")
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    args = p.parse_args(list(argv))
    client, why = connect(args.kubeconfig)
    if client is None:
        print(f"metaroce status: {why}")
        return 2
    from metaroce_agent.kube import KubeError, cluster_path

    try:
        if args.network is None:
            found = client.request("GET", cluster_path(c.GROUP, c.VERSION, c.NETWORK_PLURAL))
            networks = found.get("items") or []
            print("\n".join(overview(networks)))
            return 0 if all(is_ready(n) for n in networks) else 1
        network = client.get(cluster_path(c.GROUP, c.VERSION, c.NETWORK_PLURAL, args.network))
        if network is None:
            print(f"metaroce status: no MetaRoceNetwork {args.network!r} "
                  "(`kubectl get mrn` lists them)")  # fmt: skip
            return 2
        states = client.request(
            "GET",
            cluster_path(c.GROUP, c.VERSION, c.NODESTATE_PLURAL),
            params={"labelSelector": f"{c.NETWORK_LABEL}={args.network}"},
        )
    except KubeError as e:
        print(f"metaroce status: cannot ask the cluster: {e}")
        return 2
    finally:
        client.close()
    print("\n".join(network_report(network, states.get("items") or [])))
    return 0 if is_ready(network) else 1
