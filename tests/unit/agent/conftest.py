"""Fixtures of the agent's unit tests: fake nodes (sysfs tree + recording runner)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeKernel, FixtureHost, SysfsTree

from metaroce_agent.capabilities import Capabilities, probe_capabilities
from metaroce_agent.discover import Inventory, discover
from metaroce_agent.plan import select_netdevs
from metaroce_api import AgentConfig


def make_config(**overrides: Any) -> AgentConfig:
    data: dict[str, Any] = {
        "network": "rdma-a",
        "generation": 3,
        "resourceName": "metaroce.io/rdma-a",
        "nics": {"interfaceNames": ["ens*"]},
    }
    for key, value in overrides.items():
        if key != "nics" and isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return AgentConfig.model_validate(data)


class Node:
    """A fake node: tree, kernel (runner) and host, plus discover/caps shortcuts."""

    def __init__(self, tree: SysfsTree, kernel: FakeKernel) -> None:
        self.tree = tree
        self.kernel = kernel
        self.host = FixtureHost(tree.root, runner=kernel)

    def inventory(self) -> Inventory:
        return discover(self.host)

    def caps(self, config: AgentConfig, inv: Inventory | None = None) -> Capabilities:
        inv = inv or self.inventory()
        return probe_capabilities(self.host, inv, [n.name for n in select_netdevs(config, inv)])


@pytest.fixture
def node(tmp_path: Path) -> Callable[..., Node]:
    def build(case: Callable[..., tuple[SysfsTree, FakeKernel]], **kw: Any) -> Node:
        tree, kernel = case(tmp_path / "root", **kw)
        return Node(tree, kernel)

    return build


@pytest.fixture
def fast_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's loop looks at the node every 50 ms (POLL_SECONDS, 5 s in production)
    and retries a failed pass after 0.2 s (RETRY_BASE_SECONDS)."""
    from metaroce_agent import loop

    monkeypatch.setattr(loop, "POLL_SECONDS", 0.05, raising=False)
    monkeypatch.setattr(loop, "RETRY_BASE_SECONDS", 0.2, raising=False)


# The real transport, for the metaroce driver's tests (test_agent_metaroce, _podnet).
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real transport, built and staged the way the agent image gets it."""
    dest = tmp_path_factory.mktemp("image") / "transport"
    res = subprocess.run(
        ["bash", str(REPO / "hack/stage-transport.sh"), str(dest)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, (
        "hack/stage-transport.sh failed (the transport must build: run "
        f"`bash hack/build-transport.sh`):\n{res.stderr[-2000:]}"
    )
    return dest


@pytest.fixture
def image(staged: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("METAROCE_TRANSPORT_DIR", str(staged))
    return staged
