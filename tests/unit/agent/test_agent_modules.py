"""The hardware path loads the verbs modules and says what is missing (finding 6).

Without ib_uverbs pyverbs lists no device, and the plan told the user to load mlx5_ib
(the wrong fix); without rdma_ucm Allocate still handed out /dev/infiniband/rdma_cm and
the container failed to start."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
from conftest import make_config
from fakes import mellanox_node

from metaroce_agent import discover as discover_mod
from metaroce_agent.deviceplugin.devices import PluginDevice, allocate, index, units
from metaroce_agent.engine import Engine, Journal
from metaroce_agent.plan import make_plan


def _cfg():  # type: ignore[no-untyped-def]
    return make_config(nics={"interfaceNames": ["ens1f0"]}, transport={"mode": "rocev2"})


def plan_for(n, cfg):  # type: ignore[no-untyped-def]
    inv = n.inventory()
    return make_plan(cfg, inv, n.caps(cfg, inv))


def test_rocev2_plan_loads_ib_uverbs_and_rdma_ucm(node) -> None:  # type: ignore[no-untyped-def]
    plan = plan_for(node(mellanox_node), _cfg())
    modules = [s.device for s in plan.steps if s.kind == "kernel-module"]
    assert {"ib_uverbs", "rdma_ucm"} <= set(modules), modules


def test_a_device_verbs_cannot_see_is_found_and_the_fix_is_ib_uverbs(
    node, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)

    class NoUverbs(discover_mod.SysfsVerbs):
        """What pyverbs lists without ib_uverbs: nothing."""

        def devices(self) -> list[str]:
            return []

    monkeypatch.setattr(discover_mod, "verbs_backend", lambda host, **kw: (NoUverbs(host), []))
    shutil.rmtree(n.tree.p("/sys/class/infiniband_verbs"))  # ib_uverbs makes these
    inv = n.inventory()
    dev = inv.rdma_device("mlx5_0")
    assert dev is not None and dev.kind == "hardware" and dev.uverbs is None
    plan = make_plan(_cfg(), inv, n.caps(_cfg(), inv))
    text = " ".join(i.message for i in (*plan.errors, *plan.problems))
    assert "ib_uverbs" in text and "mlx5_ib" not in text, text


def test_allocate_gives_rdma_cm_only_where_the_node_has_it() -> None:
    base = PluginDevice("mlx5_0", "uverbs0", "ens1f0", 0, True, True, 3)
    by_id = index(units([replace(base, rdma_cm=False)], 1))
    got = allocate(["mlx5_0-0"], by_id, resource_name="metaroce.io/x")
    assert [d.host_path for d in got.devices] == ["/dev/infiniband/uverbs0"]


def test_a_refused_modprobe_names_the_fix(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    n.kernel.fail["modprobe ib_uverbs"] = (1, "modprobe: FATAL: Module ib_uverbs not found")
    result = Engine(n.host, Journal(n.host, "rdma-a")).apply(plan_for(n, _cfg()))
    assert not result.ok and result.failed_step is not None
    assert result.failed_step.device == "ib_uverbs"
    assert "/lib/modules" in result.error and "modprobe ib_uverbs" in result.error
