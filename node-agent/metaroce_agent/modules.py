"""Kernel modules: load what the plan needs; never unload (other users may rely on them)."""

from __future__ import annotations

from dataclasses import dataclass

from metaroce_agent.host import CommandError, Host
from metaroce_agent.steps import Json, Step, StepError


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
        if host.exists(f"/sys/module/{self.device}"):
            return
        try:
            host.run(["modprobe", self.device])
        except CommandError as e:
            raise StepError(
                f"{e}: the agent loads modules with the node's /lib/modules of the running "
                "kernel (mounted read-only) and kmod; where that is refused or the module is "
                f"missing, load it on the node: modprobe {self.device} (and list it in "
                "/etc/modules-load.d/ to survive a reboot)"
            ) from e

    def verify(self, host: Host) -> str | None:
        if host.exists(f"/sys/module/{self.device}"):
            return None
        return f"kernel module {self.device} is not loaded"

    def undo(self, host: Host, snapshot: Json) -> None:
        return None  # never unload a module: running jobs and other networks may use it
