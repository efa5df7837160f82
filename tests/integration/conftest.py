"""The integration tier: a real control plane from the local harness, shared per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metaroce_harness.cluster import FakeNode, LocalCluster, fresh_namespace, session_cluster

# The session's base nodes; tests that need other shapes add their own with unique names.
BASE_NODES = [
    FakeNode(
        "kwok-a1", labels={"harness.metaroce.io/pool": "a"}, capacity={"example.com/widget": "2"}
    ),
    FakeNode("kwok-a2", labels={"harness.metaroce.io/pool": "a"}),
    FakeNode("kwok-b1", labels={"harness.metaroce.io/pool": "b"}),
]


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    with session_cluster(BASE_NODES) as local:
        yield local


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace per test (with its default ServiceAccount), deleted afterwards."""
    name = fresh_namespace(cluster, "t")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
