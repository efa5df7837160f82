"""An in-process peer that speaks the kubelet's side of the device-plugin API (v1beta1).

It does what the kubelet's device manager does, over real gRPC on unix sockets:
- serves `v1beta1.Registration` on `<dir>/kubelet.sock`;
- on `Register`: checks the version and the extended-resource name, dials the plugin's
  socket `<dir>/<endpoint>`, calls `GetDevicePluginOptions`, then runs `ListAndWatch`
  in a thread and keeps the latest device list per resource;
- `restart()`: what a kubelet restart does: stop, delete every socket in the directory
  (the kubelet's CleanupPluginDirectory), listen on a new kubelet.sock;
- `allocate()` / `preferred()`: the calls the kubelet makes when admitting a pod.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from metaroce_agent.deviceplugin.api import api_pb2, api_pb2_grpc
from metaroce_agent.deviceplugin.podresources import podresources_pb2, podresources_pb2_grpc

SUPPORTED_VERSIONS = ("v1beta1",)


@dataclass
class Endpoint:
    resource: str
    socket: Path
    options: Any
    channel: grpc.Channel
    stub: Any
    devices: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    """ID -> (health, NUMA nodes), from the latest ListAndWatch message."""
    updates: int = 0
    ended: bool = False


class KubeletPeer:
    def __init__(self, socket_dir: Path) -> None:
        self.dir = socket_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sock = socket_dir / "kubelet.sock"
        self.lock = threading.Condition()
        self.endpoints: dict[str, Endpoint] = {}
        self.registrations: list[str] = []
        self.rejections: list[str] = []
        self._server: grpc.Server | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._cleanup_dir()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler(
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self._register,
                    request_deserializer=api_pb2.RegisterRequest.FromString,
                    response_serializer=api_pb2.Empty.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{self.sock}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait(2)
            self._server = None
        with self.lock:
            for ep in self.endpoints.values():
                ep.channel.close()
            self.endpoints.clear()
        with contextlib.suppress(FileNotFoundError):
            self.sock.unlink()

    def restart(self) -> None:
        """Like a kubelet restart: endpoints dropped, sockets deleted, new kubelet.sock."""
        self.stop()
        self.start()

    def _cleanup_dir(self) -> None:
        for path in self.dir.iterdir():
            if path.is_socket():
                path.unlink()

    # -- Registration service -----------------------------------------------------------

    def _register(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.version not in SUPPORTED_VERSIONS:
            self.rejections.append(f"version {request.version}")
            context.abort(grpc.StatusCode.UNKNOWN, f"unsupported version {request.version}")
        name = request.resource_name
        if "/" not in name or name.startswith(("kubernetes.io/", "requests.")):
            self.rejections.append(f"resource {name}")
            context.abort(grpc.StatusCode.UNKNOWN, f"invalid extended resource name {name}")
        socket = self.dir / request.endpoint
        channel = grpc.insecure_channel(f"unix:{socket}")
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
        except grpc.FutureTimeoutError:
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"cannot dial {socket}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
        with self.lock:
            old = self.endpoints.get(name)
            if old is not None and not old.ended and old.socket == socket:
                channel.close()
                context.abort(grpc.StatusCode.UNKNOWN, f"device plugin already connected: {socket}")
            ep = Endpoint(name, socket, options, channel, stub)
            self.endpoints[name] = ep
            self.registrations.append(name)
            self.lock.notify_all()
        threading.Thread(target=self._run, args=(ep,), daemon=True).start()
        return api_pb2.Empty()

    def _run(self, ep: Endpoint) -> None:
        try:
            for response in ep.stub.ListAndWatch(api_pb2.Empty()):
                devices = {
                    d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in response.devices
                }
                with self.lock:
                    ep.devices = devices
                    ep.updates += 1
                    self.lock.notify_all()
        except grpc.RpcError:
            pass
        finally:
            with self.lock:
                ep.ended = True
                self.lock.notify_all()

    # -- what tests look at ----------------------------------------------------------------

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                value = check()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
                self.lock.wait(min(left, 0.2))

    def endpoint(self, resource: str) -> Endpoint | None:
        ep = self.endpoints.get(resource)
        return ep if ep is not None and not ep.ended else None

    def devices(self, resource: str) -> dict[str, tuple[str, list[int]]]:
        with self.lock:
            ep = self.endpoint(resource)
            return dict(ep.devices) if ep else {}

    def healthy(self, resource: str) -> set[str]:
        return {i for i, (h, _) in self.devices(resource).items() if h == "Healthy"}

    def allocate(self, resource: str, *containers: list[str]) -> Any:
        ep = self.endpoint(resource)
        assert ep is not None, f"{resource} is not registered"
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
        )
        return ep.stub.Allocate(request, timeout=5)

    def preferred(
        self, resource: str, available: list[str], must: list[str], size: int
    ) -> list[str]:
        ep = self.endpoint(resource)
        assert ep is not None, f"{resource} is not registered"
        assert ep.options.get_preferred_allocation_available
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        )
        response = ep.stub.GetPreferredAllocation(request, timeout=5)
        return list(response.container_responses[0].deviceIDs)


class PodResourcesLister(podresources_pb2_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """The kubelet's PodResources `List`: answers with whatever `pods` holds."""

    def __init__(self) -> None:
        self.pods: list[Any] = []

    def List(self, request: Any, context: Any) -> Any:
        return podresources_pb2.ListPodResourcesResponse(pod_resources=self.pods)


@contextlib.contextmanager
def serve_pod_resources(prefix: str) -> Iterator[tuple[str, PodResourcesLister]]:
    """A PodResourcesLister over real gRPC on a unix socket in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        sock = str(Path(d) / "kubelet.sock")
        lister = PodResourcesLister()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(lister, server)
        server.add_insecure_port(f"unix://{sock}")
        server.start()
        try:
            yield sock, lister
        finally:
            server.stop(0)
