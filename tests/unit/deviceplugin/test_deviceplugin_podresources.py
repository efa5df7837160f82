"""The PodResources client against an in-process kubelet PodResourcesLister (real gRPC on a
unix socket), and which metaroce library versions the agent may remove."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet_peer import PodResourcesLister, serve_pod_resources

from metaroce_agent.deviceplugin import gen
from metaroce_agent.deviceplugin.podresources import (
    PodResourcesError,
    allocated_units,
    podresources_pb2,
)
from metaroce_agent.transport.library import versions_to_remove

RESOURCE = "metaroce.io/lossy"


def pod(name: str, *devices: tuple[str, list[str]]) -> Any:
    return podresources_pb2.PodResources(
        name=name,
        namespace="jobs",
        containers=[
            podresources_pb2.ContainerResources(
                name="train",
                devices=[
                    podresources_pb2.ContainerDevices(resource_name=r, device_ids=ids)
                    for r, ids in devices
                ],
            )
        ],
    )


@pytest.fixture
def kubelet() -> Iterator[tuple[str, PodResourcesLister]]:
    with serve_pod_resources("pr-") as served:
        yield served


def test_lists_the_units_of_one_resource(kubelet: tuple[str, PodResourcesLister]) -> None:
    sock, lister = kubelet
    assert allocated_units(RESOURCE, sock) == set()
    lister.pods = [
        pod("a", (RESOURCE, ["eth1-0", "eth2-1"]), ("nvidia.com/gpu", ["GPU-1"])),
        pod("b", ("metaroce.io/other", ["eth1-0"])),
        pod("c", (RESOURCE, ["eth1-3"])),
    ]
    assert allocated_units(RESOURCE, sock) == {"eth1-0", "eth2-1", "eth1-3"}


def test_no_kubelet_says_what_to_mount(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesError, match="mount /var/lib/kubelet/pod-resources"):
        allocated_units(RESOURCE, str(tmp_path / "none.sock"), timeout=1)


def test_versions_held_by_pods_stay_the_rest_go() -> None:
    v1, v2, v3 = (f"/run/metaroce/transport/lossy/0.1.{i}-x" for i in (1, 2, 3))
    records = {"eth1-0": v1, "eth1-1": v2, "eth1-2": v2}
    assert versions_to_remove([v1, v2, v3], v3, records, {"eth1-0"}) == ([v2], "")
    assert versions_to_remove([v1, v2, v3], v3, records, set()) == ([v1, v2], "")
    # a held unit without a record: keep everything
    kept, why = versions_to_remove([v1, v2, v3], v3, records, {"eth1-9"})
    assert kept == [] and "eth1-9" in why


def test_the_podresources_proto_copy_keeps_its_provenance_header() -> None:
    text = gen.PODRESOURCES_PROTO.read_text()
    head, marker, body = text.partition("// ---- upstream k8s.io/kubelet api.proto follows ----\n")
    assert marker and "Apache License, Version 2.0" in head and "k8s.io/kubelet@" in head
    assert "service PodResourcesLister" in body and "package v1;" in body
