"""Discovery over fixture trees: the sysfs join, GIDs, NUMA, and the pyverbs fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import (
    FixtureHost,
    mellanox_node,
    no_rdma_node,
    port_down_node,
    softroce_node,
    two_numa_node,
)

from metaroce_agent.discover import DiscoveryError, discover, verbs_backend
from metaroce_agent.host import Host


def test_mellanox_nic_is_joined_with_its_pci_function(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    inv = n.inventory()
    assert inv.source == "sysfs"
    nd = inv.netdev("ens1f0")
    assert nd is not None
    assert (nd.pci_address, nd.vendor_id, nd.device_id, nd.driver) == (
        "0000:3b:00.0",
        "0x15b3",
        "0x101d",
        "mlx5_core",
    )
    assert nd.numa_node == 0 and nd.speed_mbps == 100000 and nd.mtu == 9000
    assert nd.ipv4 == ("192.168.10.5/24",)
    dev = inv.rdma_device("mlx5_0")
    assert dev is not None and dev.kind == "hardware" and dev.netdev == "ens1f0"
    port = dev.port(1)
    assert port is not None and port.active and port.phys_state == "LinkUp"
    v2 = port.roce_v2_gids("ipv4")
    assert [(g.index, g.ipv4) for g in v2] == [(3, "192.168.10.5")]
    assert {g.type for g in port.gids} == {"RoCE v2", "IB/RoCE v1"}
    assert port.active_mtu == 4096  # derived from the netdev MTU without pyverbs
    assert dev.uverbs == "uverbs0"


def test_softroce_guest_has_virtio_netdevs_and_no_rdma_yet(node) -> None:  # type: ignore[no-untyped-def]
    inv = node(softroce_node).inventory()
    eth0 = inv.netdev("eth0")
    assert eth0 is not None
    assert eth0.driver == "virtio_net" and eth0.vendor_id == "0x1af4"
    assert eth0.pci_address is not None and eth0.speed_mbps is None
    assert inv.rdma_devices == ()


def test_veth_is_a_virtual_netdev(node) -> None:  # type: ignore[no-untyped-def]
    inv = node(softroce_node, veth=True).inventory()
    veth = inv.netdev("veth0")
    assert veth is not None and veth.virtual and veth.driver == "veth"


def test_rxe_device_is_softroce_with_its_parent(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("rxe0", netdev="eth0", software=True)
    inv = n.inventory()
    dev = inv.rdma_device("rxe0")
    assert dev is not None and dev.kind == "softroce" and dev.netdev == "eth0"
    port = dev.port(1)
    assert port is not None
    assert [g.ipv4 for g in port.roce_v2_gids()] == ["192.168.77.11"]
    assert port.active_mtu == 1024  # 1500 - headers


def test_no_rdma_device(node) -> None:  # type: ignore[no-untyped-def]
    inv = node(no_rdma_node).inventory()
    assert inv.rdma_devices == () and [n.name for n in inv.netdevs] == ["eno1"]


def test_port_down_is_reported(node) -> None:  # type: ignore[no-untyped-def]
    inv = node(port_down_node).inventory()
    dev = inv.rdma_device("mlx5_1")
    assert dev is not None
    port = dev.port(1)
    assert port is not None and port.state == "DOWN" and port.phys_state == "Disabled"
    assert not port.active


def test_two_nics_on_two_numa_nodes(node) -> None:  # type: ignore[no-untyped-def]
    inv = node(two_numa_node).inventory()
    numa = {n.name: n.numa_node for n in inv.netdevs}
    assert numa == {"ens1f0": 0, "ens7f0": 1}


def test_fixture_root_never_uses_pyverbs(tmp_path: Path) -> None:
    backend, warnings = verbs_backend(FixtureHost(tmp_path))
    assert backend.source == "sysfs" and warnings == []


def test_real_root_without_pyverbs_warns_and_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_pyverbs(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name.startswith("pyverbs"):
            raise ImportError("No module named 'pyverbs'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyverbs)
    backend, warnings = verbs_backend(Host("/"))
    assert backend.source == "sysfs"
    assert "pyverbs cannot be imported" in warnings[0] and "python3-pyverbs" in warnings[0]
    with pytest.raises(DiscoveryError, match="refusing"):
        verbs_backend(Host("/"), require_pyverbs=True)
    inv = discover(Host("/"))
    assert inv.source == "sysfs" and inv.warnings
