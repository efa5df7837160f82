"""The primary-interface guard (issue 17, item 2): the agent refuses to reconfigure the
netdev with the node's default route or Kubernetes InternalIP unless the network sets
`nics.allowPrimaryInterface: true`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import make_config
from fakes import FixtureHost, mellanox_node, softroce_node

from metaroce_agent.discover import NetDevice
from metaroce_agent.doctor import examine
from metaroce_agent.loop import Agent, AgentOptions
from metaroce_agent.plan import make_plan
from metaroce_agent.primary import (
    PrimaryFacts,
    ipv4_default_route_netdevs,
    ipv6_default_route_netdevs,
    node_internal_ips,
    primary_interface_errors,
    primary_interfaces,
    read_primary_facts,
)

PROC_ROUTE = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    "eno1\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
    "ens1f0\t000AA8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
    # a default route that is down (RTF_UP clear) does not count
    "ens2f0\t00000000\t010300C0\t0002\t0\t0\t0\t00000000\t0\t0\t0\n"
)
PROC_IPV6_ROUTE = (
    "fe800000000000000000000000000000 40 00000000000000000000000000000000 00 "
    "00000000000000000000000000000000 00000100 00000001 00000000 00000001     ens1f0\n"
    "00000000000000000000000000000000 00 00000000000000000000000000000000 00 "
    "fd000000000000000000000000000001 00000400 00000003 00000000 00000003    bond0\n"
    # the kernel's unreachable default: RTF_REJECT on lo
    "00000000000000000000000000000000 00 00000000000000000000000000000000 00 "
    "00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo\n"
)


def test_default_routes_are_read_from_procfs() -> None:
    assert ipv4_default_route_netdevs(PROC_ROUTE) == ["eno1"]
    assert ipv6_default_route_netdevs(PROC_IPV6_ROUTE) == ["bond0"]
    assert ipv4_default_route_netdevs("") == [] and ipv6_default_route_netdevs("") == []


def test_internal_ips_come_from_the_node_status() -> None:
    node = {
        "status": {
            "addresses": [
                {"type": "Hostname", "address": "node-1"},
                {"type": "InternalIP", "address": "10.0.0.5"},
                {"type": "InternalIP", "address": "fd00::5"},
                {"type": "ExternalIP", "address": "203.0.113.9"},
            ]
        }
    }
    assert node_internal_ips(node) == ["10.0.0.5", "fd00::5"]
    assert node_internal_ips(None) == [] and node_internal_ips({"spec": {}}) == []


def test_primary_interfaces_names_why_and_follows_bond_and_vlan_lowers() -> None:
    facts = PrimaryFacts(
        ipv4_default=("eno1",),
        ipv6_default=("bond0",),
        internal_ips=("fd00:0::5",),  # written differently from the address: same IP
        lowers={"bond0": ("ens1f0", "ens1f1"), "vlan10": ("ens2f0",)},
    )
    netdevs = [
        NetDevice("eno1", ipv4=("192.0.2.10/24",)),
        NetDevice("bond0"),
        NetDevice("vlan10", ipv6=("fd00::5/64",)),
        NetDevice("ens3f0", ipv4=("10.1.0.5/24",)),
    ]
    primary = primary_interfaces(facts, netdevs)
    assert primary == {
        "eno1": ("carries the node's IPv4 default route",),
        "bond0": ("carries the node's IPv6 default route",),
        "ens1f0": ("is under bond0, which carries the node's IPv6 default route",),
        "ens1f1": ("is under bond0, which carries the node's IPv6 default route",),
        "vlan10": ("has the node's Kubernetes InternalIP fd00:0::5",),
        "ens2f0": ("is under vlan10, which has the node's Kubernetes InternalIP fd00:0::5",),
    }
    assert "ens3f0" not in primary


def test_the_refusal_names_the_interface_the_reason_and_the_field() -> None:
    primary = {"eno1": ("carries the node's IPv4 default route",)}
    selected = [NetDevice("eno1"), NetDevice("ens1f0")]
    (issue,) = primary_interface_errors(selected, primary, allowed=False)
    assert issue.where == "select nics"
    assert issue.message.startswith("eno1 carries the node's IPv4 default route:")
    assert "spec.nics.allowPrimaryInterface: true" in issue.message
    assert "ens1f0" not in issue.message
    assert primary_interface_errors(selected, primary, allowed=True) == []


def test_plan_refuses_the_default_route_netdev_and_applies_nothing(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    cfg = make_config(nics={"pciVendorIds": ["0x15b3"]}, transport={"mode": "rocev2", "mtu": 9000})
    inv = n.inventory()
    n.tree.write("/proc/net/route", PROC_ROUTE.replace("eno1", "ens1f0", 1))
    primary = primary_interfaces(read_primary_facts(n.host, inv), inv.netdevs)
    plan = make_plan(cfg, inv, n.caps(cfg, inv), primary=primary)
    assert not plan.ok and plan.steps == () and plan.netdevs == ("ens1f0",)
    assert "ens1f0 carries the node's IPv4 default route" in plan.errors[0].message

    allowed = make_config(
        nics={"pciVendorIds": ["0x15b3"], "allowPrimaryInterface": True},
        transport={"mode": "rocev2", "mtu": 9000},
    )
    plan = make_plan(allowed, inv, n.caps(allowed, inv), primary=primary)
    assert plan.ok and "mtu" in [s.kind for s in plan.steps]


def test_plan_refuses_the_internal_ip_netdev(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    cfg = make_config(nics={"drivers": ["mlx5_core"]}, transport={"mode": "rocev2"})
    inv = n.inventory()
    facts = read_primary_facts(n.host, inv, ["192.168.10.5"])  # ens1f0's address
    plan = make_plan(cfg, inv, n.caps(cfg, inv), primary=primary_interfaces(facts, inv.netdevs))
    assert not plan.ok
    assert "ens1f0 has the node's Kubernetes InternalIP 192.168.10.5" in plan.errors[0].message
    # another NIC carrying the InternalIP leaves the RDMA NIC alone
    facts = read_primary_facts(n.host, inv, ["10.9.9.9"])
    assert make_plan(cfg, inv, n.caps(cfg, inv), primary=primary_interfaces(facts, inv.netdevs)).ok


def test_doctor_reports_the_refusal(tmp_path: Path) -> None:
    tree, kernel = mellanox_node(tmp_path / "root")
    tree.write("/proc/net/route", PROC_ROUTE.replace("eno1", "ens1f0", 1))
    host = FixtureHost(tree.root, runner=kernel)
    ex = examine(host, make_config(nics={"drivers": ["mlx5_core"]}), "node-1")
    assert any("allowPrimaryInterface" in f.what for f in ex.findings if f.severity == "problem")


class NodeKube:
    """The Node object with an InternalIP, and recorded NodeState writes."""

    def __init__(self, internal_ip: str) -> None:
        self.node = {"status": {"addresses": [{"type": "InternalIP", "address": internal_ip}]}}
        self.gets: list[str] = []
        self.written: list[dict[str, Any]] = []

    def get(self, path: str) -> dict[str, Any] | None:
        self.gets.append(path)
        return self.node if path.startswith("/api/v1/nodes/") else None

    def watch(self, path: str, params: dict[str, Any], timeout: float = 0) -> Any:
        return iter(())

    def create(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        self.written.append(body)
        return body

    def apply(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        return self.create(path, body, field_manager)

    def merge_patch(self, path: str, patch: dict[str, Any], field_manager: str) -> dict[str, Any]:
        return self.create(path, patch, field_manager)


def test_agent_pass_reads_the_internal_ip_from_its_node_and_refuses(tmp_path: Path) -> None:
    tree, kernel = softroce_node(tmp_path / "root")
    host = FixtureHost(tree.root, runner=kernel)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        make_config(nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"}).to_yaml()
    )
    kube = NodeKube("192.168.77.11")
    opts = AgentOptions(config_path=cfg, node_name="node-1", metrics_port=None)
    agent = Agent(opts, host=host, kube=kube)  # type: ignore[arg-type]
    result = agent.apply_pass()
    assert not result.ok and "/api/v1/nodes/node-1" in kube.gets
    assert "eth0 has the node's Kubernetes InternalIP 192.168.77.11" in (result.error or "")
    assert kernel.mutating() == []  # nothing was changed on the node
