"""mlx5-style ECN knobs in sysfs (where the driver exposes them).

`/sys/class/net/<if>/ecn/roce_np/enable/<prio>` (notification point: send CNPs on CE
marks) and `.../roce_rp/enable/<prio>` (reaction point: DCQCN rate reduction), plus
`roce_np/cnp_dscp` and `roce_np/cnp_802p_prio` for CNP marking.
"""

from __future__ import annotations

from dataclasses import dataclass

from metaroce_agent.host import Host
from metaroce_agent.steps import Json, Step


def ecn_base(netdev: str) -> str:
    return f"/sys/class/net/{netdev}/ecn"


@dataclass(frozen=True)
class EcnStep(Step):
    """ECN notification and reaction point on one priority, on or off."""

    kind = "ecn"
    snapshot_is_state = True
    knob = "ecn"
    method = "sysfs"

    priority: int = 3
    enable: bool = True

    def id_suffix(self) -> str:
        return f":prio{self.priority}"

    def value(self) -> str:
        return f"{'on' if self.enable else 'off'} (priority {self.priority})"

    def _paths(self) -> dict[str, str]:
        base = ecn_base(self.device)
        return {point: f"{base}/{point}/enable/{self.priority}" for point in ("roce_np", "roce_rp")}

    def snapshot(self, host: Host) -> Json:
        return {point: host.read_opt(path) for point, path in self._paths().items()}

    def apply(self, host: Host) -> None:
        want = "1" if self.enable else "0"
        for path in self._paths().values():
            if host.read_opt(path) != want:
                host.write(path, want)

    def verify(self, host: Host) -> str | None:
        want = "1" if self.enable else "0"
        bad = [
            f"{point}={host.read_opt(path)}"
            for point, path in self._paths().items()
            if host.read_opt(path) != want
        ]
        if not bad:
            return None
        return f"ecn on {self.device} priority {self.priority}: {', '.join(bad)} (want {want})"

    def undo(self, host: Host, snapshot: Json) -> None:
        if not isinstance(snapshot, dict):
            return
        for point, path in self._paths().items():
            old = snapshot.get(point)
            if isinstance(old, str) and host.read_opt(path) != old:
                host.write(path, old)


@dataclass(frozen=True)
class CnpStep(Step):
    """DSCP and 802.1p priority of the CNPs the NIC sends."""

    kind = "cnp-marking"
    snapshot_is_state = True
    knob = "cnp-marking"
    method = "sysfs"

    dscp: int = 48
    priority: int = 6

    def value(self) -> str:
        return f"dscp {self.dscp} priority {self.priority}"

    def _paths(self) -> dict[str, tuple[str, str]]:
        base = f"{ecn_base(self.device)}/roce_np"
        return {
            "cnp_dscp": (f"{base}/cnp_dscp", str(self.dscp)),
            "cnp_802p_prio": (f"{base}/cnp_802p_prio", str(self.priority)),
        }

    def snapshot(self, host: Host) -> Json:
        return {k: host.read_opt(p) for k, (p, _) in self._paths().items()}

    def apply(self, host: Host) -> None:
        for path, want in self._paths().values():
            if host.read_opt(path) != want:
                host.write(path, want)

    def verify(self, host: Host) -> str | None:
        bad = [
            f"{k}={host.read_opt(p)} (want {w})"
            for k, (p, w) in self._paths().items()
            if host.read_opt(p) != w
        ]
        return f"cnp marking on {self.device}: {', '.join(bad)}" if bad else None

    def undo(self, host: Host, snapshot: Json) -> None:
        if not isinstance(snapshot, dict):
            return
        for k, (path, _) in self._paths().items():
            old = snapshot.get(k)
            if isinstance(old, str) and host.read_opt(path) != old:
                host.write(path, old)
