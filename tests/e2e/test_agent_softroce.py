"""The node agent on real SoftRoCE: two qemu guests, the local control plane on the host.

One scenario, in order (each test builds on the node state the previous one left):

1. agents start in both guests: rxe links appear, NodeStates report Ready, the metrics
   endpoint serves the rxe counters;
2. QoS piece by piece, so one mechanism cannot hide another, both seen on the wire with
   tcpdump at the peer: with the tc marking off (`--skip-knob dscp-mark`), rdma_cm traffic
   (`ib_write_bw -R`) carries the configfs ToS (DSCP 26 -> tos 0x68) while plain verbs
   traffic carries tos 0x00; then, after stopping the agents as a rollout would (the rxe
   links and the configfs ToS stay), the network moves to DSCP 34 with tc on, and verbs
   traffic (whose own ToS is 0) carries tc's DSCP (tos 0x88);
3. the RDMA probe between the two nodes passes (RC latency, UD loss), its summary is in
   the NodeStates and its latencies are served as metrics;
4. a knob changed by hand is repaired within one drift interval and counted;
5. a step made to fail (a read-only mount over the rdma_cm configfs) rolls back what
   came before it and the NodeState names the step;
6. with IPv4 taken off eth0 and IPv6 addresses given, the probe runs over RoCEv2 IPv6
   GIDs, each agent publishes its IPv6 endpoint, and a changed address is published again;
7. deleting the network with cleanupOnDelete reverts both nodes: rxe links, tc filters
   and configfs entries are gone and the NodeStates say `reverted`.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from metaroce_api import AgentConfig, MetaRoceNetwork, constants, nodestate_name
from metaroce_harness.polling import wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NETWORK = "rdma-e2e"
DRIFT = "5s"
CM = "/sys/kernel/config/rdma_cm/rxe_eth0/ports/1"
AGENT_LOG = "/tmp/metaroce-agent.log"
PROBE_KEY = "/tmp/probe-key"
PROBE_KEY_TEXT = "e2e-probe-key-" + "5" * 32


def network_manifest(dscp: int = 26, address_family: str = "ipv4") -> dict[str, Any]:
    spec = {
        "nics": {"interfaceNames": ["eth0"]},
        "transport": {"mode": "softroce", "roce": {"addressFamily": address_family}},
        "qos": {"profile": "lossless", "data": {"dscp": dscp, "priority": 3}},
        "health": {
            "probe": {
                "enabled": True,
                "interval": "15s",
                "peersPerNode": 1,
                # TCG guests and a userspace L2 hub: milliseconds, not microseconds
                "maxLatencyMicroseconds": 2_000_000,
                "maxLossFraction": 0.2,
            }
        },
        "agent": {"driftInterval": DRIFT},
        "cleanupOnDelete": True,
    }
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.NETWORK_KIND,
        "metadata": {"name": NETWORK, "finalizers": [constants.CLEANUP_FINALIZER]},
        "spec": spec,
    }


@dataclass
class Env:
    cluster: Any
    guests: Any
    agents: dict[int, Any] = field(default_factory=dict)

    # --- API -----------------------------------------------------------------------
    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl(*args, "-o", "json").stdout)

    def network(self) -> dict[str, Any]:
        return dict(self.kubectl_json("get", "metarocenetwork", NETWORK))

    def nodestate(self, node: str) -> dict[str, Any] | None:
        proc = self.cluster.kubectl(
            "get", "metarocenodestate", nodestate_name(NETWORK, node), "-o", "json", check=False
        )
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def apply_network(self, dscp: int, address_family: str = "ipv4") -> int:
        body = network_manifest(dscp, address_family)
        MetaRoceNetwork.model_validate(body)  # the contract accepts it
        self.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(body))
        return int(self.network()["metadata"]["generation"])

    def render_config(self) -> str:
        obj = self.network()
        net = MetaRoceNetwork.model_validate(
            {k: v for k, v in obj.items() if k in ("apiVersion", "kind", "metadata", "spec")}
        )
        return AgentConfig.from_network(net).to_yaml()

    # --- agents ----------------------------------------------------------------------
    def start_agent(self, i: int, *extra: str) -> None:
        g = self.guests[i]
        g.write_file("/tmp/agent-config.yaml", self.render_config())
        g.write_file("/tmp/kubeconfig", self.cluster.guest_kubeconfig())
        g.write_file(PROBE_KEY, PROBE_KEY_TEXT, mode=0o600)  # the network's probe Secret
        argv = [
            "python3", "-m", "metaroce_agent", "agent",
            "--config", "/tmp/agent-config.yaml", "--kubeconfig", "/tmp/kubeconfig",
            "--node-name", g.name, "--require-pyverbs", "--metrics-port", "9478",
            "--probe-key-file", PROBE_KEY, *extra,
        ]  # fmt: skip
        self.agents[i] = g.start(f"exec {shlex.join(argv)} >>{AGENT_LOG} 2>&1")

    def stop_agent(self, i: int) -> None:
        job = self.agents.pop(i, None)
        if job is not None:
            job.kill()

    def agent_log(self, i: int) -> str:
        r = self.guests[i].run(f"tail -n 60 {AGENT_LOG}", timeout=30)
        return str(r.stdout)

    def wait_nodestate(
        self, i: int, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 240
    ) -> dict[str, Any]:
        node = self.guests[i].name
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            last = self.nodestate(node)
            if last is not None and pred(last):
                return last
            job = self.agents.get(i)
            if job is not None and job.poll() is not None:
                pytest.fail(
                    f"agent on {node} exited while waiting for {what}:\n{self.agent_log(i)}"
                )
            time.sleep(2)
        status = json.dumps((last or {}).get("status"), indent=1)[:3000]
        pytest.fail(
            f"NodeState of {node}: no {what} within {timeout:.0f} s; last status:\n{status}\n"
            f"agent log:\n{self.agent_log(i)}"
        )

    def run(self, i: int, cmd: str, timeout: float = 120) -> str:
        r = self.guests[i].run(cmd, timeout=timeout)
        assert r.returncode == 0, f"{self.guests[i].name}: `{cmd}` failed: {r.stderr}{r.stdout}"
        return str(r.stdout)

    def metrics(self, i: int) -> str:
        """The agent's Prometheus page, read inside the guest."""
        return self.run(
            i,
            "python3 -c 'import urllib.request as u; "
            'print(u.urlopen("http://127.0.0.1:9478/metrics").read().decode())\'',
        )

    def ok_probe_rounds(self, i: int, peer: str) -> float:
        """How many of this agent's probe sessions with `peer` succeeded."""
        m = re.search(
            rf'metaroce_probe_rounds_total\{{peer="{peer}",result="ok"\}} ([0-9.e+]+)',
            self.metrics(i),
        )
        return float(m.group(1)) if m else 0.0

    def tos_on_wire(self, rdma_cm: bool) -> set[str]:
        """Run ib_write_bw node-1 -> node-2 and return the IP ToS values tcpdump saw on
        node-2 in RoCEv2 packets from node-1."""
        src = self.guests[0].ip
        cap = self.guests[1].start(
            f"exec timeout 300 tcpdump -ni eth0 -v -c 30 udp port 4791 and src host {src}"
        )
        time.sleep(3)
        # small messages, a short send queue and a long ACK timeout: the emulated L2 of
        # TCG guests drops bursts, and RC gives up after 7 retries of a 67 ms timeout
        flags = ("-R" if rdma_cm else "-x 1") + " -s 8192 -t 16 -u 20"
        client = None
        for _ in range(3):  # RC over the emulated L2 can give up; any run shows the ToS
            server = self.guests[1].start(
                f"exec timeout 120 ib_write_bw -d rxe_eth0 {flags} -n 200"
            )
            for _ in range(8):  # the server listens only once it has set up (slow under TCG)
                time.sleep(3)
                client = self.guests[0].run(
                    f"timeout 80 ib_write_bw -d rxe_eth0 {flags} -n 200 {self.guests[1].ip}",
                    timeout=100,
                )
                if client.returncode == 0 or server.poll() is not None:
                    break
            server.wait(130)
            if client is not None and client.returncode == 0:
                break
        out = cap.wait(300)
        assert client is not None and client.returncode == 0, (
            f"ib_write_bw failed three times: {client.stderr if client else ''}"
        )
        return set(re.findall(r"tos (0x[0-9a-f]+)", out.stdout + out.stderr))


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    from metaroce_harness.cluster import FakeNode, LocalCluster
    from metaroce_harness.guests import GuestCluster

    with (
        LocalCluster([FakeNode("node-1"), FakeNode("node-2")]) as cluster,
        GuestCluster(count=2, memory_mb=1024) as guests,
    ):
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd", constants.NETWORK_CRD_NAME,
            constants.NODESTATE_CRD_NAME, "--timeout=60s",
        )  # fmt: skip
        e = Env(cluster, guests)
        e.apply_network(dscp=26)
        try:
            yield e
        finally:
            for i in list(e.agents):
                e.stop_agent(i)


def ready(ns: dict[str, Any], generation: int = 1) -> bool:
    st = ns.get("status") or {}
    return st.get("phase") == "Ready" and st.get("configGeneration") == generation


def test_agents_bring_up_softroce_and_report_ready(env: Env) -> None:
    for i in (0, 1):
        env.start_agent(i, "--skip-knob", "dscp-mark", "--no-probe")
    for i in (0, 1):
        ns = env.wait_nodestate(i, ready, "phase Ready")
        st = ns["status"]
        assert st["transport"] == {
            "mode": "softroce",
            "ready": True,
            "devices": ["rxe_eth0"],
            "message": "SoftRoCE (rdma_rxe) on eth0 as rxe_eth0",
        }
        dev = st["inventory"][0]
        assert dev["rdmaDevice"] == "rxe_eth0" and dev["driver"] == "virtio_net"
        assert dev["portState"] == "ACTIVE" and dev["gid"].endswith(f"ffff:c0a8:4d{11 + i:02x}")
        applied = {(k["name"], k["device"]) for k in st["qos"]["applied"]}
        assert {("roce-tos", "rxe_eth0"), ("roce-mode", "rxe_eth0")} <= applied
        skipped = {k["name"]: k["reason"] for k in st["qos"]["skipped"]}
        assert "turned off with --skip-knob" in skipped["dscp-mark"]
        assert "no DCB" in skipped["pfc"]
        assert ns["metadata"]["labels"][constants.NETWORK_LABEL] == NETWORK
        assert "rxe_eth0" in env.run(i, "rdma link show")
    metrics = env.metrics(0)
    assert re.search(r'metaroce_rdma_hw_sent_pkts_total\{device="rxe_eth0",netdev="eth0",'
                     r'network="rdma-e2e",port="1"\}', metrics), metrics[:2000]  # fmt: skip
    assert "metaroce_agent_ready 1.0" in metrics
    # discovery went through pyverbs (--require-pyverbs would have failed otherwise)
    assert "through pyverbs" in env.agent_log(0)


def test_rdma_cm_traffic_carries_the_configfs_tos_with_tc_off(env: Env) -> None:
    assert env.run(0, f"cat {CM}/default_roce_tos").strip() == "104"
    assert "pref 4791" not in env.run(0, "tc filter show dev eth0 egress")
    assert env.tos_on_wire(rdma_cm=True) == {"0x68"}  # DSCP 26 from rdma_cm's default
    assert env.tos_on_wire(rdma_cm=False) == {"0x0"}  # verbs traffic: nothing marks it


def test_stopped_agent_leaves_the_node_and_tc_marks_verbs_traffic(env: Env) -> None:
    for i in (0, 1):
        env.stop_agent(i)
    for i in (0, 1):  # a rollout leaves the node as it is: running jobs use it
        assert "rxe_eth0" in env.run(i, "rdma link show")
        assert env.run(i, f"cat {CM}/default_roce_tos").strip() == "104"
    generation = env.apply_network(dscp=34)
    assert generation == 2
    for i in (0, 1):
        env.start_agent(i)  # with the RDMA probe from here on
    for i in (0, 1):
        ns = env.wait_nodestate(i, lambda n: ready(n, generation), "generation 2 Ready")
        applied = {k["name"]: k for k in ns["status"]["qos"]["applied"]}
        assert applied["dscp-mark"]["value"] == "dscp 34 (tos 0x88) priority 3"
        assert applied["dscp-mark"]["method"] == "tc"
    assert env.tos_on_wire(rdma_cm=False) == {"0x88"}  # verbs ToS 0, rewritten by tc


def test_probe_between_the_nodes_passes_and_is_served(env: Env) -> None:
    for i, peer in ((0, "node-2"), (1, "node-1")):
        ns = env.wait_nodestate(
            i,
            lambda n: ((n.get("status") or {}).get("probe") or {}).get("healthy") is True,
            "a healthy probe summary",
            timeout=180,
        )
        assert ns["metadata"]["annotations"]["metaroce.io/probe-endpoint"] == (
            f"probe2://{env.guests[i].ip}:47911"
        )
        (p,) = ns["status"]["probe"]["peers"]
        assert p["node"] == peer and p["reachable"] is True
        assert p["latencyP50Microseconds"] > 0
        # a loss fraction is stated once 2000 datagrams stand behind it; the counts always
        assert p.get("lossFraction") is None or p["lossFraction"] <= 0.2
        assert re.search(r"loss \d+ of \d+ datagrams", p["message"]), p
        assert p["latencySamples"] > 0 and p["lossDatagrams"] > 0, p  # what stands behind it
        print(f"probe {env.guests[i].name} -> {peer}: {p['message']}")  # the figures, with -s
    metrics = env.metrics(0)
    assert re.search(
        r'metaroce_probe_latency_microseconds\{peer="node-2",quantile="0.99"\} '
        r"[0-9.e+]+",
        metrics,
    ), metrics[-3000:]
    assert 'metaroce_probe_loss_ratio{peer="node-2"}' in metrics
    assert 'metaroce_probe_rounds_total{peer="node-2",result="ok"}' in metrics
    # a client without the key is refused before the server makes any verbs resources
    intruder = (
        "import json, socket\n"
        f"c = socket.create_connection(({env.guests[1].ip!r}, 47911), timeout=10)\n"
        "f = c.makefile('r'); f.readline()\n"
        "hello = dict(node='x', gid='::', rc_qpn=1, ud_qpn=2, psn=0)\n"
        "c.sendall((json.dumps(hello) + '\\n').encode()); print(f.readline())\n"
    )
    assert "authentication failed" in env.run(0, f"python3 -c {shlex.quote(intruder)}")


def test_knob_changed_by_hand_is_repaired_within_one_drift_interval(env: Env) -> None:
    before = env.nodestate("node-1")["status"]["driftCorrections"]  # type: ignore[index]
    env.run(0, f"echo 0 > {CM}/default_roce_tos; tc filter del dev eth0 egress pref 4791")
    t0 = time.monotonic()
    ns = env.wait_nodestate(
        0, lambda n: n["status"]["driftCorrections"] >= before + 2, "drift repairs", timeout=60
    )
    took = time.monotonic() - t0
    assert env.run(0, f"cat {CM}/default_roce_tos").strip() == "136"
    assert "pref 4791" in env.run(0, "tc filter show dev eth0 egress")
    assert ns["status"]["phase"] == "Ready"
    # one drift interval (5 s) plus the time a pass takes in a TCG guest and our polling
    assert took < 5 + 25, f"repair took {took:.0f} s"


def test_failed_step_rolls_back_and_is_reported(env: Env) -> None:
    env.stop_agent(1)
    g = "python3 -m metaroce_agent agent --config /tmp/agent-config.yaml --kubeconfig " \
        "/tmp/kubeconfig --node-name node-2"  # fmt: skip
    env.run(1, f"{g} --revert")
    assert "rxe_eth0" not in env.run(1, "rdma link show")
    env.run(1, "mount -t tmpfs -o ro none /sys/kernel/config/rdma_cm")
    try:
        r = env.guests[1].run(f"{g} --once", timeout=180)
        assert r.returncode == 1, r.stdout + r.stderr
        ns = env.nodestate("node-2")
        assert ns is not None
        st = ns["status"]
        assert st["phase"] == "Failed"
        assert st["conditions"][0]["reason"] == "ApplyFailed"
        err = st["errors"][0]
        assert err["step"] == "apply rdma-cm-configfs on rxe_eth0"
        assert "Read-only file system" in err["message"] and "rolled back" in err["message"]
        # nothing half-applied: the rxe link and the tc marking made before were undone
        assert "rxe_eth0" not in env.run(1, "rdma link show")
        assert "pref 4791" not in env.run(1, "tc filter show dev eth0 egress")
    finally:
        env.run(1, "umount /sys/kernel/config/rdma_cm")
    env.start_agent(1)
    env.wait_nodestate(1, lambda n: ready(n, 2), "Ready again")


V6 = "fd77::"


def test_probe_between_ipv6_only_nodes_uses_and_republishes_their_v6_addresses(
    env: Env,
) -> None:
    """Finding 9 on the real kernel: with no IPv4 address on the RDMA netdev, each agent
    publishes `probe2://[<its IPv6 address>]:port` (never 0.0.0.0 or a link-local one),
    the probe between the nodes passes over RoCEv2 IPv6 GIDs, and an address changed by
    hand is published again within a drift interval or two."""
    for i in (0, 1):
        env.stop_agent(i)
        env.run(i, f"ip -4 addr flush dev eth0 && ip -6 addr add {V6}{11 + i}/64 dev eth0 nodad")
    generation = env.apply_network(dscp=34, address_family="ipv6")
    for i in (0, 1):
        env.start_agent(i)

    def endpoint(ns: dict[str, Any]) -> str:
        return str(
            (ns["metadata"].get("annotations") or {}).get(constants.PROBE_ENDPOINT_ANNOTATION)
        )

    def probed_healthy(n: dict[str, Any]) -> bool:
        probe = (n.get("status") or {}).get("probe") or {}
        return ready(n, generation) and probe.get("healthy") is True

    for i, peer in ((0, "node-2"), (1, "node-1")):
        ns = env.wait_nodestate(i, probed_healthy, "Ready with a healthy IPv6 probe", timeout=240)
        assert endpoint(ns) == f"probe2://[{V6}{11 + i}]:47911"
        (p,) = ns["status"]["probe"]["peers"]
        assert p["node"] == peer and p["reachable"] is True, p
        print(f"probe over IPv6 {env.guests[i].name} -> {peer}: {p['message']}")
    # node-1's address changes: the new one is published, and node-2 probes it there
    env.run(0, f"ip -6 addr add {V6}21/64 dev eth0 nodad && ip -6 addr del {V6}11/64 dev eth0")
    env.wait_nodestate(
        0, lambda n: endpoint(n) == f"probe2://[{V6}21]:47911", "the new endpoint", timeout=90
    )
    # The NodeState is written only when a verdict changes, and node-2 may learn the new
    # endpoint before any round fails on the old one: count its good sessions instead.
    # One round may have been under way at the change; a second good one after it has
    # connected to the only address node-1 still answers on.
    ok = env.ok_probe_rounds(1, "node-1")
    wait_for(
        "node-2 to probe node-1 at its new address twice",
        lambda: env.ok_probe_rounds(1, "node-1") >= ok + 2,
        timeout=120,
        every=3,
    )


def test_delete_with_cleanup_reverts_both_nodes(env: Env) -> None:
    env.cluster.kubectl("delete", "metarocenetwork", NETWORK, "--wait=false")
    for i in (0, 1):
        ns = env.wait_nodestate(
            i, lambda n: (n.get("status") or {}).get("reverted") is True, "reverted", timeout=120
        )
        assert ns["status"]["phase"] == "Reverted"
        assert "rxe_eth0" not in env.run(i, "rdma link show")
        assert "pref 4791" not in env.run(i, "tc filter show dev eth0 egress")
        assert "clsact" not in env.run(i, "tc qdisc show dev eth0")
        assert env.guests[i].run("ls /sys/kernel/config/rdma_cm/rxe_eth0").returncode != 0
        assert env.run(i, "lsmod | grep -c ^rdma_rxe").strip() == "1"  # module stays
    # the operator's part: drop the finalizer once every agent reported reverted
    patch = json.dumps({"metadata": {"finalizers": None}})
    env.cluster.kubectl("patch", "metarocenetwork", NETWORK, "--type=merge", "-p", patch)
