"""`metaroce doctor`: what this node has, how its QoS is set, what is wrong and the fix.

`examine` gathers the facts (discovery, capabilities, the kernel pieces RDMA needs and,
with an agent config, the plan read back knob by knob: nothing is changed); `render`
prints them; `Finding`s with severity `problem` make the node not ready (exit 1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from metaroce_agent.capabilities import Capabilities, probe_capabilities
from metaroce_agent.discover import DiscoveryError, Inventory, discover
from metaroce_agent.host import Host
from metaroce_agent.plan import Plan, make_plan, select_netdevs
from metaroce_agent.primary import primary_interfaces, read_primary_facts
from metaroce_agent.qos import dcb as dcbq
from metaroce_agent.qos.rocecm import RDMA_CM
from metaroce_agent.qos.tcmark import FILTER_PREF, filters, marking_of
from metaroce_api import AgentConfig


@dataclass(frozen=True)
class Finding:
    severity: Literal["problem", "warning"]
    what: str
    fix: str


@dataclass
class Examination:
    node: str
    root: str
    inventory: Inventory
    caps: Capabilities
    qos: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per netdev / RDMA device: knob -> current value as read."""
    plan: Plan | None = None
    knobs: dict[str, str | None] = field(default_factory=dict)
    """Planned step -> None (holds) or what differs."""
    findings: list[Finding] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not any(f.severity == "problem" for f in self.findings)


def _read_qos(
    host: Host, inv: Inventory, netdevs: list[str], caps: Capabilities
) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for nd in netdevs:
        q: dict[str, str] = {}
        c = caps.of(nd)
        if c.dcb:
            try:
                q["dcb app dscp-prio"] = (
                    " ".join(f"{d}:{p}" for d, p in dcbq.read_dscp_prio(host, nd)) or "(empty)"
                )
                pfc = dcbq.read_pfc(host, nd)
                q["dcb pfc"] = ",".join(str(i) for i, on in enumerate(pfc) if on) or "off"
            except Exception as e:
                q["dcb"] = f"unreadable: {e}"
        else:
            q["dcb"] = f"not supported ({c.dcb_reason})"
        if c.ecn_sysfs:
            vals = [
                host.read_opt(f"/sys/class/net/{nd}/ecn/roce_np/enable/{p}") or "?"
                for p in range(8)
            ]
            q["ecn roce_np enable[0..7]"] = "".join(vals)
        if caps.tc:
            try:
                marks = [f for f in filters(host, nd, "egress") if f.get("pref") == FILTER_PREF]
            except Exception:
                marks = []
            if marks:
                tos, prio, port = marking_of(marks[0])
                q["tc marking"] = (
                    f"udp dst_port {port} -> tos {'?' if tos is None else hex(tos)} "
                    f"(dscp {'?' if tos is None else tos >> 2}), priority {prio}"
                )
            else:
                q["tc marking"] = "none"
        out[nd] = q
    for dev in inv.rdma_devices:
        q = {}
        for rport in dev.ports:
            base = f"{RDMA_CM}/{dev.name}/ports/{rport.num}"
            cm_tos = host.read_opt(f"{base}/default_roce_tos")
            cm_mode = host.read_opt(f"{base}/default_roce_mode")
            if cm_tos is None and cm_mode is None:
                q[f"rdma_cm port {rport.num}"] = "defaults (no configfs entry)"
            else:
                q[f"rdma_cm port {rport.num}"] = (
                    f"default_roce_tos {cm_tos}, default_roce_mode {cm_mode}"
                )
        out[dev.name] = q
    return out


def examine(
    host: Host, config: AgentConfig | None, node: str, *, require_pyverbs: bool = False
) -> Examination:
    findings: list[Finding] = []
    try:
        inv = discover(host, require_pyverbs=require_pyverbs)
    except DiscoveryError as e:
        inv = discover(host)
        findings.append(
            Finding(
                "problem", str(e), "install Debian's python3-pyverbs and run with Debian's python3"
            )
        )
    for w in inv.warnings:
        findings.append(
            Finding("warning", w, "install python3-pyverbs (rdma-core) for full discovery")
        )
    netdevs = (
        [n.name for n in select_netdevs(config, inv)]
        if config
        else sorted({d.netdev for d in inv.rdma_devices if d.netdev})
    )
    caps = probe_capabilities(host, inv, netdevs)
    ex = Examination(node=node, root=str(host.root), inventory=inv, caps=caps)

    if not inv.rdma_devices:
        findings.append(
            Finding(
                "problem",
                "no RDMA device on this node",
                "hardware: load the NIC's RDMA driver (e.g. `modprobe mlx5_ib`); SoftRoCE: "
                "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <if>` (or run the agent "
                "with transport.mode softroce)",
            )
        )
    for dev in inv.rdma_devices:
        for port in dev.ports:
            if not port.active:
                findings.append(
                    Finding(
                        "problem",
                        f"{dev.name} port {port.num} is {port.state} (physical {port.phys_state})",
                        f"bring {dev.netdev or 'its netdev'} up (`ip link set {dev.netdev} up`), "
                        "check cable and switch port",
                    )
                )
            if not port.roce_v2_gids("ipv4") and not port.roce_v2_gids("ipv6"):
                findings.append(
                    Finding(
                        "problem",
                        f"{dev.name} port {port.num} has no RoCE v2 GID",
                        f"give {dev.netdev or 'its netdev'} an IP address (`ip addr add ... dev "
                        f"{dev.netdev}`)",
                    )
                )
        if dev.uverbs is None or not host.exists(f"/dev/infiniband/{dev.uverbs}"):
            findings.append(
                Finding(
                    "problem",
                    f"{dev.name} has no verbs device node (/dev/infiniband/uverbsN)",
                    "`modprobe ib_uverbs`; in a container, mount /dev/infiniband and run "
                    "privileged",
                )
            )
    if inv.rdma_devices and not host.exists("/dev/infiniband/rdma_cm"):
        findings.append(
            Finding(
                "warning",
                "/dev/infiniband/rdma_cm is missing: rdma_cm applications (NCCL with "
                "NCCL_IB_* over rdma_cm, perftest -R) cannot connect",
                "`modprobe rdma_ucm`",
            )
        )
    if not caps.configfs_mounted:
        findings.append(
            Finding(
                "warning",
                "configfs is not mounted: rdma_cm default ToS/mode cannot be set",
                "`mount -t configfs none /sys/kernel/config`",
            )
        )
    ex.qos = _read_qos(host, inv, netdevs, caps)

    if config is not None:
        # no apiserver here: the InternalIP is unknown, the default routes still count
        primary = primary_interfaces(read_primary_facts(host, inv), inv.netdevs)
        plan = make_plan(config, inv, caps, primary=primary)
        ex.plan = plan
        for issue in plan.errors:
            findings.append(
                Finding("problem", f"{issue.where}: {issue.message}", "see the message")
            )
        for p in plan.problems:
            findings.append(Finding("problem", f"{p.where}: {p.message}", "see the message"))
        for s in plan.skipped:
            if not s.satisfied:
                findings.append(
                    Finding(
                        "warning",
                        f"{s.knob} on {s.device}: {s.reason}",
                        "nothing to do unless the network needs it: choose NICs that support it",
                    )
                )
        if plan.ok:
            for step in plan.steps:
                try:
                    ex.knobs[step.name] = step.verify(host)
                except Exception as err:
                    ex.knobs[step.name] = f"cannot read back: {err}"
            bad = [n for n, v in ex.knobs.items() if v is not None]
            if bad:
                findings.append(
                    Finding(
                        "problem",
                        f"{len(bad)} knob(s) of network {config.network} are not in the desired "
                        f"state: {', '.join(bad[:6])}{'...' if len(bad) > 6 else ''}",
                        "start the agent (`metaroce agent --config ...`) or wait one drift "
                        f"interval ({config.drift_interval}); a knob that keeps drifting is being "
                        "changed by something else on the node",
                    )
                )
    ex.findings = findings
    return ex


def render(ex: Examination) -> str:
    inv = ex.inventory
    lines = [f"MetaRoCE doctor on {ex.node} (root {ex.root})", f"discovery: {inv.source}"]
    lines.append("")
    lines.append("RDMA devices:")
    if not inv.rdma_devices:
        lines.append("  (none)")
    for dev in inv.rdma_devices:
        nd = inv.netdev(dev.netdev or "")
        where = (
            f"{nd.name} ({nd.driver or '?'}, {nd.pci_address or 'virtual'}, NUMA "
            f"{'-' if nd.numa_node is None else nd.numa_node}, "
            f"{'?' if nd.speed_mbps is None else nd.speed_mbps} Mb/s, mtu {nd.mtu})"
            if nd
            else (dev.netdev or "?")
        )
        lines.append(f"  {dev.name}  {dev.kind}  on {where}  fw {dev.fw_version or '?'}")
        for port in dev.ports:
            lines.append(
                f"    port {port.num}: {port.state} ({port.phys_state or '?'}), active MTU "
                f"{port.active_mtu or '?'}, {port.rate or ''}".rstrip(", ")
            )
            for g in port.gids:
                extra = f"  ipv4 {g.ipv4}" if g.ipv4 else ""
                lines.append(f"      gid {g.index:>3} {g.gid}  {g.type}{extra}")
    lines.append("")
    lines.append("Kernel and tools:")
    c = ex.caps
    rxe = "loaded" if c.rxe_loaded else ("loadable" if c.rxe_loadable else "missing")
    lines.append(
        f"  rdma_rxe {rxe}, "
        f"rdma_cm configfs {'yes' if c.rdma_cm_configfs else ('loadable' if c.rocecm else 'no')}, "
        f"tc {'yes' if c.tc else 'no'}, rdma tool {'yes' if c.rdma_tool else 'no'}"
    )
    lines.append("")
    lines.append("QoS as read now:")
    for name, q in ex.qos.items():
        lines.append(f"  {name}:")
        for k, v in q.items():
            lines.append(f"    {k}: {v}")
    if ex.plan is not None:
        lines.append("")
        lines.append(f"Network plan ({ex.plan.mode}; NICs {', '.join(ex.plan.netdevs) or 'none'}):")
        for step in ex.plan.steps:
            state = ex.knobs.get(step.name)
            mark = "ok " if step.name in ex.knobs and state is None else "-- "
            detail = "" if state is None else f"  <- {state}"
            if step.name not in ex.knobs:
                detail = "  (not checked)"
            lines.append(f"  {mark}{step.name} = {step.value()} [{step.method}]{detail}")
        for s in ex.plan.skipped:
            lines.append(f"  skip {s.knob} on {s.device}: {s.reason}")
    lines.append("")
    problems = [f for f in ex.findings if f.severity == "problem"]
    warnings = [f for f in ex.findings if f.severity == "warning"]
    if ex.findings:
        lines.append("Findings:")
        for f in problems + warnings:
            lines.append(f"  {'PROBLEM' if f.severity == 'problem' else 'warning'}: {f.what}")
            lines.append(f"    fix: {f.fix}")
        lines.append("")
    lines.append("READY" if ex.ready else f"NOT READY: {len(problems)} problem(s) (fixes above)")
    return "\n".join(lines)


def to_json(ex: Examination) -> str:
    data: dict[str, Any] = {
        "node": ex.node,
        "ready": ex.ready,
        "discovery": ex.inventory.source,
        "inventory": asdict(ex.inventory),
        "qos": ex.qos,
        "knobs": ex.knobs,
        "findings": [asdict(f) for f in ex.findings],
        "plan": None
        if ex.plan is None
        else {
            "mode": ex.plan.mode,
            "netdevs": list(ex.plan.netdevs),
            "steps": [s.name for s in ex.plan.steps],
            "skipped": [asdict(s) for s in ex.plan.skipped],
        },
    }
    return json.dumps(data, indent=2, default=str)


__all__ = ["Examination", "Finding", "examine", "render", "to_json"]
