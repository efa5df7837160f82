"""Fixtures of the operator's fault tier: one real control plane per session (the
integration tier's harness, with its own nodes) and the integration tier's operator
support (tests/integration/operator/operator_env.py), reused, not copied."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metaroce_harness.cluster import FakeNode, LocalCluster, fresh_namespace, session_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "operator"))

from operator_env import OperatorEnv, apply_crds

NODES = [
    FakeNode("kwok-a1", labels={"harness.metaroce.io/pool": "a"}),
    FakeNode("kwok-a2", labels={"harness.metaroce.io/pool": "a"}),
    FakeNode("kwok-b1", labels={"harness.metaroce.io/pool": "b"}),
]


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    with session_cluster(NODES) as local:
        apply_crds(local)
        yield local


@pytest.fixture
def env(cluster: LocalCluster, tmp_path: Path) -> Iterator[OperatorEnv]:
    """A fresh agent namespace per run (the operator's Lease and Secret live there too)."""
    namespace = fresh_namespace(cluster, "f")
    e = OperatorEnv(cluster, namespace, tmp_path)
    try:
        yield e
    finally:
        e.teardown()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
