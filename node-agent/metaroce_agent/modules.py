"""Kernel modules: load what the plan needs; never unload (other users may rely on them)."""

from __future__ import annotations

from dataclasses import dataclass

from metaroce_agent.host import Host
from metaroce_agent.steps import Json, Step


@dataclass(frozen=True)
class ModuleStep(Step):
    """`modprobe <module>`; undo does nothing: a module is shared by everything on the node."""

    kind = "kernel-module"
    knob = "kernel-module"
    method = "modprobe"
    report = False

    def value(self) -> str:
        return "loaded"

    def apply(self, host: Host) -> None:
        if not host.exists(f"/sys/module/{self.device}"):
            host.run(["modprobe", self.device])

    def verify(self, host: Host) -> str | None:
        if host.exists(f"/sys/module/{self.device}"):
            return None
        return f"kernel module {self.device} is not loaded"

    def undo(self, host: Host, snapshot: Json) -> None:
        return None  # never unload a module: running jobs and other networks may use it
