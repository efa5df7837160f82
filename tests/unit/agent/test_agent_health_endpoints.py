"""The agent's /readyz and /livez (issue 16 #15), on its metrics server: the DaemonSet's
readiness probe gates a rollout (`maxUnavailable`, `minReadySeconds`) on agents that
work, so ready means exactly "this node's plan for the current config is applied and
verified" (the NodeState's phase Ready for the current config generation); live means
the agent's loop is still turning (a pass hung in a kernel call is not alive).

On b6733c0 (and until this fix) the server answers only /metrics: both are 404."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import make_config
from fakes import FakeKernel, fixture_agent, running, softroce_node, until

from metaroce_agent import loop
from metaroce_agent.loop import Agent

SOFTROCE = {"nics": {"interfaceNames": ["eth0"]}, "transport": {"mode": "softroce"}}


def _get(agent: Agent, path: str) -> tuple[int, str]:
    assert agent.server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.server.port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _agent(tmp_path: Path, kernel_setup: Callable[[FakeKernel], None] | None = None) -> Agent:
    tree, kernel = softroce_node(tmp_path / "root")
    if kernel_setup:
        kernel_setup(kernel)
    config = make_config(driftInterval="1h", **SOFTROCE)
    agent = fixture_agent(tmp_path, tree, kernel, config, metrics_address="127.0.0.1",
                          metrics_port=0)  # fmt: skip
    agent.kernel = kernel  # type: ignore[attr-defined]
    return agent


def test_ready_only_once_the_plan_is_applied_and_verified(tmp_path: Path, fast_loop: None) -> None:
    def failing(kernel: FakeKernel) -> None:
        kernel.fail["tc filter replace"] = (2, "Error: TC classifier not found.")

    agent = _agent(tmp_path, failing)
    with running(agent) as a:
        assert until(lambda: a.server is not None and a.state.status is not None, 5)
        code, body = _get(a, "/readyz")
        assert code == 503 and "Failed" in body, (code, body)  # rolled back, not verified
        assert _get(a, "/livez")[0] == 200  # failing is not hung: a restart would not help
        del a.kernel.fail["tc filter replace"]  # type: ignore[attr-defined]
        assert until(lambda: _get(a, "/readyz")[0] == 200, 10), _get(a, "/readyz")
        assert "generation" in _get(a, "/readyz")[1]
        assert _get(a, "/metrics")[0] == 200


def test_not_ready_until_the_current_config_is_applied(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    agent.serve_metrics()
    try:
        assert _get(agent, "/readyz")[0] == 503  # nothing applied yet
        agent.apply_pass()
        assert _get(agent, "/readyz")[0] == 200
        newer = agent.config.model_copy(update={"generation": agent.config.generation + 1})
        agent.config = newer  # reloaded, not yet applied
        code, body = _get(agent, "/readyz")
        assert code == 503 and "generation" in body, body
    finally:
        agent.stop()
        assert agent.server is not None
        agent.server.close()


def test_not_live_when_the_loop_stopped_turning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop, "LIVENESS_SECONDS", 30.0, raising=False)
    agent = _agent(tmp_path)
    agent.serve_metrics()
    try:
        assert _get(agent, "/livez")[0] == 200  # starting up counts as turning
        agent.heartbeat = time.monotonic() - 31  # e.g. a pass stuck in a kernel call
        code, body = _get(agent, "/livez")
        assert code == 503 and "loop" in body, body
        agent.beat()
        assert _get(agent, "/livez")[0] == 200
    finally:
        assert agent.server is not None
        agent.server.close()
