"""The integration tier: a real control plane from the local harness, shared per session."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator

import pytest

from metaroce_harness.cluster import FakeNode, LocalCluster, leftovers

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
    logging.getLogger("metaroce").setLevel(logging.INFO)
    local = LocalCluster(BASE_NODES)
    local.start()
    print(f"\n[harness] control plane ready in {local.ready_seconds:.1f} s ({local.log_dir})")
    try:
        yield local
    finally:
        local.stop()
        left = leftovers(os.getpid())
        assert not left, f"the harness left these behind after the session: {left}"


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace per test (with its default ServiceAccount), deleted afterwards."""
    name = f"t-{secrets.token_hex(4)}"
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"namespace {name} got no default ServiceAccount"
        time.sleep(0.2)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
