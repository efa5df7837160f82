"""SoftRoCE: load `rdma_rxe` and create one rxe link per selected netdev.

Idempotent: a netdev that already has an rxe link (under any name) is adopted and
reported, never given a second one (the kernel refuses that with `File exists`). Revert
deletes only links the agent created, and only when no process holds them open; the
`rdma_rxe` module is never unloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from metaroce_agent.capabilities import Capabilities
from metaroce_agent.discover import Inventory, NetDevice
from metaroce_agent.host import Host
from metaroce_agent.modules import ModuleStep
from metaroce_agent.steps import Json, Step, StepError
from metaroce_agent.transport.base import Issue, TransportDevice, TransportDriver, TransportPlan
from metaroce_api import AgentConfig


def rxe_name(netdev: str) -> str:
    """Name of the rxe link the agent creates on `netdev`."""
    return f"rxe_{netdev}"


def rdma_links(host: Host) -> list[dict[str, object]]:
    res = host.run(["rdma", "-j", "link", "show"], check=False)
    if not res.ok:
        return []
    try:
        data = json.loads(res.stdout or "[]")
    except ValueError:
        return []
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def _uverbs_paths(host: Host, device: str) -> list[str]:
    paths = []
    for uv in host.listdir("/sys/class/infiniband_verbs"):
        if host.read_opt(f"/sys/class/infiniband_verbs/{uv}/ibdev") == device:
            paths.append(f"/dev/infiniband/{uv}")
    return paths


def holders(host: Host, device: str) -> dict[int, str]:
    """Processes in the agent's view (/proc) holding the verbs char device of `device`
    open, the agent itself left out: names for the message, when it can see them."""
    own = os.getpid()
    return {p: c for p, c in host.pids_holding(_uverbs_paths(host, device)).items() if p != own}


def other_contexts(host: Host, device: str) -> int | None:
    """Verbs contexts open on `device` by processes other than the agent: the kernel's
    count (`rdma res show` counts every context whatever the caller's PID namespace, as
    seen on the guests' 6.1 kernel), less the agent's own open uverbs descriptors. None
    when iproute2 cannot say (an old `rdma` without `res`)."""
    res = host.run(["rdma", "-j", "res", "show"], check=False)
    if not res.ok:
        return None
    try:
        data = json.loads(res.stdout or "[]")
    except ValueError:
        return None
    ctx = next(
        (int(d.get("ctx", 0)) for d in data if isinstance(d, dict) and d.get("ifname") == device),
        0,
    )
    mine = host.own_fds_holding(_uverbs_paths(host, device))
    return max(0, ctx - mine)


@dataclass(frozen=True)
class RxeLinkStep(Step):
    """`rdma link add <device> type rxe netdev <netdev>` (the step's device is the rxe name)."""

    kind = "rxe-link"
    snapshot_is_state = True
    knob = "rxe-link"
    method = "rdma"

    netdev: str = ""

    def value(self) -> str:
        return f"rxe on {self.netdev}"

    def _exists(self, host: Host) -> bool:
        return host.exists(f"/sys/class/infiniband/{self.device}")

    def snapshot(self, host: Host) -> Json:
        return {"existed": self._exists(host)}

    def apply(self, host: Host) -> None:
        if self._exists(host):
            return
        host.run(["rdma", "link", "add", self.device, "type", "rxe", "netdev", self.netdev])

    def verify(self, host: Host) -> str | None:
        if not self._exists(host):
            return f"rxe link {self.device} on {self.netdev} is missing"
        parent = host.read_opt(f"/sys/class/infiniband/{self.device}/parent")
        if parent is not None and parent != self.netdev:
            return f"rxe link {self.device} sits on {parent}, want {self.netdev}"
        return None

    def undo(self, host: Host, snapshot: Json) -> None:
        if not (isinstance(snapshot, dict) and snapshot.get("existed") is False):
            return  # adopted: it was there before the agent
        if not self._exists(host):
            return
        # Who holds it: the kernel's context count sees through PID namespaces (so the
        # agent needs no hostPID); /proc adds names where the agent can see them.
        contexts = other_contexts(host, self.device)
        busy = holders(host, self.device)
        if busy or contexts:
            users = ", ".join(f"{pid} ({comm})" for pid, comm in sorted(busy.items()))
            count = f"{contexts} verbs context(s) of other processes" if contexts else ""
            held = "; ".join(x for x in (count, f"held open by {users}" if users else "") if x)
            raise StepError(
                f"rxe link {self.device} left in place: {held}; stop those processes "
                f"(`rdma res show pd` on the node names them), then run `rdma link delete "
                f"{self.device}`"
            )
        host.run(["rdma", "link", "delete", self.device])


class SoftRoceDriver(TransportDriver):
    mode = "softroce"

    def plan(
        self,
        config: AgentConfig,
        inventory: Inventory,
        caps: Capabilities,
        netdevs: list[NetDevice],
    ) -> TransportPlan:
        errors = []
        if not (caps.rxe_loaded or caps.rxe_loadable):
            errors.append(
                Issue(
                    "transport softroce",
                    "kernel module rdma_rxe is not available on this node: install the "
                    "kernel's extra modules package, or use transport.mode rocev2",
                )
            )
        if not caps.rdma_tool:
            errors.append(
                Issue(
                    "transport softroce",
                    "the `rdma` tool is missing: install iproute2 in the agent image",
                )
            )
        steps: list[Step] = [
            ModuleStep("rdma_rxe"),
            ModuleStep("ib_uverbs"),
            ModuleStep("rdma_ucm"),
        ]
        devices = []
        notes = []
        for nd in netdevs:
            existing = [d for d in inventory.rdma_on(nd.name) if d.kind == "softroce"]
            hardware = [d for d in inventory.rdma_on(nd.name) if d.kind == "hardware"]
            if hardware:
                notes.append(
                    f"{nd.name} has hardware RDMA ({hardware[0].name}): SoftRoCE added beside it"
                )
            name = existing[0].name if existing else rxe_name(nd.name)
            if existing and name != rxe_name(nd.name):
                notes.append(f"adopted existing rxe link {name} on {nd.name}")
            steps.append(RxeLinkStep(name, netdev=nd.name))
            devices.append(TransportDevice(nd.name, name, "softroce"))
        msg = "SoftRoCE (rdma_rxe) on " + (
            ", ".join(f"{d.netdev} as {d.rdma_device}" for d in devices) or "no netdev"
        )
        if notes:
            msg += "; " + "; ".join(notes)
        return TransportPlan(
            mode="softroce",
            steps=tuple(steps),
            devices=tuple(devices),
            errors=tuple(errors),
            message=msg,
            notes=tuple(notes),
        )
