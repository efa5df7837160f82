"""Which units of a resource pods hold now: the kubelet's PodResources API (v1 `List`).

The kubelet serves it on `/var/lib/kubelet/pod-resources/kubelet.sock` (the agent
DaemonSet mounts that directory). The metaroce driver uses it to keep every transport
library version a pod may still be handed again: the kubelet re-uses its checkpointed
`Allocate` answer when a container restarts, so a version is in use as long as some pod
holds a unit it was allocated with.
"""

from __future__ import annotations

import importlib
from typing import Any

import grpc

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

podresources_pb2: Any = importlib.import_module("metaroce_agent.deviceplugin.podresources_pb2")
podresources_pb2_grpc: Any = importlib.import_module(
    "metaroce_agent.deviceplugin.podresources_pb2_grpc"
)


class PodResourcesError(RuntimeError):
    pass


def allocated_units(
    resource_name: str, socket: str = POD_RESOURCES_SOCKET, timeout: float = 5.0
) -> set[str]:
    """Device IDs of `resource_name` that containers on this node hold."""
    return set().union(*units_by_container(resource_name, socket, timeout).values())


def units_by_container(
    resource_name: str, socket: str = POD_RESOURCES_SOCKET, timeout: float = 5.0
) -> dict[tuple[str, str, str], frozenset[str]]:
    """(namespace, pod, container) -> the device IDs of `resource_name` it holds (only
    containers that hold some)."""
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = podresources_pb2_grpc.PodResourcesListerStub(channel)
            response = stub.List(podresources_pb2.ListPodResourcesRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise PodResourcesError(
            f"the kubelet's PodResources API at {socket} did not answer ({e.code().name}): "
            "mount /var/lib/kubelet/pod-resources into the agent"
        ) from e
    out: dict[tuple[str, str, str], frozenset[str]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            units = frozenset(
                unit
                for devices in container.devices
                if devices.resource_name == resource_name
                for unit in devices.device_ids
            )
            if units:
                out[(pod.namespace, pod.name, container.name)] = units
    return out
