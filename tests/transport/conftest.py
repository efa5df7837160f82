"""The transport tier: namespace fabrics on the host (root), real UDP, libfabric, Open MPI.

Run: `.venv/bin/pytest tests/transport -q -m transport` as root. Fabrics made here use the
name prefix `mrft` so `fabric.py cleanup --prefix mrft` removes only what tests left.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FABRIC_DIR = Path(__file__).resolve().parents[2] / "transport" / "fabric"
sys.path.insert(0, str(FABRIC_DIR))

import fabric  # noqa: E402

TEST_PREFIX = "mrft"
TOOLS = ("ip", "tc", "nft", "fi_pingpong", "fi_info", "mpirun", "iperf3")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # fail loudly, never skip: this tier needs root and the fabric tools
    if os.geteuid() != 0:
        raise pytest.UsageError("tests/transport need root (network namespaces, tc, nft)")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise pytest.UsageError(
            f"tests/transport need {', '.join(missing)}: install libfabric-bin openmpi-bin"
            " nftables iperf3 python3-mpi4py (hack/setup.sh)"
        )


@pytest.fixture(scope="session", autouse=True)
def _no_leftovers() -> Iterator[None]:
    fabric.cleanup(TEST_PREFIX)
    yield
    gone = fabric.cleanup(TEST_PREFIX)
    assert not gone, f"tests left fabric namespaces behind: {gone}"


@pytest.fixture(scope="module")
def mp() -> Iterator[fabric.MultipathFabric]:
    with fabric.MultipathFabric(name=fabric.new_name(TEST_PREFIX)) as fab:
        yield fab


@pytest.fixture
def clean(mp: fabric.MultipathFabric) -> Iterator[fabric.MultipathFabric]:
    """The module's fabric with no impairment, and none left after the test."""
    mp.set_impairments([])
    yield mp
    mp.set_impairments([])
