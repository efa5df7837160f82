"""The device plugin against an in-process kubelet peer, over real gRPC on unix sockets."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from kubelet_peer import KubeletPeer

from metaroce_agent.deviceplugin import DevicePlugin, PluginConfig, PluginDevice

RESOURCE = "metaroce.io/backend"


def dev(name: str, n: int, numa: int | None = 0, **kw: object) -> PluginDevice:
    base = PluginDevice(
        rdma_device=name,
        uverbs=f"uverbs{n}",
        netdev=f"ens{n}",
        numa_node=numa,
        port_active=True,
        qos_verified=True,
        gid_index=3,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # Short path: unix socket paths are limited to 108 bytes.
    with tempfile.TemporaryDirectory(prefix="dp-") as d:
        yield Path(d)


@pytest.fixture
def kubelet(sockdir: Path) -> Iterator[KubeletPeer]:
    peer = KubeletPeer(sockdir)
    peer.start()
    yield peer
    peer.stop()


def make_plugin(sockdir: Path, pods_per_device: int = 1) -> DevicePlugin:
    return DevicePlugin(
        PluginConfig(
            resource_name=RESOURCE,
            pods_per_device=pods_per_device,
            socket_dir=sockdir,
            poll_interval=0.1,
            max_backoff=0.5,
        )
    )


@pytest.fixture
def plugin(sockdir: Path) -> Iterator[DevicePlugin]:
    p = make_plugin(sockdir)
    yield p
    p.stop()


def test_registers_and_lists_units_with_health_and_numa(
    kubelet: KubeletPeer, sockdir: Path
) -> None:
    plugin = make_plugin(sockdir, pods_per_device=2)
    try:
        plugin.update([dev("mlx5_0", 0, numa=0), dev("mlx5_1", 1, numa=1)])
        plugin.start()
        got = kubelet.wait("4 units", lambda: len(kubelet.devices(RESOURCE)) == 4)
        assert got
        devices = kubelet.devices(RESOURCE)
        assert devices == {
            "mlx5_0-0": ("Healthy", [0]),
            "mlx5_0-1": ("Healthy", [0]),
            "mlx5_1-0": ("Healthy", [1]),
            "mlx5_1-1": ("Healthy", [1]),
        }
        assert kubelet.registrations == [RESOURCE]
        assert kubelet.endpoints[RESOURCE].options.get_preferred_allocation_available
    finally:
        plugin.stop()


def test_does_not_register_before_a_device_exists(
    kubelet: KubeletPeer, plugin: DevicePlugin
) -> None:
    plugin.start()
    plugin.update([])
    assert not plugin.wait_registered(1.0), "registered with no device to offer"
    assert kubelet.registrations == []
    plugin.update([dev("mlx5_0", 0)])
    kubelet.wait("registration once a device exists", lambda: kubelet.healthy(RESOURCE))
    assert kubelet.healthy(RESOURCE) == {"mlx5_0-0"}


def test_registers_once_the_kubelet_comes_up(sockdir: Path, plugin: DevicePlugin) -> None:
    plugin.update([dev("mlx5_0", 0)])
    plugin.start()
    assert not plugin.wait_registered(0.5)
    peer = KubeletPeer(sockdir)
    peer.start()
    try:
        peer.wait("late registration", lambda: peer.healthy(RESOURCE) == {"mlx5_0-0"})
    finally:
        peer.stop()


def test_kubelet_restart_means_a_new_registration(
    kubelet: KubeletPeer, plugin: DevicePlugin, sockdir: Path
) -> None:
    plugin.update([dev("mlx5_0", 0), dev("mlx5_1", 1)])
    plugin.start()
    kubelet.wait("first registration", lambda: len(kubelet.healthy(RESOURCE)) == 2)
    own_socket = plugin.config.socket_path
    assert own_socket.is_socket()
    for round_ in range(2):
        kubelet.restart()  # deletes every socket in the dir and makes a new kubelet.sock
        kubelet.wait(f"re-registration #{round_ + 1}", lambda: len(kubelet.healthy(RESOURCE)) == 2)
        assert own_socket.is_socket()
    assert kubelet.registrations == [RESOURCE] * 3
    kubelet.wait("the plugin to count 3", lambda: plugin.status().registrations == 3)
    assert plugin.status().registered


def test_own_socket_deleted_leads_to_new_server_and_registration(
    kubelet: KubeletPeer, plugin: DevicePlugin
) -> None:
    plugin.update([dev("mlx5_0", 0)])
    plugin.start()
    kubelet.wait("registration", lambda: kubelet.healthy(RESOURCE))
    plugin.config.socket_path.unlink()
    kubelet.wait("re-registration", lambda: len(kubelet.registrations) == 2)
    kubelet.wait("devices again", lambda: kubelet.healthy(RESOURCE) == {"mlx5_0-0"})


def test_port_down_turns_the_device_unhealthy_and_back(
    kubelet: KubeletPeer, plugin: DevicePlugin
) -> None:
    plugin.update([dev("mlx5_0", 0), dev("mlx5_1", 1)])
    plugin.start()
    kubelet.wait("both healthy", lambda: len(kubelet.healthy(RESOURCE)) == 2)
    plugin.update([dev("mlx5_0", 0, port_active=False), dev("mlx5_1", 1)])
    kubelet.wait("mlx5_0 unhealthy", lambda: kubelet.healthy(RESOURCE) == {"mlx5_1-0"})
    assert kubelet.devices(RESOURCE)["mlx5_0-0"][0] == "Unhealthy"
    assert plugin.status().unhealthy == {"mlx5_0": "port is not ACTIVE"}
    plugin.update([dev("mlx5_0", 0), dev("mlx5_1", 1)])
    kubelet.wait("healthy again", lambda: len(kubelet.healthy(RESOURCE)) == 2)


def test_device_without_verified_qos_is_not_healthy(
    kubelet: KubeletPeer, plugin: DevicePlugin
) -> None:
    plugin.update([dev("mlx5_0", 0, qos_verified=False)])
    plugin.start()
    kubelet.wait("advertised", lambda: kubelet.devices(RESOURCE))
    assert kubelet.devices(RESOURCE) == {"mlx5_0-0": ("Unhealthy", [0])}
    plugin.update([dev("mlx5_0", 0)])
    kubelet.wait("healthy once verified", lambda: kubelet.healthy(RESOURCE) == {"mlx5_0-0"})


def test_allocate_gives_device_nodes_and_nccl_env(
    kubelet: KubeletPeer, plugin: DevicePlugin
) -> None:
    plugin.update([dev("mlx5_0", 0), dev("mlx5_1", 1), dev("mlx5_10", 10, gid_index=5)])
    plugin.start()
    kubelet.wait("registered", lambda: len(kubelet.healthy(RESOURCE)) == 3)
    response = kubelet.allocate(RESOURCE, ["mlx5_1-0", "mlx5_0-0"], ["mlx5_10-0"])
    first, second = response.container_responses
    assert [(d.container_path, d.host_path, d.permissions) for d in first.devices] == [
        ("/dev/infiniband/uverbs0", "/dev/infiniband/uverbs0", "rw"),
        ("/dev/infiniband/uverbs1", "/dev/infiniband/uverbs1", "rw"),
        ("/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm", "rw"),
    ]
    assert dict(first.envs) == {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_GID_INDEX": "3"}
    assert dict(second.envs) == {"NCCL_IB_HCA": "=mlx5_10:1", "NCCL_IB_GID_INDEX": "5"}


def test_allocate_refuses_unknown_ids_with_a_reason(
    kubelet: KubeletPeer, plugin: DevicePlugin
) -> None:
    plugin.update([dev("mlx5_0", 0)])
    plugin.start()
    kubelet.wait("registered", lambda: kubelet.healthy(RESOURCE))
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(RESOURCE, ["mlx5_9-0"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "mlx5_9-0" in err.value.details()


def test_preferred_allocation_keeps_one_numa_node_and_distinct_nics(
    kubelet: KubeletPeer, sockdir: Path
) -> None:
    plugin = make_plugin(sockdir, pods_per_device=2)
    try:
        plugin.update(
            [
                dev("mlx5_0", 0, numa=0),
                dev("mlx5_1", 1, numa=1),
                dev("mlx5_2", 2, numa=1),
                dev("mlx5_3", 3, numa=0),
            ]
        )
        plugin.start()
        kubelet.wait("8 units", lambda: len(kubelet.healthy(RESOURCE)) == 8)
        available = sorted(kubelet.healthy(RESOURCE))
        got = kubelet.preferred(RESOURCE, available, ["mlx5_1-1"], 2)
        assert got == ["mlx5_1-1", "mlx5_2-0"]
        got = kubelet.preferred(RESOURCE, available, [], 2)
        assert {g.split("-")[0] for g in got} in ({"mlx5_0", "mlx5_3"}, {"mlx5_1", "mlx5_2"})
        response = kubelet.allocate(RESOURCE, got)
        assert len(response.container_responses[0].devices) == 3
    finally:
        plugin.stop()


def test_stop_removes_the_socket(kubelet: KubeletPeer, plugin: DevicePlugin) -> None:
    plugin.update([dev("mlx5_0", 0)])
    plugin.start()
    kubelet.wait("registered", lambda: kubelet.healthy(RESOURCE))
    plugin.stop()
    assert not plugin.config.socket_path.exists()
    kubelet.wait("stream ended", lambda: kubelet.endpoint(RESOURCE) is None)


def test_metaroce_units_mount_the_library_read_only_with_the_env(
    kubelet: KubeletPeer, sockdir: Path
) -> None:
    from metaroce_api import QosSpec, TransportSpec
    from metaroce_api.metaroce_env import allocation_env

    env = allocation_env(
        TransportSpec.model_validate({"mode": "metaroce"}),
        QosSpec.model_validate({"profile": "lossy"}),
        ["-"],
        version="0.1.0",
        checksum="ab" * 32,
    )
    lib = "/run/metaroce/transport/lossy/0.1.0-abababababababab"
    units = [
        PluginDevice(
            rdma_device=nd,
            uverbs="",
            netdev=nd,
            numa_node=0,
            port_active=True,
            qos_verified=True,
            rdma_cm=False,
            library_dir=lib,
            env=tuple(sorted(env.items())),
        )
        for nd in ("eth1", "eth2")
    ]
    recorded: list[tuple[tuple[str, ...], str]] = []
    plugin = DevicePlugin(
        PluginConfig(
            resource_name=RESOURCE,
            pods_per_device=4,
            socket_dir=sockdir,
            poll_interval=0.1,
            max_backoff=0.5,
            on_allocate=lambda ids, got: recorded.append((ids, got.mounts[0].host_path)),
        )
    )
    try:
        plugin.update(units)
        plugin.start()
        kubelet.wait("8 units", lambda: len(kubelet.healthy(RESOURCE)) == 8)
        (got,) = kubelet.allocate(RESOURCE, ["eth2-1", "eth1-0"]).container_responses
        assert list(got.devices) == []
        assert [(m.container_path, m.host_path, m.read_only) for m in got.mounts] == [
            ("/opt/metaroce-transport", lib, True)
        ]
        envs = dict(got.envs)
        assert envs["MR_NCCL_IFNAME"] == "=eth1,eth2" and envs["FI_METAROCE_IFACE"] == "eth1"
        assert envs["FI_PROVIDER"] == "metaroce" and envs["NCCL_NET_PLUGIN"] == "metaroce"
        assert envs["FI_PROVIDER_PATH"].startswith("/opt/metaroce-transport/lib:")
        assert "/usr/lib/x86_64-linux-gnu/libfabric" in envs["FI_PROVIDER_PATH"]
        assert envs["MR_LIB_DIR"] == envs["MR_FI_PROVIDER_PATH"] == "/opt/metaroce-transport/lib"
        assert envs["MR_CONFIG"] == (
            "ports=20000-23999,paths=16,mtu=1500,dscp=26,queue_target_us=500,min_rto_us=5000"
        )
        assert envs["MR_TRANSPORT_CHECKSUM"] == "ab" * 32
        assert "LD_LIBRARY_PATH" not in envs  # the image's own (CUDA's) must stand
        assert recorded == [(("eth2-1", "eth1-0"), lib)]  # the agent keeps that version
    finally:
        plugin.stop()
