"""The kubelet device plugin (API v1beta1, gRPC over unix sockets) of one network.

Lifecycle
---------
`DevicePlugin(config).start()` starts a supervisor thread and returns at once. The
supervisor does nothing until `update()` has given at least one device (a plugin that
registers before its devices exist advertises nothing, and the kubelet keeps a zero
capacity); from then on, every `poll_interval` (1 s) it checks:

- the kubelet's registration socket (`kubelet.sock`): when it is (re)created, which is
  what a kubelet restart does (the kubelet also deletes every other socket in the
  directory), or when our own socket is gone, it restarts its gRPC server on a fresh
  socket and registers again;
- a failed registration (kubelet not up yet, resource name still held by the old
  endpoint) is retried with a short backoff (1 s, 2 s, ... 10 s), forever.

So allocatable never stays at 0 after a kubelet restart, and a plugin started before its
devices (or before the kubelet) catches up by itself.

`update(devices)` replaces the device list and wakes every open `ListAndWatch` stream,
which sends the full list again (health and NUMA topology included). Sending the same
list twice is skipped.

Wiring (the agent loop)
-----------------------
    plugin = DevicePlugin(PluginConfig(resource_name=config.resource_name,
                                       pods_per_device=config.pods_per_device))
    plugin.start()
    ...after every discover/apply/verify pass, and on port events:
    plugin.update([PluginDevice(rdma_device="mlx5_0", uverbs="uverbs0", netdev="ens1f0",
                                numa_node=0, port_active=True, qos_verified=True,
                                gid_index=3), ...])
    ...on SIGTERM: plugin.stop()

`plugin.status()` returns what the NodeState can report (registered, advertised devices,
healthy units, last error).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from metaroce_agent.deviceplugin.api import api_pb2, api_pb2_grpc
from metaroce_agent.deviceplugin.devices import (
    DEVICE_ENV,
    AllocationError,
    ContainerAllocation,
    PluginDevice,
    Unit,
    allocate,
    index,
    preferred,
    units,
    with_stats_dir,
)
from metaroce_api import constants

log = logging.getLogger("metaroce.agent.deviceplugin")

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = Path(constants.DEVICE_PLUGIN_DIR)
KUBELET_SOCKET = "kubelet.sock"


def default_socket_name(resource_name: str) -> str:
    """`metaroce-<resource>.sock` with the resource name made file-name safe."""
    return (
        constants.DEVICE_PLUGIN_SOCKET_PREFIX
        + re.sub(r"[^A-Za-z0-9_.-]", "_", resource_name)
        + ".sock"
    )


@dataclass(frozen=True)
class PluginConfig:
    resource_name: str
    """The extended resource, e.g. `metaroce.io/backend` (the network's resourceName)."""
    pods_per_device: int = 1
    socket_dir: Path = DEVICE_PLUGIN_DIR
    socket_name: str | None = None
    """Our socket in `socket_dir`; default `default_socket_name(resource_name)`."""
    kubelet_socket: str = KUBELET_SOCKET
    device_env: frozenset[str] = DEVICE_ENV
    """Which per-device NCCL variables Allocate sets (from the network's ncclEnv)."""
    poll_interval: float = 1.0
    register_timeout: float = 10.0
    max_backoff: float = 10.0
    on_allocate: Callable[[tuple[str, ...], ContainerAllocation], None] | None = None
    """Called after every successful Allocate of a container (the agent records which
    library version each metaroce unit was handed)."""
    stats_dir_for: Callable[[tuple[str, ...]], str] | None = None
    """metaroce: a new stats directory (host path) for one container's units; Allocate
    mounts it read-write (`devices.with_stats_dir`). None = no stats directories."""

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / (self.socket_name or default_socket_name(self.resource_name))

    @property
    def kubelet_socket_path(self) -> Path:
        return self.socket_dir / self.kubelet_socket


@dataclass
class PluginStatus:
    registered: bool
    registrations: int
    devices: list[str]
    healthy_units: int
    total_units: int
    last_error: str | None = None
    unhealthy: dict[str, str] = field(default_factory=dict)
    """Device -> why it is not healthy."""


def _rpc_detail(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        text = details()
        code = getattr(exc, "code", None)
        return f"{code() if callable(code) else ''} {text}".strip()
    return "the kubelet socket did not answer in time"


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which file is at `path` now: inode numbers are reused at once, so the change time
    is part of it (a recreated socket has a new one)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class DevicePlugin:
    """One network's device plugin; see the module docstring."""

    def __init__(self, config: PluginConfig) -> None:
        if config.pods_per_device < 1:
            raise ValueError(
                f"pods_per_device is {config.pods_per_device}: set attachment.podsPerDevice >= 1"
            )
        self.config = config
        self._cond = threading.Condition()
        self._devices: tuple[PluginDevice, ...] = ()
        self._units: list[Unit] = []
        self._by_id: dict[str, Unit] = {}
        self._version = 0
        self._has_devices = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: grpc.Server | None = None
        self._server_identity: tuple[int, int, int] | None = None
        self._kubelet_identity: tuple[int, int, int] | None = None
        self._registered = False
        self._registrations = 0
        self._last_error: str | None = None
        self._registered_event = threading.Event()

    # -- inputs -------------------------------------------------------------------------

    def update(self, devices: Sequence[PluginDevice]) -> None:
        """Replace the device list; open ListAndWatch streams send it (if it changed)."""
        new = tuple(sorted(devices, key=lambda d: d.rdma_device))
        with self._cond:
            if new == self._devices and self._version > 0:
                return
            self._devices = new
            self._units = units(new, self.config.pods_per_device)
            self._by_id = index(self._units)
            self._version += 1
            if new:
                self._has_devices = True
            self._cond.notify_all()
        self._wake.set()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._supervise, name=f"deviceplugin-{self.config.resource_name}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and remove our socket (the kubelet then marks the devices unhealthy)."""
        self._stop.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._stop_server()

    def wait_registered(self, timeout: float) -> bool:
        """Block until the plugin is registered with the current kubelet (tests, start-up)."""
        return self._registered_event.wait(timeout)

    def status(self) -> PluginStatus:
        with self._cond:
            devices = list(self._devices)
            all_units = list(self._units)
        return PluginStatus(
            registered=self._registered,
            registrations=self._registrations,
            devices=[d.rdma_device for d in devices],
            healthy_units=sum(1 for u in all_units if u.device.healthy),
            total_units=len(all_units),
            last_error=self._last_error,
            unhealthy={d.rdma_device: d.why_unhealthy() for d in devices if not d.healthy},
        )

    # -- supervisor -----------------------------------------------------------------------

    def _supervise(self) -> None:
        backoff = 1.0
        next_try = 0.0
        while not self._stop.is_set():
            try:
                wait = self._check(next_try)
                if wait is None:
                    backoff = 1.0
                    next_try = 0.0
                elif wait > 0:
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, self.config.max_backoff)
            except Exception as exc:  # the supervisor must never die
                log.exception("device plugin %s: supervisor error", self.config.resource_name)
                self._last_error = f"supervisor: {exc}"
            self._wake.wait(self.config.poll_interval)
            self._wake.clear()

    def _check(self, next_try: float) -> float | None:
        """One supervisor pass. None = all fine; >0 = registration failed (back off)."""
        if not self._has_devices:
            return None
        kubelet = _identity(self.config.kubelet_socket_path)
        if kubelet is None:
            if self._registered:
                log.warning(
                    "device plugin %s: %s is gone (kubelet stopped); waiting for it",
                    self.config.resource_name,
                    self.config.kubelet_socket_path,
                )
            self._set_registered(False)
            return None
        own = _identity(self.config.socket_path)
        stale = (
            self._server is None
            or own is None
            or own != self._server_identity
            or kubelet != self._kubelet_identity
        )
        if not stale and self._registered:
            return None
        if time.monotonic() < next_try:
            return 0.0
        if stale:
            if self._registered:
                log.info(
                    "device plugin %s: kubelet restarted or our socket vanished; re-registering",
                    self.config.resource_name,
                )
            self._set_registered(False)
            self._start_server()
        try:
            self._register()
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            detail = _rpc_detail(exc)
            self._last_error = f"registering with the kubelet failed: {detail}"
            log.warning(
                "device plugin %s: %s; retrying", self.config.resource_name, self._last_error
            )
            return 1.0
        self._kubelet_identity = kubelet
        self._set_registered(True)
        self._registrations += 1
        self._last_error = None
        log.info(
            "device plugin %s registered with the kubelet (socket %s, %d units)",
            self.config.resource_name,
            self.config.socket_path,
            len(self._units),
        )
        return None

    def _set_registered(self, value: bool) -> None:
        self._registered = value
        if value:
            self._registered_event.set()
        else:
            self._registered_event.clear()

    def _start_server(self) -> None:
        self._stop_server()
        path = self.config.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="deviceplugin-rpc")
        )
        api_pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix:{path}")
        server.start()
        self._server = server
        self._server_identity = _identity(path)

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        with self._cond:
            self._cond.notify_all()
        server.stop(grace=0.5).wait(2.0)
        if self._server_identity is not None and _identity(self.config.socket_path) == (
            self._server_identity
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        self._server_identity = None

    def _register(self) -> None:
        target = f"unix:{self.config.kubelet_socket_path}"
        with grpc.insecure_channel(target) as channel:
            grpc.channel_ready_future(channel).result(timeout=self.config.register_timeout)
            stub = api_pb2_grpc.RegistrationStub(channel)
            stub.Register(
                api_pb2.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.config.socket_path.name,
                    resource_name=self.config.resource_name,
                    options=self.options(),
                ),
                timeout=self.config.register_timeout,
            )

    # -- what the servicer answers ------------------------------------------------------------

    @staticmethod
    def options() -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    def list_response(self) -> tuple[int, api_pb2.ListAndWatchResponse]:
        with self._cond:
            return self._version, _list_response(self._units)

    def wait_change(self, seen: int, timeout: float) -> bool:
        """Wait until the device list version differs from `seen`; True if it does."""
        with self._cond:
            if self._version == seen and not self._stop.is_set():
                self._cond.wait(timeout)
            return self._version != seen

    def lookup(self) -> dict[str, Unit]:
        with self._cond:
            return dict(self._by_id)


def _list_response(all_units: Sequence[Unit]) -> api_pb2.ListAndWatchResponse:
    out = []
    for unit in all_units:
        dev = api_pb2.Device(ID=unit.id, health=unit.health)
        numa = unit.device.numa
        if numa is not None:
            dev.topology.CopyFrom(api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=numa)]))
        out.append(dev)
    return api_pb2.ListAndWatchResponse(devices=out)


class _Servicer:
    """The DevicePlugin service (registered by method name, so no generated base class)."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self.plugin = plugin

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return self.plugin.options()

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        version, response = self.plugin.list_response()
        log.debug("ListAndWatch: sending %d units", len(response.devices))
        yield response
        while context.is_active() and not self.plugin._stop.is_set():
            if not self.plugin.wait_change(version, timeout=0.5):
                continue
            version, response = self.plugin.list_response()
            yield response

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        by_id = self.plugin.lookup()
        responses = [
            api_pb2.ContainerPreferredAllocationResponse(
                deviceIDs=preferred(
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                    by_id,
                )
            )
            for req in request.container_requests
        ]
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        by_id = self.plugin.lookup()
        cfg = self.plugin.config
        responses = []
        for req in request.container_requests:
            try:
                got = allocate(
                    list(req.devices_ids),
                    by_id,
                    resource_name=cfg.resource_name,
                    device_env=cfg.device_env,
                )
            except AllocationError as exc:
                log.warning("Allocate refused: %s", exc)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                raise  # abort raises; this keeps type checkers honest
            if cfg.stats_dir_for is not None and got.mounts:
                try:
                    got = with_stats_dir(got, cfg.stats_dir_for(tuple(req.devices_ids)))
                except Exception:  # no counters is better than no pod
                    log.exception("no stats directory for %s", list(req.devices_ids))
            if cfg.on_allocate is not None:
                try:
                    cfg.on_allocate(tuple(req.devices_ids), got)
                except Exception:  # a record that cannot be written must not fail the pod
                    log.exception("recording the allocation of %s failed", list(req.devices_ids))
            log.info(
                "Allocate %s: %s -> %s",
                cfg.resource_name,
                ",".join(req.devices_ids),
                ",".join(got.rdma_devices),
            )
            responses.append(
                api_pb2.ContainerAllocateResponse(
                    envs=dict(got.envs),
                    devices=[
                        api_pb2.DeviceSpec(
                            container_path=d.container_path,
                            host_path=d.host_path,
                            permissions=d.permissions,
                        )
                        for d in got.devices
                    ],
                    mounts=[
                        api_pb2.Mount(
                            container_path=m.container_path,
                            host_path=m.host_path,
                            read_only=m.read_only,
                        )
                        for m in got.mounts
                    ],
                )
            )
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()
