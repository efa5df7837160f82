"""Netdev MTU through netlink (read back from sysfs)."""

from __future__ import annotations

from dataclasses import dataclass

from metaroce_agent.host import Host
from metaroce_agent.steps import Json, Step, StepError


@dataclass(frozen=True)
class MtuStep(Step):
    kind = "mtu"
    snapshot_is_state = True
    knob = "mtu"
    method = "netlink"

    mtu: int = 1500

    def value(self) -> str:
        return str(self.mtu)

    def _current(self, host: Host) -> int | None:
        return host.read_int(f"/sys/class/net/{self.device}/mtu")

    def snapshot(self, host: Host) -> Json:
        return self._current(host)

    def apply(self, host: Host) -> None:
        if self._current(host) != self.mtu:
            host.netlink.set_mtu(self.device, self.mtu)

    def verify(self, host: Host) -> str | None:
        cur = self._current(host)
        return None if cur == self.mtu else f"mtu of {self.device} is {cur}, want {self.mtu}"

    def undo(self, host: Host, snapshot: Json) -> None:
        if isinstance(snapshot, int) and self._current(host) not in (None, snapshot):
            try:
                host.netlink.set_mtu(self.device, snapshot)
            except Exception as e:
                raise StepError(f"cannot restore mtu {snapshot} on {self.device}: {e}") from e
