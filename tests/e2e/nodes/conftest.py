"""Fixtures of the real-node e2e tests: a kubeconfig and a node list, whoever made them.

By default the session builds its own cluster: the local control plane
(``LocalCluster``) with two SoftRoCE guests as real nodes (``RealNodes``: containerd,
CNI and the pinned kubelet in each guest, the project's images imported from
``hack/build-images.sh``'s archives). With ``METAROCE_E2E_KUBECONFIG`` and
``METAROCE_E2E_NODES`` (comma-separated node names) the same tests run against any
cluster whose nodes have rdma_rxe and the project's images (docs/kind.md);
``METAROCE_E2E_TEST_IMAGE`` names the RDMA test image there
(default ``localhost/metaroce-rdma-test:<app version>``).

After the session nothing of the harness may be left: no qemu, no node addresses on
the host's lo, no cluster directories of this process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from metaroce_harness import l2_health
from metaroce_harness.cluster import LocalCluster, ensure_binaries
from metaroce_harness.nodes import APISERVER_ARGS, RealNodes, leftover_addresses
from metaroce_harness.pods import Kube

REPO_ROOT = Path(__file__).resolve().parents[3]


def _app_version() -> str:
    out = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "app-version.sh")],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    logging.getLogger("metaroce").setLevel(logging.INFO)
    test_image = os.environ.get(
        "METAROCE_E2E_TEST_IMAGE", f"localhost/metaroce-rdma-test:{_app_version()}"
    )
    external = os.environ.get("METAROCE_E2E_KUBECONFIG")
    if external:
        names = [n for n in os.environ.get("METAROCE_E2E_NODES", "").split(",") if n]
        if len(names) < 2:
            raise pytest.UsageError(
                f"METAROCE_E2E_NODES={os.environ.get('METAROCE_E2E_NODES', '')!r}: name two "
                "or more nodes of the METAROCE_E2E_KUBECONFIG cluster, comma-separated"
            )
        kubectl = shutil.which("kubectl") or ensure_binaries()["kubectl"]
        yield Kube(Path(external), names, test_image, kubectl)
        return
    with _REAL_NODES:
        cluster = _REAL_NODES.enter_context(LocalCluster(extra_apiserver_args=APISERVER_ARGS))
        nodes = _REAL_NODES.enter_context(RealNodes(cluster, count=2))
        assert cluster.kubeconfig is not None
        yield Kube(
            cluster.kubeconfig,
            nodes.names,
            test_image,
            ensure_binaries()["kubectl"],
            real_nodes=nodes,
            timings=dict(nodes.timings),
        )


_REAL_NODES = contextlib.ExitStack()
"""The real nodes and their control plane: closed after the last test of this folder,
not at the end of the session. Idle, each node's kubelet and containerd keep about half
a host core busy under TCG, which the e2e tests after this folder need (seen 2026-12-01:
the tier's later guests ran beside them for 25 minutes)."""
_HERE = Path(__file__).parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A failed test on the real nodes reports the guests' L2 as it is then: when the
    guests stop reaching each other, every later test fails for that one reason (seen in
    CI on 2026-12-04: one ib_write_bw hung, then every cross-node test failed), and
    only the state at the first failure says which side stopped."""
    outcome = yield
    report = outcome.get_result()
    kube = getattr(item, "funcargs", {}).get("kube")
    nodes = kube.real_nodes if isinstance(kube, Kube) else None
    guests = nodes.guests if nodes is not None else None
    if report.when == "call" and report.failed and guests is not None:
        try:
            text = guests.l2_report()
        except Exception as exc:  # a report must not hide the test's own failure
            text = f"(no L2 report: {exc!r})"
        report.sections.append(("the guests' L2 after this failure", text))


@pytest.fixture(autouse=True)
def l2_alive(kube: Kube, figures: list[str], request: pytest.FixtureRequest) -> None:
    """Before each test on the harness's own nodes: the guests reach each other over
    their L2, revived if an emulated NIC had stopped taking frames (``l2_health``), so
    that one dead NIC fails the test it happened in, not every later one. A revival is
    printed in the tier's figures; an L2 that stays dead errors the test here."""
    guests = kube.real_nodes.guests if kube.real_nodes is not None else None
    if guests is None:
        return
    healed = l2_health.heal_l2(guests)
    if healed is not None:
        figures.append(f"before {request.node.name}: {healed.splitlines()[0]}")


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or _HERE not in Path(str(nextitem.path)).parents:
        _REAL_NODES.close()  # idempotent: the fixture's own exit is then a no-op


_FIGURES: list[str] = []


@pytest.fixture(scope="session")
def figures() -> list[str]:
    """Lines a test adds here (timings, bandwidth, RoCE counters) are printed in the
    tier's output whether the test passes or fails (pytest -q shows no print())."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FIGURES:
        terminalreporter.section("real-node figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
    if l2_health.heals:
        terminalreporter.section("the guests' L2 died and was revived", red=True)
        for text in l2_health.heals:
            terminalreporter.write_line(text)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if node addresses or cluster directories of this process survived."""
    left = [f"host address {a} on lo" for a in leftover_addresses()]
    left += [str(p) for p in Path(tempfile.gettempdir()).glob(f"metaroce-cluster-{os.getpid()}-*")]
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "e2e nodes: left behind after the session:\n  " + "\n  ".join(left)
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
