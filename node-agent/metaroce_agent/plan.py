"""Planning: a pure function from (agent config, inventory, capabilities) to ordered steps.

`make_plan` decides which NICs belong to the network, which transport runs them, and
which knob goes through which mechanism:

| knob          | DCB NIC (mlx5)            | no DCB, SoftRoCE         | no DCB, hardware |
|---------------|---------------------------|--------------------------|------------------|
| dscp-map      | dcb app dscp-prio         | (dscp-mark instead)      | skipped          |
| dscp-mark     |                           | tc clsact+flower+pedit   |                  |
| pfc           | dcb pfc                   | skipped (lossless)       | skipped          |
| ets           | dcb ets (when set)        | skipped                  | skipped          |
| ecn           | sysfs ecn/roce_{np,rp}    | skipped (rxe: no DCQCN)  | sysfs or skipped |
| cnp-marking   | sysfs ecn/roce_np/cnp_*   | skipped (no CNPs)        | sysfs or skipped |
| roce-tos/mode | rdma_cm configfs          | rdma_cm configfs         | rdma_cm configfs |
| mtu           | netlink (when set)        | netlink                  | netlink          |

MetaRoCE (a UDP transport in the jobs' processes) takes the DCB column where the NIC has
DCB (DSCP map, PFC off, ETS when set); without DCB, tc marks its UDP port range (as
destination and as source port) instead. Its ECN is ECT on its own sockets and marking
in the switches, so the NIC's ECN/CNP knobs are skipped as not applying, and it has no
rdma_cm settings.

Every knob the spec asks for and the node cannot set is a `Skip` with the reason; with
`qos.onUnsupported: error` the ones whose desired state does not hold anyway become
blocking errors, and nothing is applied. Steps are ordered so that what a later step
needs exists: MTU, transport (modules, rxe links), DCB, ECN, tc, rdma_cm configfs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from metaroce_agent.capabilities import Capabilities
from metaroce_agent.discover import Inventory, NetDevice
from metaroce_agent.modules import ModuleStep
from metaroce_agent.podnet import missing_block_message, multus_conf_step
from metaroce_agent.primary import primary_interface_errors
from metaroce_agent.qos.dcb import DcbAppStep, DcbEtsStep, DcbPfcStep
from metaroce_agent.qos.ecn import CnpStep, EcnStep
from metaroce_agent.qos.mtu import MtuStep
from metaroce_agent.qos.rocecm import RdmaCmDirStep, RoceModeStep, RoceTosStep
from metaroce_agent.qos.tcmark import (
    MARK_FAMILIES,
    ClsactStep,
    TcMarkStep,
    TcPortRangeMarkStep,
)
from metaroce_agent.steps import Step
from metaroce_agent.transport.base import Issue, Library, Mode, TransportDevice
from metaroce_agent.transport.select import driver_for
from metaroce_agent.transport.softroce import rxe_name
from metaroce_api import AgentConfig, NicSelector

QOS_KNOBS = (
    "dscp-map",
    "dscp-mark",
    "pfc",
    "ets",
    "ecn",
    "cnp-marking",
    "roce-tos",
    "roce-mode",
    "mtu",
)
"""Knobs that `--skip-knob` may turn off (reported as skipped, not as errors)."""


@dataclass(frozen=True)
class Skip:
    """A knob the plan does not set, and why."""

    knob: str
    device: str
    reason: str
    satisfied: bool = False
    """The desired state holds anyway (PFC off on a NIC without PFC), or the operator
    turned the knob off on purpose: never an error, even with onUnsupported: error."""


@dataclass(frozen=True)
class Plan:
    mode: Mode
    netdevs: tuple[str, ...] = ()
    steps: tuple[Step, ...] = ()
    skipped: tuple[Skip, ...] = ()
    errors: tuple[Issue, ...] = ()
    """Blocking: the engine applies nothing."""
    problems: tuple[Issue, ...] = ()
    """Non-blocking (a port down, a NIC without RDMA): applied, reported as Degraded."""
    devices: tuple[TransportDevice, ...] = ()
    transport_message: str = ""
    notes: tuple[str, ...] = field(default=())
    library: Library | None = None
    """metaroce: the library directory pods get."""

    @property
    def ok(self) -> bool:
        return not self.errors


# --- NIC selection -----------------------------------------------------------------------------


def _norm_id(value: str | None) -> str | None:
    if not value:
        return None
    v = value.lower()
    return v if v.startswith("0x") else f"0x{v}"


def netdev_matches(sel: NicSelector, nd: NetDevice, rdma_names: Iterable[str]) -> bool:
    """OR inside each list, AND across the lists that are set."""
    if sel.interface_names is not None and not any(
        fnmatchcase(nd.name, g) for g in sel.interface_names
    ):
        return False
    if sel.pci_vendor_ids is not None and _norm_id(nd.vendor_id) not in {
        _norm_id(v) for v in sel.pci_vendor_ids
    }:
        return False
    if sel.pci_device_ids is not None and _norm_id(nd.device_id) not in {
        _norm_id(v) for v in sel.pci_device_ids
    }:
        return False
    if sel.drivers is not None and nd.driver not in sel.drivers:
        return False
    names = list(rdma_names)
    return sel.rdma_devices is None or any(
        fnmatchcase(n, g) for n in names for g in sel.rdma_devices
    )


def select_netdevs(config: AgentConfig, inventory: Inventory) -> list[NetDevice]:
    """The netdevs of the network, in name order.

    With `rdmaDevices`, a netdev needs an RDMA device matching a glob; for SoftRoCE the
    rxe name the agent would create counts too, but only when a netdev-level list is set
    as well (a network never takes every NIC of a node).
    """
    sel = config.nics
    softroce = config.transport.mode == "softroce" or (
        config.transport.mode == "auto" and config.transport.allow_soft_roce_fallback
    )
    netdev_level = any(
        x is not None
        for x in (sel.interface_names, sel.pci_vendor_ids, sel.pci_device_ids, sel.drivers)
    )
    out = []
    for nd in inventory.netdevs:
        names = [d.name for d in inventory.rdma_on(nd.name)]
        if (
            softroce
            and netdev_level
            and not any(d.kind == "softroce" for d in inventory.rdma_on(nd.name))
        ):
            names.append(rxe_name(nd.name))
        if netdev_matches(sel, nd, names):
            out.append(nd)
    return sorted(out, key=lambda n: n.name)


# --- the plan ------------------------------------------------------------------------------------


def make_plan(
    config: AgentConfig,
    inventory: Inventory,
    caps: Capabilities,
    *,
    skip_knobs: Iterable[str] = (),
    primary: Mapping[str, tuple[str, ...]] | None = None,
    pod_block: str | None = None,
) -> Plan:
    """The ordered steps that bring this node to the network's desired state.

    `primary` maps the node's primary interfaces (default route, InternalIP) to why
    (`primary.primary_interfaces`); selecting one without `nics.allowPrimaryInterface`
    is a blocking error. None: the caller knows no such facts (fixture nodes).
    `pod_block`: this node's block of `podNetwork.subnet` (its node annotation), for
    the CNI configuration of a metaroce network whose pods get a secondary interface."""
    netdevs = select_netdevs(config, inventory)
    if not netdevs:
        return Plan(
            mode="none",
            errors=(
                Issue(
                    "select nics",
                    "spec.nics selects no network interface on this node (it has "
                    f"{', '.join(n.name for n in inventory.netdevs) or 'none'}): fix "
                    "interfaceNames/pciVendorIds/pciDeviceIds/drivers/rdmaDevices, or "
                    "exclude this node with spec.nodeSelector",
                ),
            ),
        )
    refused = primary_interface_errors(
        netdevs, primary or {}, allowed=config.nics.allow_primary_interface
    )
    if refused:
        return Plan(mode="none", netdevs=tuple(n.name for n in netdevs), errors=tuple(refused))
    driver, why, blocking = driver_for(config, inventory, netdevs)
    if driver is None:
        assert blocking is not None
        return Plan(
            mode="none", netdevs=tuple(n.name for n in netdevs), errors=(blocking,), notes=(why,)
        )
    tplan = driver.plan(config, inventory, caps, netdevs)
    if tplan.errors:
        return Plan(
            mode=tplan.mode,
            netdevs=tuple(n.name for n in netdevs),
            errors=tplan.errors,
            transport_message=tplan.message,
            notes=(why, *tplan.notes),
        )
    steps: list[Step] = []
    skipped: list[Skip] = []
    pod_network = config.pod_network
    if tplan.mode == "metaroce" and pod_network is not None and pod_network.secondary:
        if pod_block is None:
            return Plan(
                mode=tplan.mode,
                netdevs=tuple(n.name for n in netdevs),
                errors=(Issue("pod network", missing_block_message(config.network)),),
                transport_message=tplan.message,
                notes=(why, *tplan.notes),
            )
        try:
            conf_step = multus_conf_step(config, netdevs[0].name, pod_block)
        except ValueError as e:
            return Plan(
                mode=tplan.mode,
                netdevs=tuple(n.name for n in netdevs),
                errors=(Issue("pod network", f"{e}: the operator re-assigns it; wait"),),
                transport_message=tplan.message,
                notes=(why, *tplan.notes),
            )
    else:
        conf_step = None

    if config.transport.mtu is not None:
        steps += [MtuStep(nd.name, mtu=config.transport.mtu) for nd in netdevs]
    steps += tplan.steps
    if conf_step is not None:
        steps.append(conf_step)  # after the MTU: macvlan/ipvlan children take the master's
    served = [d for d in tplan.devices if d.rdma_device]
    software_netdevs = {d.netdev for d in served if d.kind == "softroce"}
    for nd in netdevs:
        if tplan.mode == "metaroce":
            nsteps, nskips = _metaroce_qos(config, nd, caps)
        else:
            nsteps, nskips = _netdev_qos(config, nd, caps, software=nd.name in software_netdevs)
        steps += nsteps
        skipped += nskips
    csteps, cskips = _rdma_cm(config, served, caps)
    steps += csteps
    skipped += cskips

    skip = set(skip_knobs)
    if skip:
        kept = []
        for s in steps:
            if s.knob in skip:
                skipped.append(
                    Skip(s.knob, s.device, f"turned off with --skip-knob {s.knob}", True)
                )
            else:
                kept.append(s)
        steps = _drop_orphan_helpers(kept)

    errors: list[Issue] = []
    if config.qos.on_unsupported == "error":
        errors += [
            Issue(
                f"qos {s.knob} on {s.device}" if s.device else f"qos {s.knob}",
                f"{s.reason}; qos.onUnsupported is error: set it to skip to run without "
                f"{s.knob}, or select NICs that support it",
            )
            for s in skipped
            if not s.satisfied
        ]
    return Plan(
        mode=tplan.mode,
        netdevs=tuple(n.name for n in netdevs),
        steps=tuple(steps),
        skipped=tuple(skipped),
        errors=tuple(errors),
        problems=tplan.problems,
        devices=tplan.devices,
        transport_message=tplan.message,
        notes=(why, *tplan.notes),
        library=tplan.library,
    )


def _drop_orphan_helpers(steps: list[Step]) -> list[Step]:
    """Remove helper steps (clsact, configfs dirs) whose knob steps were skipped."""
    marks = {s.device for s in steps if isinstance(s, TcMarkStep | TcPortRangeMarkStep)}
    cm = {s.device for s in steps if isinstance(s, RoceTosStep | RoceModeStep)}
    out = []
    for s in steps:
        if isinstance(s, ClsactStep) and s.device not in marks:
            continue
        if isinstance(s, RdmaCmDirStep) and s.device not in cm:
            continue
        if isinstance(s, ModuleStep) and s.device == "rdma_cm" and not cm:
            continue
        out.append(s)
    return out


def _netdev_qos(
    config: AgentConfig, nd: NetDevice, caps: Capabilities, *, software: bool
) -> tuple[list[Step], list[Skip]]:
    q = config.qos
    c = caps.of(nd.name)
    dev = nd.name
    steps: list[Step] = []
    skips: list[Skip] = []
    if q.profile == "custom":
        pfc = sorted(q.pfc_priorities) if q.pfc_priorities is not None else None
        ecn: bool = q.ecn
    else:
        pfc = q.effective_pfc_priorities()
        ecn = True
    entries = ((q.data.dscp, q.data.priority), (q.cnp.dscp, q.cnp.priority))
    no_dcb = c.dcb_reason or f"{dev} has no DCB"

    if software:
        # rxe packets go through the kernel stack: mark them there, DCB NIC or not
        if caps.tc:
            steps.append(ClsactStep(dev))
            steps.append(
                TcMarkStep(
                    dev,
                    dscp=q.data.dscp,
                    priority=q.data.priority,
                    family=config.transport.roce.address_family,
                )
            )
        else:
            skips.append(Skip("dscp-mark", dev, "the tc tool is missing: install iproute2"))
    if c.dcb:
        steps += [DcbAppStep(dev, entries=(entry,)) for entry in entries]
        if pfc is not None:
            steps.append(DcbPfcStep(dev, enabled=tuple(pfc)))
        if q.ets:
            steps.append(
                DcbEtsStep(dev, shares=tuple((e.priority, e.bandwidth_percent) for e in q.ets))
            )
    else:
        if not software:
            skips.append(Skip("dscp-map", dev, f"{no_dcb}: cannot trust DSCP in the NIC"))
        if pfc:
            on = ",".join(map(str, pfc))
            skips.append(Skip("pfc", dev, f"{no_dcb}: PFC on priority {on} cannot be set"))
        elif pfc is not None:
            skips.append(Skip("pfc", dev, f"{no_dcb}: PFC is off already", satisfied=True))
        if q.ets:
            skips.append(Skip("ets", dev, f"{no_dcb}: ETS shares cannot be set"))

    if software:
        if ecn:
            skips.append(
                Skip(
                    "ecn",
                    dev,
                    "rdma_rxe implements no ECN reaction (no DCQCN): "
                    "only the switches' ECN marking applies",
                )
            )
        skips.append(Skip("cnp-marking", dev, "rdma_rxe sends no CNPs", satisfied=True))
    else:
        if c.ecn_sysfs:
            steps.append(EcnStep(dev, priority=q.data.priority, enable=ecn))
        elif ecn:
            skips.append(
                Skip(
                    "ecn",
                    dev,
                    f"{dev} ({nd.driver or 'unknown driver'}) exposes no "
                    "ECN knobs in sysfs: the firmware default applies",
                )
            )
        if ecn and c.cnp_sysfs:
            steps.append(CnpStep(dev, dscp=q.cnp.dscp, priority=q.cnp.priority))
        elif ecn:
            skips.append(Skip("cnp-marking", dev, f"{dev} exposes no CNP marking knobs in sysfs"))
    return steps, skips


def _metaroce_qos(
    config: AgentConfig, nd: NetDevice, caps: Capabilities
) -> tuple[list[Step], list[Skip]]:
    """The host part of the lossy profile for the MetaRoCE transport on one netdev."""
    q = config.qos
    c = caps.of(nd.name)
    dev = nd.name
    settings = config.transport.effective_metaroce()
    steps: list[Step] = []
    skips: list[Skip] = []
    pfc = sorted(q.pfc_priorities) if q.pfc_priorities is not None else None
    if q.profile != "custom":
        pfc = q.effective_pfc_priorities()
    if c.dcb:
        steps.append(DcbAppStep(dev, entries=((q.data.dscp, q.data.priority),)))
        if pfc is not None:
            steps.append(DcbPfcStep(dev, enabled=tuple(pfc)))
        if q.ets:
            steps.append(
                DcbEtsStep(dev, shares=tuple((e.priority, e.bandwidth_percent) for e in q.ets))
            )
    else:
        no_dcb = c.dcb_reason or f"{dev} has no DCB"
        if caps.tc:
            steps.append(ClsactStep(dev))
            steps += [
                TcPortRangeMarkStep(
                    dev,
                    match=match,
                    first=settings.port_range.first,
                    last=settings.port_range.last,
                    dscp=q.data.dscp,
                    priority=q.data.priority,
                    family=family,
                )
                for family in MARK_FAMILIES
                for match in ("dst", "src")
            ]
        else:
            skips.append(Skip("dscp-mark", dev, "the tc tool is missing: install iproute2"))
        if pfc:
            on = ",".join(map(str, pfc))
            skips.append(Skip("pfc", dev, f"{no_dcb}: PFC on priority {on} cannot be set"))
        elif pfc is not None:
            skips.append(Skip("pfc", dev, f"{no_dcb}: PFC is off already", satisfied=True))
        if q.ets:
            skips.append(Skip("ets", dev, f"{no_dcb}: ETS shares cannot be set"))
    skips.append(
        Skip(
            "ecn",
            dev,
            "MetaRoCE sets ECT on its own UDP sockets and reacts to CE itself; the NIC's "
            "ECN knobs drive hardware RoCE only: ECN marking is the switches'",
            satisfied=True,
        )
    )
    skips.append(Skip("cnp-marking", dev, "MetaRoCE sends no CNPs", satisfied=True))
    return steps, skips


def _rdma_cm(
    config: AgentConfig, served: list[TransportDevice], caps: Capabilities
) -> tuple[list[Step], list[Skip]]:
    steps: list[Step] = []
    skips: list[Skip] = []
    if not served:
        return steps, skips
    tos = config.qos.data.dscp << 2
    mode = "RoCE v2" if config.transport.roce.version == 2 else "IB/RoCE v1"
    if not caps.rocecm:
        why = (
            "rdma_cm configfs is unavailable: mount configfs at /sys/kernel/config and "
            "make the rdma_cm module loadable"
        )
        for d in served:
            skips.append(Skip("roce-tos", d.rdma_device, why))
            skips.append(Skip("roce-mode", d.rdma_device, why))
        return steps, skips
    if not caps.rdma_cm_configfs:
        steps.append(ModuleStep("rdma_cm"))
    seen: set[str] = set()
    for d in served:
        if d.rdma_device not in seen:
            steps.append(RdmaCmDirStep(d.rdma_device))
            seen.add(d.rdma_device)
        steps.append(RoceModeStep(d.rdma_device, port=d.port, mode=mode))
        steps.append(RoceTosStep(d.rdma_device, port=d.port, tos=tos))
    return steps, skips
