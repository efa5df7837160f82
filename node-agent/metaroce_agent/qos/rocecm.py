"""rdma_cm configfs: `default_roce_tos` and `default_roce_mode` per RDMA device port.

`mkdir /sys/kernel/config/rdma_cm/<dev>` makes the kernel create `ports/<n>/`; rdma_cm
then uses these defaults for every connection that does not set its own ToS. Undo
writes the previous values back before removing a directory the agent created (the
kernel keeps the values it was given even after the directory goes).
"""

from __future__ import annotations

from dataclasses import dataclass

from metaroce_agent.host import Host
from metaroce_agent.steps import Json, Step

RDMA_CM = "/sys/kernel/config/rdma_cm"


@dataclass(frozen=True)
class RdmaCmDirStep(Step):
    kind = "rdma-cm-dir"
    snapshot_is_state = True
    knob = "rdma-cm-configfs"
    method = "configfs"
    report = False

    def value(self) -> str:
        return "present"

    def _dir(self) -> str:
        return f"{RDMA_CM}/{self.device}"

    def snapshot(self, host: Host) -> Json:
        return {"existed": host.is_dir(self._dir())}

    def apply(self, host: Host) -> None:
        if not host.is_dir(self._dir()):
            host.mkdir(self._dir())

    def verify(self, host: Host) -> str | None:
        return None if host.is_dir(self._dir()) else f"{self._dir()} is missing"

    def undo(self, host: Host, snapshot: Json) -> None:
        # only a directory that is there: on a read-only mount, rmdir of a missing one
        # fails (EROFS) where there is nothing to remove
        created = isinstance(snapshot, dict) and snapshot.get("existed") is False
        if created and host.is_dir(self._dir()):
            host.rmdir(self._dir())


@dataclass(frozen=True)
class _PortFileStep(Step):
    port: int = 1
    file = ""
    snapshot_is_state = True

    def id_suffix(self) -> str:
        return f":port{self.port}"

    def _path(self) -> str:
        return f"{RDMA_CM}/{self.device}/ports/{self.port}/{self.file}"

    def _want(self) -> str:
        raise NotImplementedError

    def snapshot(self, host: Host) -> Json:
        return host.read_opt(self._path())

    def apply(self, host: Host) -> None:
        if host.read_opt(self._path()) != self._want():
            host.write(self._path(), self._want())

    def verify(self, host: Host) -> str | None:
        cur = host.read_opt(self._path())
        if cur == self._want():
            return None
        shown = "missing" if cur is None else repr(cur)
        return f"{self._path()} is {shown}, want {self._want()!r}"

    def undo(self, host: Host, snapshot: Json) -> None:
        path = self._path()
        if isinstance(snapshot, str) and host.exists(path) and host.read_opt(path) != snapshot:
            host.write(path, snapshot)


@dataclass(frozen=True)
class RoceTosStep(_PortFileStep):
    """`default_roce_tos` = DSCP << 2 (ECN bits left to the transport)."""

    kind = "roce-tos"
    knob = "roce-tos"
    method = "configfs"
    file = "default_roce_tos"

    tos: int = 0

    def value(self) -> str:
        return f"{self.tos} (dscp {self.tos >> 2})"

    def _want(self) -> str:
        return str(self.tos)


@dataclass(frozen=True)
class RoceModeStep(_PortFileStep):
    """`default_roce_mode`: `RoCE v2` or `IB/RoCE v1`."""

    kind = "roce-mode"
    knob = "roce-mode"
    method = "configfs"
    file = "default_roce_mode"

    mode: str = "RoCE v2"

    def value(self) -> str:
        return self.mode

    def _want(self) -> str:
        return self.mode
