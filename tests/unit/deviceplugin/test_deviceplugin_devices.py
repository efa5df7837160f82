"""Pure logic of the device plugin: unit IDs, health, Allocate, preferred allocation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from metaroce_agent.deviceplugin.devices import (
    AllocationError,
    PluginDevice,
    allocate,
    index,
    preferred,
    unit_id,
    units,
)

R = "metaroce.io/backend"


def dev(name: str, n: int, numa: int | None = 0, **kw: object) -> PluginDevice:
    base = PluginDevice(name, f"uverbs{n}", f"ens{n}", numa, True, True, 3)
    return replace(base, **kw)  # type: ignore[arg-type]


def test_unit_ids_and_shared_mode() -> None:
    got = units([dev("mlx5_1", 1), dev("mlx5_0", 0)], pods_per_device=3)
    assert [u.id for u in got] == [
        "mlx5_0-0",
        "mlx5_0-1",
        "mlx5_0-2",
        "mlx5_1-0",
        "mlx5_1-1",
        "mlx5_1-2",
    ]


def test_duplicate_devices_are_advertised_once() -> None:
    assert len(units([dev("mlx5_0", 0), dev("mlx5_0", 0)], 1)) == 1


def test_long_names_fit_the_kubelet_id_limit() -> None:
    long = "x" * 70
    ident = unit_id(long, 12)
    assert len(ident) <= 63 and ident.endswith("-12")
    assert unit_id(long, 12) != unit_id("x" * 71, 12)


def test_pods_per_device_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pods_per_device"):
        units([dev("a", 0)], 0)


@pytest.mark.parametrize(
    ("port_active", "qos_verified", "health"),
    [(True, True, "Healthy"), (False, True, "Unhealthy"), (True, False, "Unhealthy")],
)
def test_health_needs_active_port_and_verified_qos(
    port_active: bool, qos_verified: bool, health: str
) -> None:
    [unit] = units([dev("mlx5_0", 0, port_active=port_active, qos_verified=qos_verified)], 1)
    assert unit.health == health


def test_sysfs_numa_minus_one_means_unknown() -> None:
    assert dev("a", 0, numa=-1).numa is None
    assert dev("a", 0, numa=1).numa == 1


def test_uverbs_accepts_name_or_path() -> None:
    assert dev("a", 0, uverbs="/dev/infiniband/uverbs7").uverbs_path == "/dev/infiniband/uverbs7"
    assert dev("a", 0, uverbs="uverbs7").uverbs_path == "/dev/infiniband/uverbs7"


def test_allocate_device_nodes_once_per_nic_and_exact_hca_list() -> None:
    by_id = index(units([dev("mlx5_0", 0), dev("mlx5_1", 1, port=2)], 2))
    got = allocate(["mlx5_1-1", "mlx5_0-0"], by_id, resource_name=R)
    assert [d.host_path for d in got.devices] == [
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/rdma_cm",
    ]
    assert got.envs == {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:2", "NCCL_IB_GID_INDEX": "3"}


def test_allocate_omits_gid_index_when_devices_differ_or_unknown() -> None:
    by_id = index(units([dev("a", 0, gid_index=1), dev("b", 1, gid_index=2)], 1))
    assert "NCCL_IB_GID_INDEX" not in allocate(["a-0", "b-0"], by_id, resource_name=R).envs
    by_id = index(units([dev("a", 0, gid_index=None)], 1))
    assert "NCCL_IB_GID_INDEX" not in allocate(["a-0"], by_id, resource_name=R).envs


def test_allocate_env_follows_the_network_ncclenv() -> None:
    by_id = index(units([dev("a", 0)], 1))
    got = allocate(["a-0"], by_id, resource_name=R, device_env=frozenset({"NCCL_IB_GID_INDEX"}))
    assert got.envs == {"NCCL_IB_GID_INDEX": "3"}
    assert allocate(["a-0"], by_id, resource_name=R, device_env=frozenset()).envs == {}


def test_allocate_refuses_two_units_of_one_nic() -> None:
    by_id = index(units([dev("mlx5_0", 0)], 4))
    with pytest.raises(AllocationError, match=r"asked for 2 units .* only 1 NIC\(s\) \(mlx5_0\)"):
        allocate(["mlx5_0-0", "mlx5_0-1"], by_id, resource_name=R)


def test_allocate_refuses_unknown_ids() -> None:
    with pytest.raises(AllocationError, match="unknown device ID"):
        allocate(["gone-0"], {}, resource_name=R)


def numa_node_of(ids: list[str], by_id: dict[str, object]) -> set[int | None]:
    return {by_id[i].device.numa for i in ids}  # type: ignore[attr-defined]


def test_preferred_prefers_one_numa_node_with_enough_nics() -> None:
    devices = [dev("a", 0, 0), dev("b", 1, 1), dev("c", 2, 1), dev("d", 3, 1)]
    by_id = index(units(devices, 1))
    got = preferred(sorted(by_id), [], 3, by_id)
    assert sorted(got) == ["b-0", "c-0", "d-0"]


def test_preferred_starts_from_the_must_include_numa_node() -> None:
    devices = [dev("a", 0, 0), dev("b", 1, 0), dev("c", 2, 1), dev("d", 3, 1)]
    by_id = index(units(devices, 1))
    assert preferred(sorted(by_id), ["c-0"], 2, by_id) == ["c-0", "d-0"]


def test_preferred_spreads_over_distinct_nics_in_shared_mode() -> None:
    by_id = index(units([dev("a", 0), dev("b", 1)], 4))
    got = preferred(sorted(by_id), [], 2, by_id)
    assert {g.split("-")[0] for g in got} == {"a", "b"}


def test_preferred_favours_the_least_used_nic() -> None:
    by_id = index(units([dev("a", 0), dev("b", 1)], 4))
    available = ["a-3", "b-1", "b-2", "b-3"]  # a is busier
    assert preferred(available, [], 1, by_id) == ["b-1"]


def test_preferred_crosses_numa_nodes_only_when_needed() -> None:
    by_id = index(units([dev("a", 0, 0), dev("b", 1, 1)], 1))
    assert sorted(preferred(sorted(by_id), [], 2, by_id)) == ["a-0", "b-0"]


def test_preferred_fills_with_same_nic_only_when_out_of_nics() -> None:
    by_id = index(units([dev("a", 0)], 3))
    assert len(preferred(sorted(by_id), [], 2, by_id)) == 2


def test_preferred_unknown_numa_last() -> None:
    by_id = index(units([dev("a", 0, None), dev("b", 1, 0)], 1))
    assert preferred(sorted(by_id), [], 1, by_id) == ["b-0"]
