"""The agent feeds its device plugin: what is advertised (pure), and the loop driving a real
plugin registered with an in-process kubelet peer (real gRPC over unix sockets)."""

from __future__ import annotations

import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Node, make_config
from fakes import FixtureHost, mellanox_node, port_down_node, softroce_node, two_numa_node

from metaroce_agent.deviceplugin.feed import plugin_devices
from metaroce_agent.engine import Engine, Journal
from metaroce_agent.loop import Agent, AgentOptions
from metaroce_agent.plan import Plan, make_plan
from metaroce_api import AgentConfig, validate_network

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deviceplugin"))
from kubelet_peer import KubeletPeer

RESOURCE = "metaroce.io/rdma-a"


def planned(n: Node, cfg: AgentConfig, *, apply: bool = False) -> Plan:
    inv = n.inventory()
    plan = make_plan(cfg, inv, n.caps(cfg, inv))
    if apply:
        assert Engine(n.host, Journal(n.host, cfg.network, "/run/metaroce/agent")).apply(plan).ok
    return plan


def test_applied_and_active_devices_are_healthy_with_numa_and_gid(
    node: Callable[..., Node],
) -> None:
    n = node(two_numa_node)
    cfg = make_config(nics={"interfaceNames": ["ens*"]}, transport={"mode": "rocev2"})
    plan = planned(n, cfg, apply=True)
    devs = plugin_devices(cfg, n.inventory(), plan, applied=True)
    assert [(d.rdma_device, d.uverbs, d.netdev, d.numa) for d in devs] == [
        ("mlx5_0", "uverbs0", "ens1f0", 0),
        ("mlx5_1", "uverbs1", "ens7f0", 1),
    ]
    assert all(d.healthy for d in devs)
    assert all(d.gid_index is not None for d in devs)


def test_nothing_is_healthy_before_the_qos_is_applied_and_verified(
    node: Callable[..., Node],
) -> None:
    n = node(mellanox_node)
    cfg = make_config(transport={"mode": "rocev2"})
    plan = planned(n, cfg)
    (dev,) = plugin_devices(cfg, n.inventory(), plan, applied=False)
    assert dev.port_active and not dev.qos_verified and not dev.healthy
    assert dev.why_unhealthy() == "QoS not applied and verified yet"
    # A drift pass that could not repair a knob of this NIC (or a node-wide one).
    for failing in ({"ens1f0"}, {"mlx5_0"}, {""}):
        (dev,) = plugin_devices(cfg, n.inventory(), plan, applied=True, failing=failing)
        assert not dev.healthy
    (dev,) = plugin_devices(cfg, n.inventory(), plan, applied=True, failing={"eno1"})
    assert dev.healthy  # another NIC's problem


def test_a_port_that_is_down_is_unhealthy(node: Callable[..., Node]) -> None:
    n = node(port_down_node)
    cfg = make_config(transport={"mode": "rocev2"})
    plan = planned(n, cfg)
    devs = {d.rdma_device: d for d in plugin_devices(cfg, n.inventory(), plan, applied=True)}
    assert devs["mlx5_0"].healthy
    assert not devs["mlx5_1"].port_active
    assert devs["mlx5_1"].why_unhealthy() == "port is not ACTIVE"


def test_a_device_that_does_not_exist_yet_is_not_advertised(node: Callable[..., Node]) -> None:
    n = node(softroce_node)
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"})
    plan = planned(n, cfg)  # plans rxe_eth0, which the apply pass creates
    assert [d.rdma_device for d in plan.devices] == ["rxe_eth0"]
    assert plugin_devices(cfg, n.inventory(), plan, applied=False) == []
    assert plugin_devices(cfg, n.inventory(), None, applied=True) == []
    planned(n, cfg, apply=True)
    (dev,) = plugin_devices(cfg, n.inventory(), plan, applied=True)
    assert dev.rdma_device == "rxe_eth0" and dev.healthy


def test_the_agent_config_carries_the_per_device_nccl_variables() -> None:
    net = {
        "apiVersion": "metaroce.io/v1alpha1",
        "kind": "MetaRoceNetwork",
        "metadata": {"name": "be"},
        "spec": {"nics": {"interfaceNames": ["ens*"]}},
    }
    assert AgentConfig.from_network(validate_network(net)).device_env == [
        "NCCL_IB_HCA",
        "NCCL_IB_GID_INDEX",
    ]
    net["spec"]["attachment"] = {"ncclEnv": ["NCCL_IB_TC", "NCCL_IB_HCA"]}
    assert AgentConfig.from_network(validate_network(net)).device_env == ["NCCL_IB_HCA"]


# --- the loop with a real plugin and a kubelet peer ------------------------------------------


@pytest.fixture
def sockdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dpa-") as d:  # unix socket paths are short
        yield Path(d)


def test_the_agent_loop_drives_the_plugin(tmp_path: Path, sockdir: Path) -> None:
    tree, kernel = softroce_node(tmp_path / "root")
    host = FixtureHost(tree.root, runner=kernel)
    cfg = make_config(
        nics={"interfaceNames": ["eth0"]},
        transport={"mode": "softroce", "roce": {"gidIndex": 1}},
        podsPerDevice=2,
        deviceEnv=["NCCL_IB_HCA", "NCCL_IB_GID_INDEX"],
        driftInterval="1h",
    )
    (tmp_path / "agent.yaml").write_text(cfg.to_yaml())
    opts = AgentOptions(
        config_path=tmp_path / "agent.yaml",
        node_name="node-1",
        report=False,
        metrics_port=None,
        device_plugin_dir=sockdir,
    )
    kubelet = KubeletPeer(sockdir)
    kubelet.start()
    agent = Agent(opts, host=host)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        # Registered once rxe_eth0 exists and its QoS is verified: both units healthy.
        kubelet.wait(
            "healthy units", lambda: kubelet.healthy(RESOURCE) == {"rxe_eth0-0", "rxe_eth0-1"}
        )
        got = kubelet.allocate(RESOURCE, ["rxe_eth0-0"]).container_responses[0]
        assert dict(got.envs) == {"NCCL_IB_HCA": "=rxe_eth0:1", "NCCL_IB_GID_INDEX": "1"}
        assert [d.host_path for d in got.devices] == [
            "/dev/infiniband/uverbs0",
            "/dev/infiniband/rdma_cm",
        ]
        # The port goes down between drift passes: unhealthy within seconds.
        host.write("/sys/class/infiniband/rxe_eth0/ports/1/state", "1: DOWN")
        kubelet.wait("units unhealthy", lambda: not kubelet.healthy(RESOURCE), timeout=15)
        host.write("/sys/class/infiniband/rxe_eth0/ports/1/state", "4: ACTIVE")
        kubelet.wait("units healthy again", lambda: len(kubelet.healthy(RESOURCE)) == 2, timeout=15)
        # A kubelet restart: the plugin registers again by itself.
        kubelet.restart()
        kubelet.wait("re-registered", lambda: len(kubelet.healthy(RESOURCE)) == 2, timeout=15)
        assert kubelet.registrations.count(RESOURCE) >= 2
    finally:
        agent.stop()
        thread.join(15)
        kubelet.stop()
    assert agent.plugin is None  # stopped with the agent
    assert not list(sockdir.glob("metaroce-*.sock"))
