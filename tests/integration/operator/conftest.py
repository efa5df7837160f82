"""Fixtures of the operator's integration tests: CRDs, operator processes, load generators.

Networks are cluster-scoped, so every test deletes the networks it made (with its
operator still running, to honour finalizers) before the next test starts its own.
The support itself (`OperatorEnv`, `apply_crds`) is in operator_env.py, which the fault
tier (tests/fault/operator) imports too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metaroce_harness.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).parent))

from operator_env import AGENT_IMAGE as AGENT_IMAGE
from operator_env import OperatorEnv as OperatorEnv
from operator_env import apply_crds


@pytest.fixture(scope="session")
def crds(cluster: LocalCluster) -> None:
    apply_crds(cluster)


@pytest.fixture
def env(cluster: LocalCluster, namespace: str, crds: None, tmp_path: Path) -> Iterator[OperatorEnv]:
    e = OperatorEnv(cluster, namespace, tmp_path)
    try:
        yield e
    finally:
        e.teardown()
