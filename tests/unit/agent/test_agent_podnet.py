"""The agent's pod-network step: the node's CNI configuration of the network's
NetworkAttachmentDefinition, planned from the operator's node block, applied, verified
and undone (also by the engine's revert, as cleanupOnDelete does)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from conftest import make_config
from fakes import FixtureHost, softroce_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.plan import make_plan
from metaroce_agent.podnet import MultusConfStep, multus_conf_step
from metaroce_api import AgentConfig

METAROCE = {"mode": "metaroce"}
LOSSY = {"profile": "lossy"}


def agent_config(**pod_network: Any) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "network": "mr",
            "generation": 1,
            "resourceName": "metaroce.io/mr",
            "nics": {"interfaceNames": ["eth0"]},
            "transport": {"mode": "metaroce"},
            "qos": {"profile": "lossy"},
            "podNetwork": pod_network,
        }
    )


def test_the_conf_step_applies_verifies_and_undoes(tmp_path: Path) -> None:
    host = FixtureHost(tmp_path)
    step = multus_conf_step(agent_config(subnet="10.56.0.0/16"), "eth0", "10.56.1.0/24")
    assert step.path == "/etc/cni/multus/net.d/metaroce-mr.conf"
    assert step.value() == "macvlan on eth0, 10.56.1.1-10.56.1.254 of 10.56.0.0/16"
    before = step.snapshot(host)
    assert before is None and step.verify(host) == f"{step.path} is missing"
    step.apply(host)
    assert step.verify(host) is None
    written = json.loads((tmp_path / step.path.lstrip("/")).read_text())
    assert written["name"] == "metaroce-mr" and written["master"] == "eth0"
    step.apply(host)  # idempotent
    (tmp_path / step.path.lstrip("/")).write_text("{}")
    assert "differs" in (step.verify(host) or "")
    step.undo(host, before)
    assert not host.exists(step.path)
    # a file of that name that was there before the agent is put back
    host.write_atomic(step.path, '{"name": "theirs"}')
    theirs = step.snapshot(host)
    step.apply(host)
    step.undo(host, theirs)
    assert host.read(step.path) == '{"name": "theirs"}'


def test_the_step_survives_its_journal_record() -> None:
    from metaroce_agent.steps import step_from_record

    step = multus_conf_step(agent_config(subnet="10.56.0.0/16"), "eth0", "10.56.1.0/24")
    again = step_from_record(json.loads(json.dumps(step.record())))
    assert isinstance(again, MultusConfStep) and again == step and again.id == step.id


def test_plan_needs_the_node_block_then_writes_the_conf_and_revert_removes_it(  # type: ignore[no-untyped-def]
    node, image
) -> None:
    n = node(softroce_node)
    cfg = make_config(
        nics={"interfaceNames": ["eth0"]},
        transport=METAROCE,
        qos=LOSSY,
        podNetwork={"subnet": "10.56.0.0/16", "mode": "ipvlan"},
    )
    inv = n.inventory()
    waiting = make_plan(cfg, inv, n.caps(cfg, inv))
    assert not waiting.ok and "podnet.metaroce.io/rdma-a" in waiting.errors[0].message
    plan = make_plan(cfg, inv, n.caps(cfg, inv), pod_block="10.56.7.0/24")
    assert plan.ok, plan.errors
    step = next(s for s in plan.steps if isinstance(s, MultusConfStep))
    assert step.device == "eth0" and "ipvlan on eth0, 10.56.7.1-10.56.7.254" in step.value()
    host = n.host
    # the engine applies and reverts it like any step (the library's own test is elsewhere)
    only = dataclasses.replace(plan, steps=(step,), library=None)
    result = Engine(host, Journal(host, cfg.network)).apply(only)
    assert result.ok, result
    assert json.loads(host.read(step.path))["master"] == "eth0"
    undo = Engine(host, Journal(host, cfg.network)).revert()
    assert not undo.errors, undo.errors
    assert not host.exists(step.path)
    # hostNetwork pods: no CNI configuration, no block needed
    host_cfg = make_config(
        nics={"interfaceNames": ["eth0"]},
        transport=METAROCE,
        qos=LOSSY,
        podNetwork={"mode": "hostNetwork"},
    )
    plan = make_plan(host_cfg, inv, n.caps(host_cfg, inv))
    assert plan.ok and not any(isinstance(s, MultusConfStep) for s in plan.steps)
