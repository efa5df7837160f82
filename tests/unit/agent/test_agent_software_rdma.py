"""rxe is told from other software RDMA devices by its driver (finding 5): siw or a
MetaRoCE device on the netdev is neither adopted as the rxe link nor taken for
hardware RoCE."""

from __future__ import annotations

from conftest import make_config
from fakes import mellanox_node, softroce_node

from metaroce_agent.plan import make_plan


def plan_for(n, cfg):  # type: ignore[no-untyped-def]
    inv = n.inventory()
    return make_plan(cfg, inv, n.caps(cfg, inv))


def softroce_cfg():  # type: ignore[no-untyped-def]
    return make_config(nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"})


def test_discovery_names_each_devices_driver(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("rxe0", netdev="eth0", software=True)
    n.tree.rdma("siw0", netdev="eth0", driver="siw")
    n.tree.rdma("mrc0", netdev="mgmt0", driver="metaroce")
    inv = n.inventory()
    kinds = {d.name: (d.kind, d.driver) for d in inv.rdma_devices}
    assert kinds == {
        "rxe0": ("softroce", "rxe"),
        "siw0": ("software", "siw"),
        "mrc0": ("software", None),
    }
    m = node(mellanox_node)
    dev = m.inventory().rdma_device("mlx5_0")
    assert dev is not None and (dev.kind, dev.driver) == ("hardware", "mlx5_core")


def test_siw_on_the_netdev_is_not_adopted_as_the_rxe_link(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("siw0", netdev="eth0", driver="siw")
    plan = plan_for(n, softroce_cfg())
    assert plan.ok, plan.errors
    assert [d.rdma_device for d in plan.devices] == ["rxe_eth0"]
    assert any(s.kind == "rxe-link" and s.device == "rxe_eth0" for s in plan.steps)


def test_a_software_device_without_a_device_link_is_not_adopted(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("mrc0", netdev="eth0", driver="metaroce")
    plan = plan_for(n, softroce_cfg())
    assert plan.ok, plan.errors
    assert [d.rdma_device for d in plan.devices] == ["rxe_eth0"]


def test_siw_is_not_hardware_roce(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("siw0", netdev="eth0", driver="siw")
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport={"mode": "rocev2"})
    plan = plan_for(n, cfg)
    assert not plan.ok
    assert not [d for d in plan.devices if d.rdma_device == "siw0"]
