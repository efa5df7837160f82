"""Fixtures of the operator's fault tier: one real control plane per session (the
integration tier's harness, with its own nodes) and the integration tier's operator
support (tests/integration/operator/operator_env.py), reused, not copied."""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from metaroce_harness.cluster import FakeNode, LocalCluster, leftovers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "operator"))

from operator_env import OperatorEnv, apply_crds

NODES = [
    FakeNode("kwok-a1", labels={"harness.metaroce.io/pool": "a"}),
    FakeNode("kwok-a2", labels={"harness.metaroce.io/pool": "a"}),
    FakeNode("kwok-b1", labels={"harness.metaroce.io/pool": "b"}),
]


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    logging.getLogger("metaroce").setLevel(logging.INFO)
    local = LocalCluster(NODES)
    local.start()
    print(f"\n[harness] control plane ready in {local.ready_seconds:.1f} s ({local.log_dir})")
    try:
        apply_crds(local)
        yield local
    finally:
        local.stop()
        left = leftovers(os.getpid())
        assert not left, f"the harness left these behind after the session: {left}"


@pytest.fixture
def env(cluster: LocalCluster, tmp_path: Path) -> Iterator[OperatorEnv]:
    """A fresh agent namespace per run (the operator's Lease and Secret live there too)."""
    namespace = f"f-{secrets.token_hex(4)}"
    cluster.kubectl("create", "namespace", namespace)
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode:
        assert time.monotonic() < deadline, f"namespace {namespace} got no default ServiceAccount"
        time.sleep(0.2)
    e = OperatorEnv(cluster, namespace, tmp_path)
    try:
        yield e
    finally:
        e.teardown()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
