"""The whole path on real nodes, as a user drives it.

`helm install` of the chart; the operator runs with the chart's arguments and
ServiceAccount (on the host, in the harness's pod network behind the chart's webhook
Service: an operator pod on a guest could not be reached by the apiserver). Then, in
order (the tests share one network and run in file order):

1. a SoftRoCE network: the DaemonSet's agent pods start on both nodes, create rxe
   devices, apply QoS and register the device plugin with the real kubelet; both nodes
   advertise the resource;
2. two pods annotated `metaroce.io/networks`, one per node, get `/dev/infiniband/*`,
   `IPC_LOCK` and the NCCL settings from the webhook and the device plugin, and move data
   over RDMA: a pyverbs RC ping-pong and bandwidth stream, then `ib_write_bw`. Each
   pod's QP carries the injected NCCL_IB_TC, and tcpdump on the receiving node sees that
   ToS on the wire with the agents' tc marking removed (so the marking cannot hide a
   wrong injection). Figures: pod creation to first RDMA byte, and the pods'
   `ib_write_bw` bandwidth / `ib_write_bw` run directly on the nodes. `ib_write_bw` is a
   loss check, not a performance check (single runs vary several-fold under TCG): every
   run, in the pods and on the nodes, must move data with no RoCE retransmission
   (rxe's `completer_retry_err` at the requester, `duplicate_request` at the responder)
   and no frame dropped by the harness's lossless L2; a run that moves nothing fails
   with those counters and what they mean (a retry storm is not loss);
3. a kubelet restart brings the resource back without restarting the agent;
4. restarted agents re-apply the marking test 2 removed (from their journals); deleting
   the network then removes the agents and leaves the nodes clean: no rxe link, no
   clsact or tc filter on eth0, no rdma_cm configfs directory, an empty journal.

Against another cluster (METAROCE_E2E_KUBECONFIG, e.g. kind) the chart is installed
with its operator in the cluster, and the node-level parts (tc, tcpdump, direct
`ib_write_bw`, the kubelet restart) are left out: they need the harness's guests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO_ROOT, Kube

from metaroce_api import constants
from metaroce_harness import chart, l2_health
from metaroce_harness.cluster import ensure_binaries
from metaroce_harness.guest_transport import NETEM_DELAY_MS, clear_qdisc, set_netem
from metaroce_harness.nodes import RealNodes
from metaroce_harness.pods import (
    RXE,
    LinkCounters,
    annotated_pod,
    diagnose,
    ib_write_bw,
    in_pod,
    on_node,
    pod_perf,
    pod_ready,
)

sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))
import pod_transport
from e2e_support import Capture

pytestmark = pytest.mark.e2e

RELEASE = "metaroce"
NAMESPACE = "metaroce-system"
NETWORK = "e2e-softroce"
RESOURCE = f"metaroce.io/{NETWORK}"
LABEL = "metaroce.io/e2e-rdma"
DSCP = 26
TOS = DSCP << 2  # NCCL_IB_TC is the whole ToS byte
POD_NAMESPACE = "e2e-rdma"
PINGPONG = REPO_ROOT / "tests" / "e2e" / "guest" / "rc_pingpong.py"
# ib_write_bw between TCG guests: one 64 KiB message (64 packets) in flight. The local
# ACK timeout (-u) is the network's NCCL_IB_TIMEOUT, as the pods' NCCL would use: 20 is
# 4.096 us * 2^20 = 4.3 s. The 67 ms of -u 14 is shorter than a TCG-emulated responder
# under load takes to ACK a 64-packet write: the requester resends the whole message
# (go-back-N), the responder counts duplicates, and the pair livelocks for the whole run
# with nothing lost (seen on a fresh machine: 0 iterations, completer_retry_err rising,
# duplicate_request 1,661, the L2 dropping nothing).
BW_FLAGS = "-s 65536 -t 1 -D 4 -F --report_gbits"
BW_ROUNDS = 3  # pod and node runs alternate
# Repeat test_2 this many times in one session (to show it does not flake).
REPEAT_TRAFFIC = int(os.environ.get("METAROCE_E2E_REPEAT_TRAFFIC", "1"))
# metaroce-perf runs per arm between the pods (pod and node lossless, pod at 1% loss):
# two keep the tier short; 5 or more give the issue's medians on a quiet host
TRANSPORT_RUNS = int(os.environ.get("METAROCE_E2E_TRANSPORT_RUNS", "2"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "repeat" in metafunc.fixturenames and REPEAT_TRAFFIC > 1:
        metafunc.parametrize("repeat", range(1, REPEAT_TRAFFIC + 1))


@pytest.fixture
def repeat() -> int:
    return 1


def _wait(what: str, check: Callable[[], bool], timeout: float = 240.0, every: float = 2) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def operator(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    kube.kubectl("label", "--overwrite", "node", *kube.nodes[:2], f"{LABEL}=true")
    real = kube.real_nodes
    if real is not None:
        chart.install(real.cluster, RELEASE, NAMESPACE)
        # networks may name the agent's next version (test_5's library upgrade)
        next_ref = real.images.agent_next_ref if real.images is not None else ""
        op = chart.start_host_operator(
            real.cluster, RELEASE, NAMESPACE, tmp_path_factory.mktemp("operator"),
            values={"agent": {"allowedImages": [next_ref]}} if next_ref else {},
        )  # fmt: skip
        print(f"operator log: {op.log_path}")
    else:
        helm = shutil.which("helm") or ensure_binaries()["helm"]
        subprocess.run(
            [helm, f"--kubeconfig={kube.kubeconfig}", "upgrade", "--install", RELEASE,
             str(chart.CHART_DIR), "-n", "default", "--wait", "--timeout=5m"],
            check=True,
        )  # fmt: skip
    try:
        yield
    finally:
        kube.kubectl("delete", "namespace", POD_NAMESPACE, "--ignore-not-found", check=False)
        kube.kubectl("delete", "metarocenetwork", NETWORK, "--ignore-not-found", check=False)
        if real is not None:
            op.stop(grace=20)
        kube.kubectl("label", "node", *kube.nodes[:2], f"{LABEL}-", check=False)


def _network() -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "metaroce.io/v1alpha1",
            "kind": "MetaRoceNetwork",
            "metadata": {"name": NETWORK},
            "spec": {
                "nodeSelector": {"matchLabels": {LABEL: "true"}},
                # eth0 holds the node's InternalIP (the guests' one L2 link): say so
                "nics": {"interfaceNames": ["eth0"], "allowPrimaryInterface": True},
                "transport": {"mode": "softroce"},
                "qos": {"profile": "lossless", "data": {"dscp": DSCP}, "onUnsupported": "skip"},
                "attachment": {"resourceName": RESOURCE, "podsPerDevice": 4},
                # the ib_write_bw loss check reads device-wide rxe counters: no other RC
                # traffic on the device (the probe is tested in test_agent_softroce.py)
                "health": {"probe": {"enabled": False}},
                # the pod test removes the tc marking by hand: the agents must not put it
                # back (drift repair) while the ToS on the wire is checked
                "agent": {"driftInterval": "1h"},
                "cleanupOnDelete": True,
            },
        }
    )


def _agent_pods(kube: Kube) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "pods", "-n", NAMESPACE, "-l", f"metaroce.io/network={NETWORK}", "-o", "json"
    ).stdout
    return list(json.loads(out)["items"])


def _restarts(kube: Kube) -> dict[str, int]:
    return {
        p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
        for p in _agent_pods(kube)
    }


def _allocatable(kube: Kube) -> dict[str, str]:
    nodes = json.loads(kube.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return {
        n["metadata"]["name"]: n["status"].get("allocatable", {}).get(RESOURCE, "") for n in nodes
    }


def test_1_agents_run_as_daemonset_pods(kube: Kube, operator: None) -> None:
    nodes = kube.nodes[:2]
    kube.kubectl("apply", "-f", "-", input=_network())

    def agents_ready() -> bool:
        ready = {p["spec"]["nodeName"] for p in _agent_pods(kube) if pod_ready(p)}
        return set(nodes) <= ready

    took = _wait("agent pods Ready on both nodes", agents_ready, 300)
    print(f"agent pods Ready in {took:.1f} s")
    took = _wait(
        f"{RESOURCE} advertised by both nodes",
        lambda: all(_allocatable(kube).get(n) not in ("", "0") for n in nodes),
    )
    print(f"resource advertised {took:.1f} s later: {_allocatable(kube)}")
    states = json.loads(kube.kubectl("get", "metarocenodestates", "-o", "json").stdout)["items"]
    phases = [st.get("status", {}).get("phase") for st in states]
    assert len(phases) >= 2 and set(phases) == {"Ready"}, phases
    real = kube.real_nodes
    if real is not None and real.guests is not None:
        for g in real.guests:
            assert "rxe" in g.run("rdma link", check=True).stdout, g.name
    _doctor_sees_a_ready_node(kube)


# -- 2: training pods ---------------------------------------------------------------------


class Pods:
    """The two annotated pods: `a` on the first node (client), `b` on the second."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.names = ("rdma-a", "rdma-b")

    def get(self, name: str) -> dict[str, Any]:
        out = self.kube.kubectl("get", "pod", name, "-n", POD_NAMESPACE, "-o", "json").stdout
        return dict(json.loads(out))

    def exec(self, name: str, *cmd: str, timeout: float = 120) -> str:
        return self.kube.kubectl(
            "exec", "-n", POD_NAMESPACE, name, "--", *cmd, timeout=timeout
        ).stdout

    def popen(self, name: str, *cmd: str) -> subprocess.Popen[str]:
        argv = [self.kube.kubectl_bin, f"--kubeconfig={self.kube.kubeconfig}", "exec",
                "-n", POD_NAMESPACE, name, "--", *cmd]  # fmt: skip
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def env(self, name: str) -> dict[str, str]:
        lines = self.exec(name, "env").splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)


def _finish(proc: subprocess.Popen[str], what: str, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out}\n{err}"
    return out


def _pingpong(pods: Pods, server_ip: str, args: list[str]) -> tuple[dict[str, Any], ...]:
    """The pyverbs RC program in both pods; returns (client, server) summaries and the
    seconds from its start until the client's first RDMA completion."""
    program = PINGPONG.read_text()
    # the program goes in as `python3 -c`: the test image need not contain it
    server = pods.popen("rdma-b", "python3", "-c", program, "server", "--port", "18515", *args)
    t0 = time.monotonic()
    client = pods.popen(
        "rdma-a", "python3", "-c", program, "client", "--server", server_ip, "--port", "18515",
        *args,
    )  # fmt: skip
    assert client.stdout is not None
    first = None
    lines = []
    for line in client.stdout:
        lines.append(line)
        if line.strip() == "first-rdma" and first is None:
            first = time.monotonic() - t0
    client.wait(timeout=300)
    assert client.stderr is not None
    assert client.returncode == 0, f"client failed:\n{''.join(lines)}\n{client.stderr.read()}"
    srv = _finish(server, "the ping-pong server")
    return json.loads(lines[-1]), json.loads(srv.strip().splitlines()[-1]), {"first": first}


def _doctor_sees_a_ready_node(kube: Kube) -> None:
    """`metaroce doctor --node` (issue 17): the agent's doctor inside that node's live agent
    pod, with the config the operator rendered for it, sees the node ready with its rxe
    device. Run while the agents' settings are in place: test 2 removes the marking on
    purpose, and the doctor reports that drift (until the hourly drift pass repairs it)."""
    node = kube.nodes[0]
    done = subprocess.run(
        [sys.executable, "-m", "metaroce_cli.main", "doctor", f"--node={node}",
         f"--network={NETWORK}", "--json"],
        env=_cli_env(kube), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    print(f"doctor --node {node}:\n{done.stdout[-3000:]}{done.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    header, _, body = done.stdout.partition("\n")
    assert header.startswith(f"== network {NETWORK}: "), done.stdout
    report = json.loads(body)
    assert report["node"] == node and report["ready"] is True, report
    assert report["inventory"]["rdma_devices"], report


def test_2_annotated_pods_move_rdma_traffic(
    kube: Kube, operator: None, figures: list[str], repeat: int
) -> None:
    try:
        _pods_move_rdma_traffic(kube, figures, repeat)
    finally:
        # also after a failure: pods left holding the rxe device would keep the revert of
        # test 4 (and the next round) waiting on them
        kube.kubectl(
            "delete", "pod", "-n", POD_NAMESPACE, "rdma-a", "rdma-b", "--ignore-not-found",
            "--wait=true", timeout=120, check=False,
        )  # fmt: skip


def _pods_move_rdma_traffic(kube: Kube, figures: list[str], repeat: int) -> None:
    nodes = kube.nodes[:2]
    kube.kubectl("create", "namespace", POD_NAMESPACE, check=False)
    pods = Pods(kube)
    docs = [
        annotated_pod(n, POD_NAMESPACE, node, kube.test_image, NETWORK)
        for n, node in zip(pods.names, nodes, strict=True)
    ]
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    running = _wait(
        "both training pods Ready", lambda: all(pod_ready(pods.get(n)) for n in pods.names), 240, 1
    )

    # what the webhook and the device plugin gave them
    for name in pods.names:
        pod = pods.get(name)
        ctr = pod["spec"]["containers"][0]
        assert ctr["resources"]["limits"][RESOURCE] == "1", ctr["resources"]
        assert "IPC_LOCK" in ctr["securityContext"]["capabilities"]["add"], ctr
        # the record of the pod webhook, or of the network's admission policy (the chart's
        # policy mode, where the cluster serves MutatingAdmissionPolicy)
        annotations = pod["metadata"]["annotations"]
        assert (
            constants.INJECTED_ANNOTATION in annotations
            or f"{constants.POLICY_INJECTED_PREFIX}/{NETWORK}" in annotations
        ), annotations
        devs = pods.exec(name, "ls", "/dev/infiniband").split()
        assert "rdma_cm" in devs and any(d.startswith("uverbs") for d in devs), devs
        cap_eff = int(pods.exec(name, "awk", "/CapEff/ {print $2}", "/proc/1/status"), 16)
        assert cap_eff & (1 << 14), f"{name}: no CAP_IPC_LOCK in CapEff {cap_eff:x}"
        env = pods.env(name)
        assert env["NCCL_IB_TC"] == str(TOS), env
        assert env["NCCL_IB_HCA"].lstrip("=").startswith(RXE), env
        assert env["NCCL_IB_GID_INDEX"].isdigit(), env
        assert env["NCCL_IB_TIMEOUT"] == "20" and env["NCCL_IB_RETRY_CNT"] == "7", env
    env_a = pods.env("rdma-a")
    server_ip = pods.get("rdma-b")["status"]["podIP"]

    guests = kube.real_nodes.guests if kube.real_nodes is not None else None
    capture = None
    if guests is not None:
        for g in guests:  # the marking would rewrite any ToS into the network's DSCP
            if "clsact" in g.run("tc qdisc show dev eth0", check=True).stdout:
                g.run("tc qdisc del dev eth0 clsact", check=True)
            assert "clsact" not in g.run("tc qdisc show dev eth0", check=True).stdout
        capture = Capture(guests[1])

    link = LinkCounters(guests) if guests is not None else None
    try:
        client, server, timing = _pingpong(
            pods, server_ip,
            ["--rounds", "4", "--size", "65536", "--bw-seconds", "4", "--depth", "1"],
        )  # fmt: skip
    except AssertionError as exc:
        if link is None:
            raise
        cost = link.delta()
        raise AssertionError(f"{exc}\n{diagnose(cost)}\ncounters: {cost}") from None
    first_byte = running + timing["first"]
    for side in (client, server):
        assert side["verified"] and side["qp_traffic_class"] == TOS, side
        assert side["gid_index"] == int(env_a["NCCL_IB_GID_INDEX"]), side
    figures.append(
        f"[round {repeat}] pods created -> both Running {running:.1f} s -> first RDMA "
        f"completion {timing['first']:.1f} s later: pod creation to first RDMA byte "
        f"{first_byte:.1f} s; pyverbs RC bandwidth {client['bw_gbps']:.3f} Gb/s "
        f"({client['bw_bytes']} B)"
    )
    if capture is not None and guests is not None:
        summary = capture.stop()
        src = guests[0].ip
        tos = {grp["tos"] for grp in summary["groups"] if grp["src"] == src}
        print(f"ToS of RoCE packets from {src} seen on {guests[1].name}: {sorted(tos)}")
        assert tos == {TOS}, summary["groups"]

    # ib_write_bw: in the pods (pod IPs for the exchange, the injected GID index and
    # ToS), then directly on the nodes with the same settings
    # ToS and ACK timeout as the injected NCCL settings say
    gid, tc, timeout = env_a["NCCL_IB_GID_INDEX"], env_a["NCCL_IB_TC"], env_a["NCCL_IB_TIMEOUT"]
    flags = f"{BW_FLAGS} -x {gid} --tclass={tc} -u {timeout}"
    if link is not None:
        link.delta()  # from here on: ib_write_bw only
    pod_bw: list[float] = []
    node_bw: list[float] = []
    costs: list[tuple[str, dict[str, int]]] = []
    revive = (lambda: l2_health.heal_l2(guests)) if guests is not None else None
    for _ in range(BW_ROUNDS):
        in_b, in_a = in_pod(kube, POD_NAMESPACE, "rdma-b"), in_pod(kube, POD_NAMESPACE, "rdma-a")
        bw, cost = ib_write_bw(in_b[0], in_a[1], server_ip, flags, link, revive)
        pod_bw.append(bw)
        costs.append(("pods", cost))
        if guests is not None:
            g0, g1 = guests
            bw, cost = ib_write_bw(on_node(g1)[0], on_node(g0)[1], g1.ip, flags, link, revive)
            node_bw.append(bw)
            costs.append(("nodes", cost))
    figures.append(f"[round {repeat}] ib_write_bw pods {pod_bw} Gb/s, nodes {node_bw} Gb/s")
    for arm, cost in costs:
        figures.append(f"[round {repeat}]   {arm}: {cost}")
    if node_bw:
        ratio = statistics.median(pod_bw) / statistics.median(node_bw)
        figures.append(
            f"[round {repeat}] pod / node bandwidth (ib_write_bw, medians; a figure, not "
            f"checked: single runs vary several-fold under TCG): {ratio:.3f}"
        )
    # the loss check: over a lossless link with the injected timeout nothing is resent
    # (a wrong GID or ToS, or a too-short timeout, costs retransmissions)
    for arm, cost in costs:
        lost = {k: v for k, v in cost.items() if v and "frames" not in k}
        assert not lost, f"ib_write_bw in the {arm}: {diagnose(cost)}: {cost}"


def _plugin_metrics(kube: Kube, node: str) -> dict[str, float]:
    """The agent's device-plugin metrics on `node`, scraped inside its pod."""
    pod = next(p for p in _agent_pods(kube) if p["spec"]["nodeName"] == node)
    scrape = (
        "import urllib.request; print(urllib.request.urlopen("
        f"'http://127.0.0.1:{constants.AGENT_METRICS_PORT}/metrics').read().decode())"
    )
    out = kube.kubectl(
        "exec", "-n", NAMESPACE, pod["metadata"]["name"], "--", "python3", "-c", scrape
    ).stdout
    found = {}
    for line in out.splitlines():
        if line.startswith("metaroce_agent_device_plugin_"):
            name, value = line.rsplit(" ", 1)
            found[name.split("{")[0] + ("{healthy}" if 'health="healthy"' in name else "")] = float(
                value
            )
    return found


def _cli_env(kube: Kube) -> dict[str, str]:
    """The environment a user's `metaroce` command runs with: the cluster's kubeconfig and
    its kubectl on PATH."""
    return {
        **os.environ,
        "KUBECONFIG": str(kube.kubeconfig),
        "PATH": f"{Path(kube.kubectl_bin).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def _test_rdma(kube: Kube, network: str, namespace: str, *flags: str) -> tuple[float, str]:
    """`metaroce test-rdma` as a user runs it against `network`: it must exit 0 and remove
    its pods; returns how long it took and what it printed. A run during which the
    guests' L2 died (``l2_health``) runs once more after the L2 is revived, and says so."""
    kube.kubectl("create", "namespace", namespace, check=False)
    env = _cli_env(kube)
    nodes = ",".join(kube.nodes[:2])

    def run() -> tuple[float, subprocess.CompletedProcess[str]]:
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "metaroce_cli.main", "test-rdma", f"--nodes={nodes}",
             f"--network={network}", f"--namespace={namespace}", f"--image={kube.test_image}",
             *flags, "--seconds=4", "--timeout=300"],
            env=env, capture_output=True, text=True, timeout=420, check=False,
        )  # fmt: skip
        took = time.monotonic() - t0
        print(f"test-rdma took {took:.1f} s:\n{done.stdout}{done.stderr}")
        return took, done

    took, done = run()
    guests = kube.real_nodes.guests if kube.real_nodes is not None else None
    if done.returncode != 0 and guests is not None:
        healed = l2_health.heal_l2(guests)
        if healed is not None:
            print(f"test-rdma failed because {healed.splitlines()[0]}; running it again\n{healed}")
            took, done = run()
    assert done.returncode == 0, done.stdout + done.stderr

    def gone() -> bool:
        selector = "app.kubernetes.io/name=metaroce-test-rdma"
        pods = kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "name")
        return not pods.stdout.strip()

    _wait("test-rdma's pods to be removed", gone, 120)
    return took, str(done.stdout)


def test_2b_metaroce_test_rdma_moves_data(kube: Kube, operator: None) -> None:
    """`metaroce test-rdma` (issue 17) as a user runs it: an annotated pod pair it makes
    itself moves data, it prints bandwidth and latency, exits 0 and removes its pods."""
    # TCG guests: one 64 KiB message in flight (see BW_FLAGS)
    _, out = _test_rdma(kube, NETWORK, POD_NAMESPACE, "--perftest-flags=-s 65536 -t 1")
    assert re.search(r"bandwidth \(ib_write_bw, 4 s\): [\d.]+ Gb/s", out), out
    assert re.search(r"latency \(ib_send_lat\): typical [\d.]+ us", out), out


def test_3_kubelet_restart_keeps_the_resource(kube: Kube, operator: None) -> None:
    real = kube.real_nodes
    if real is None or real.guests is None:
        pytest.skip("restarting a kubelet needs the harness's own nodes")
    g = real.guests[0]
    before = _restarts(kube)
    metrics = _plugin_metrics(kube, g.name)
    assert metrics["metaroce_agent_device_plugin_registered"] == 1, metrics
    assert metrics["metaroce_agent_device_plugin_units{healthy}"] == 4, metrics
    registrations = metrics["metaroce_agent_device_plugin_registrations_total"]
    real.restart_kubelet(g)  # returns once the new kubelet reported Ready
    took = _wait(
        f"{RESOURCE} back on {g.name} after the kubelet restart",
        lambda: _allocatable(kube).get(g.name) not in ("", "0"),
    )
    print(f"resource back {took:.1f} s after the restarted kubelet was Ready")
    assert _restarts(kube) == before, "an agent restarted: the plugin must re-register itself"
    after = _plugin_metrics(kube, g.name)
    assert after["metaroce_agent_device_plugin_registered"] == 1, after
    assert after["metaroce_agent_device_plugin_registrations_total"] > registrations, after


JOURNAL = f"/run/metaroce/agent/{NETWORK}/journal.json"


def _agent_state_of(guest: Any) -> dict[str, str]:
    """What the agent leaves on a node, as the node shows it."""
    return {
        "rdma link": guest.run("rdma link", check=True).stdout,
        "qdiscs": guest.run("tc qdisc show dev eth0", check=True).stdout,
        "egress filters": guest.run("tc filter show dev eth0 egress", check=True).stdout,
        "rdma_cm configfs": guest.run(
            "ls /sys/kernel/config/rdma_cm 2>/dev/null || true", check=True
        ).stdout,
        "journal": guest.run(f"cat {JOURNAL} 2>/dev/null || true", check=True).stdout,
    }


def test_4_deleting_the_network_cleans_the_nodes(kube: Kube, operator: None) -> None:
    real = kube.real_nodes
    guests = real.guests if real is not None else None
    if guests is not None:
        # test_2 removed the tc marking by hand (drift repair is off): restarted agents put
        # it back from their journals, so that the revert below has all of it to undo
        kube.kubectl("delete", "pods", "-n", NAMESPACE, "-l", f"metaroce.io/network={NETWORK}")

        def configured() -> bool:
            states = [_agent_state_of(g) for g in guests]
            return all(
                RXE in st["rdma link"]
                and "clsact" in st["qdiscs"]
                and "4791" in st["egress filters"]
                and RXE in st["rdma_cm configfs"]
                and '"entries": []' not in st["journal"]
                for st in states
            )

        took = _wait("restarted agents re-applying the marking from their journals", configured)
        print(f"agents restarted and re-applied in {took:.1f} s")
    kube.kubectl("delete", "metarocenetwork", NETWORK, "--wait=true", timeout=240)
    _wait("agent pods gone", lambda: not _agent_pods(kube), 240)
    if guests is not None:
        for g in guests:
            st = _agent_state_of(g)
            assert RXE not in st["rdma link"], (g.name, st)
            assert "clsact" not in st["qdiscs"], (g.name, st)  # the agent made it: gone
            assert "4791" not in st["egress filters"], (g.name, st)
            assert RXE not in st["rdma_cm configfs"], (g.name, st)
            # every step undone: the journal is empty (or gone)
            assert not st["journal"].strip() or json.loads(st["journal"])["entries"] == [], st


# -- 5: a metaroce network ------------------------------------------------------------------

MR_NETWORK = "e2e-metaroce"
MR_RESOURCE = f"metaroce.io/{MR_NETWORK}"
MR_DSCP = 34
MR_PORTS = (25000, 25999)
MR_POD_NAMESPACE = "e2e-metaroce"
MR_LIBDIR = "/run/metaroce/transport/" + MR_NETWORK
MR_BIN = "/opt/metaroce-transport/bin"


def _transport_metric(kube: Kube, node: str, counter: str, pod: str) -> float:
    """`metaroce_transport_<counter>_total` of `pod` in the metaroce agent's /metrics on
    `node` (scraped inside the agent's pod); 0 while it has none."""
    agent = next(p for p in _mr_agents(kube) if p["spec"]["nodeName"] == node)
    scrape = (
        "import urllib.request; print(urllib.request.urlopen("
        f"'http://127.0.0.1:{constants.AGENT_METRICS_PORT}/metrics').read().decode())"
    )
    out = kube.kubectl(
        "exec", "-n", NAMESPACE, agent["metadata"]["name"], "--", "python3", "-c", scrape
    ).stdout
    for line in out.splitlines():
        if line.startswith(f"metaroce_transport_{counter}_total{{") and f'pod="{pod}"' in line:
            assert f'namespace="{MR_POD_NAMESPACE}"' in line and f'network="{MR_NETWORK}"' in line
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _metaroce_network() -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "metaroce.io/v1alpha1",
            "kind": "MetaRoceNetwork",
            "metadata": {"name": MR_NETWORK},
            "spec": {
                "nodeSelector": {"matchLabels": {LABEL: "true"}},
                # eth0 holds the node's InternalIP (the guests' one L2 link): say so
                "nics": {"interfaceNames": ["eth0"], "allowPrimaryInterface": True},
                "transport": {
                    "mode": "metaroce",
                    "metaroce": {
                        "portRange": {"first": MR_PORTS[0], "last": MR_PORTS[1]},
                        "paths": 4,
                    },
                },
                "qos": {"profile": "lossy", "data": {"dscp": MR_DSCP, "priority": 4}},
                "attachment": {"resourceName": MR_RESOURCE, "podsPerDevice": 4},
                # the UDP probe from eth0 (probe_udp), every 5 s so the test sees rounds
                "health": {"probe": {"interval": "5s"}},
                # the ToS check takes the node-level marking away on purpose: no drift
                # pass may put it back while the capture runs
                "agent": {"driftInterval": "1h"},
                "cleanupOnDelete": True,
            },
        }
    )


def _check_udp_probe(kube: Kube, nodes: list[str], figures: list[str]) -> None:
    """Each node probes the other over UDP from eth0 (a metaroce network has no RDMA
    device to probe with): the summary in its NodeState names the peer, reachable."""

    def peers() -> dict[str, dict[str, Any]]:
        out = {}
        for s in _mr_states(kube):
            found = ((s.get("status") or {}).get("probe") or {}).get("peers") or []
            out[s["spec"]["node"]] = {p["node"]: p for p in found}
        return out

    def both_reachable() -> bool:
        seen = peers()
        return all(
            (seen.get(me) or {}).get(other, {}).get("reachable") is True
            for me, other in ((nodes[0], nodes[1]), (nodes[1], nodes[0]))
        )

    took = _wait("each node's UDP probe reaching the other", both_reachable, 120)
    seen = peers()
    for me, other in ((nodes[0], nodes[1]), (nodes[1], nodes[0])):
        figures.append(f"metaroce UDP probe {me} -> {other}: {seen[me][other].get('message')}")
    figures.append(f"metaroce UDP probe: both peers reachable {took:.1f} s after the pods")


def _mr_states(kube: Kube, network: str = MR_NETWORK) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "metarocenodestates", "-l", f"metaroce.io/network={network}", "-o", "json"
    ).stdout
    return list(json.loads(out)["items"])


def _mr_ready_nodes(kube: Kube, config_generation: int = 0) -> list[str]:
    """The nodes whose metaroce NodeState is Ready on at least `config_generation`."""
    return sorted(
        s["spec"]["node"]
        for s in _mr_states(kube)
        if s.get("status", {}).get("phase") == "Ready"
        and s["status"].get("configGeneration", 0) >= config_generation
    )


def _mr_agents(kube: Kube, network: str = MR_NETWORK) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "pods", "-n", NAMESPACE, "-l", f"metaroce.io/network={network}", "-o", "json"
    ).stdout
    return list(json.loads(out)["items"])


def _print_revert_state(kube: Kube, network: str = MR_NETWORK) -> None:
    """What a network stuck in deletion waits for: its NodeStates' phases and conditions,
    and the end of each agent's log."""
    for st in _mr_states(kube, network):
        status = st.get("status") or {}
        conds = [(c.get("type"), c.get("reason"), c.get("message", "")[:300])
                 for c in status.get("conditions") or []]  # fmt: skip
        print(
            f"NodeState {st['metadata']['name']}: phase {status.get('phase')}, reverted "
            f"{status.get('reverted')}, applied {status.get('applied')}, conditions {conds}"
        )
    for pod in _mr_agents(kube, network):
        name = pod["metadata"]["name"]
        logs = kube.kubectl("logs", "-n", NAMESPACE, name, "-c", "agent", "--tail=60", check=False)
        print(f"--- agent {name} ({pod['spec'].get('nodeName')}):\n{logs.stdout}{logs.stderr}")


def _delete_network(kube: Kube, network: str, what: str, timeout: float) -> float | None:
    """Delete `network` and wait until it is gone (its finalizer waits for the nodes to
    revert); on timeout, print what it waits for. The seconds it took, None when the
    delete itself failed (the network was not there, or the apiserver refused)."""
    deleted = kube.kubectl("delete", "metarocenetwork", network, "--wait=false",
                           "--ignore-not-found", check=False)  # fmt: skip
    if deleted.returncode != 0:
        return None

    def gone() -> bool:
        return bool(kube.kubectl("get", "metarocenetwork", network, check=False).returncode != 0)

    try:
        return _wait(f"{what} deleted (its nodes reverted)", gone, timeout)
    except AssertionError:
        _print_revert_state(kube, network)
        raise


def _library_upgrade(
    kube: Kube,
    guests: Any,
    next_ref: str,
    library: dict[str, Any],
    pods: tuple[str, str],
    ips: tuple[str, str],
    get: Callable[[str], dict[str, Any]],
    run: Callable[[str, str], str],
) -> list[str]:
    """The agent upgraded under running pods: the network's agent image goes to the next
    version (build-images.sh's `agent-next`: another transport version and library). The
    new agents install it beside the old one; the running pods keep the directory they were
    handed, and keep it across a container restart (the kubelet re-uses the checkpointed
    Allocate answer); a new pod gets the new version; the old version goes once no pod
    holds it."""
    figures = []
    old_dir = library["directory"]
    old_name = old_dir.rsplit("/", 1)[1]
    nodes = sorted(get(p)["spec"]["nodeName"] for p in pods)

    def mounted(pod: str) -> str:  # the host directory behind the pod's library mount
        return run(pod, "grep ' /opt/metaroce-transport ' /proc/self/mountinfo")

    def library_dirs() -> dict[str, str]:  # node -> its Ready agent's library directory
        dirs = {}
        for s in _mr_states(kube):
            status = s.get("status", {})
            if status.get("phase") == "Ready":
                library = status.get("transport", {}).get("library", {})
                dirs[s["spec"]["node"]] = library.get("directory", "")
        return dirs

    def upgraded() -> bool:
        dirs = library_dirs()
        return sorted(dirs) == nodes and all(d and d != old_dir for d in dirs.values())

    patch = {"spec": {"agent": {"image": next_ref}}}
    kube.kubectl("patch", "metarocenetwork", MR_NETWORK, "--type=merge", "-p", json.dumps(patch))
    took = _wait("both metaroce agents Ready on the next version", upgraded, 420)
    new = set(library_dirs().values())
    assert len(new) == 1, new
    new_dir = new.pop()
    new_name = new_dir.rsplit("/", 1)[1]
    figures.append(
        f"metaroce upgrade to {next_ref}: both agents Ready with library {new_name} {took:.1f} s "
        f"after the patch (was {old_name})"
    )
    for g in guests:  # both versions on the node: the running pods hold the old one
        assert g.run(f"test -d {old_dir} && test -d {new_dir}").returncode == 0, g.name
    for pod in pods:
        assert old_name in mounted(pod), (pod, mounted(pod))
    report = pod_perf(kube, MR_POD_NAMESPACE, pods, ips, seconds=2, size=65536)
    assert report["messages"] > 0, report
    figures.append(
        f"metaroce upgrade: the running pods still on {old_name}, moved "
        f"{report['goodput_mbit']:.1f} Mbit/s"
    )

    # a container restart: its checkpointed Allocate answer, so the same version
    status = get(pods[0])["status"]["containerStatuses"][0]
    container = status["containerID"].split("://", 1)[1]
    guests[0].run(f"ctr -n k8s.io task kill -s SIGKILL {container}", check=True)

    def restarted() -> bool:
        st = get(pods[0])["status"]["containerStatuses"][0]
        return bool(st["restartCount"] > status["restartCount"] and st.get("ready"))

    took = _wait(f"{pods[0]}'s container restarted", restarted, 180, 1)
    assert old_name in mounted(pods[0]), mounted(pods[0])
    report = pod_perf(kube, MR_POD_NAMESPACE, pods, ips, seconds=2, size=65536)
    assert report["messages"] > 0, report
    figures.append(
        f"metaroce upgrade: {pods[0]}'s container restarted ({took:.1f} s), still on "
        f"{old_name}, moved {report['goodput_mbit']:.1f} Mbit/s"
    )

    # a new pod gets the new version
    node = get(pods[0])["spec"]["nodeName"]
    doc = annotated_pod("mr-c", MR_POD_NAMESPACE, node, kube.test_image, MR_NETWORK)
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    _wait("the new pod Ready", lambda: pod_ready(get("mr-c")), 240, 1)
    assert new_name in mounted("mr-c"), mounted("mr-c")
    assert "libmetaroce-fi.so" in run("mr-c", "ls /opt/metaroce-transport/lib")

    # the old version goes once no pod holds it (the agents check every minute)
    kube.kubectl("delete", "pod", "-n", MR_POD_NAMESPACE, *pods, "--wait=true", timeout=240)

    def swept() -> bool:
        return all(g.run(f"test -d {old_dir}").returncode != 0 for g in guests)

    took = _wait("the old library version removed on both nodes", swept, 300)
    assert guests[0].run(f"test -d {new_dir}").returncode == 0  # mr-c holds it
    figures.append(
        f"metaroce upgrade: a new pod got {new_name}; {old_name} removed from both nodes "
        f"{took:.1f} s after its pods were deleted"
    )
    return figures


def _tos_and_agent_restart(
    kube: Kube, guests: Any, pods: tuple[str, str], ips: tuple[str, str]
) -> list[str]:
    """ToS on the wire with the node-level marking off, then the sending node's agent pod
    restarted during a transfer. The library sets the network's DSCP on its own sockets,
    so with the agent's tc marking gone from node-1 the receiving node still sees it (ECN
    bits masked: the transport sets ECT). Deleting the agent pod mid-transfer must not cut
    the pods' traffic (the data plane is in the job's process), and the new agent puts
    the marking back, reports Ready and exports the pods' counters again."""
    figures = []
    sender, receiver = guests[0], guests[1]
    ports = f"{MR_PORTS[0]}-{MR_PORTS[1]}"
    filters = sender.run("tc -j filter show dev eth0 egress", check=True).stdout
    prefs = sorted({f["pref"] for f in json.loads(filters) if f.get("kind") == "flower"})
    assert prefs, filters
    for pref in prefs:
        sender.run(f"tc filter del dev eth0 egress pref {pref}", check=True)
    assert ports not in sender.run("tc filter show dev eth0 egress", check=True).stdout
    match = ["udp", "and", "src", "host", ips[0], "and", "portrange", ports]
    dump = receiver.start(["tcpdump", "-n", "-v", "-l", "-i", "eth0", "-c", "200", *match])
    time.sleep(2)  # tcpdump listening
    pod_perf(kube, MR_POD_NAMESPACE, pods, ips, seconds=2, size=65536)
    out = dump.kill().stdout
    tos = [int(t, 16) for t in re.findall(r"\btos (0x[0-9a-f]+)", out)]
    assert len(tos) >= 50, out[-2000:]
    assert {t & 0xFC for t in tos} == {MR_DSCP << 2}, sorted(set(tos))
    figures.append(
        f"ToS of {len(tos)} metaroce packets from pod {pods[0]} seen on {receiver.name} with "
        f"{sender.name}'s marking off: {sorted({hex(t) for t in tos})} (DSCP {MR_DSCP}, ECT)"
    )

    agent = next(p for p in _mr_agents(kube) if p["spec"]["nodeName"] == kube.nodes[0])
    before = _transport_metric(kube, kube.nodes[0], "bytes_sent", pods[0])
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(pod_perf, kube, MR_POD_NAMESPACE, pods, ips, seconds=30, size=65536)
        time.sleep(8)
        assert not run.done(), "the transfer ended before the agent restart"
        kube.kubectl("delete", "pod", "-n", NAMESPACE, agent["metadata"]["name"], "--wait=false")
        result = run.result(timeout=240)
    assert result["messages"] > 0 and len(result["paths"]) == 4, result
    figures.append(
        f"metaroce-perf across the restart of {kube.nodes[0]}'s agent pod (30 s): "
        f"{result['goodput_mbit']} Mbit/s, {result['retransmits']} retransmits, completed"
    )

    def back() -> bool:
        new = [p for p in _mr_agents(kube) if p["spec"]["nodeName"] == kube.nodes[0]]
        fresh = [p for p in new if p["metadata"]["name"] != agent["metadata"]["name"]]
        return (
            bool(fresh)
            and all(pod_ready(p) for p in fresh)
            and _mr_ready_nodes(kube) == sorted(kube.nodes[:2])
        )

    took = _wait("the restarted agent Ready", back, 300)
    shown = sender.run("tc filter show dev eth0 egress", check=True).stdout
    assert shown.count(ports) == 4, shown  # its marking is back (dst and src, IPv4 and IPv6)
    _wait(
        "the pods' counters exported again by the new agent",
        lambda: _transport_metric(kube, kube.nodes[0], "bytes_sent", pods[0]) > before,
        120,
    )
    figures.append(f"the restarted agent Ready {took:.1f} s after, marking back, export resumed")
    return figures


def test_5_metaroce_network_rolls_out_and_pods_get_the_library(
    kube: Kube, operator: None, figures: list[str]
) -> None:
    """A metaroce network: agents Ready on both nodes with the library installed and
    self-tested, the port range marked, the resource advertised; annotated pods get the
    read-only library mount and the environment, and move data with metaroce-perf between
    them; deleting the network removes what the agents made."""
    nodes = kube.nodes[:2]
    kube.kubectl("delete", "metarocenetwork", NETWORK, "--ignore-not-found", timeout=240)
    kube.kubectl("apply", "-f", "-", input=_metaroce_network())
    try:
        try:
            took = _wait(
                "metaroce NodeStates Ready on both nodes",
                lambda: _mr_ready_nodes(kube) == sorted(nodes),
                420,
            )
        except AssertionError:
            _print_revert_state(kube)  # what each node reports, and its agent's log
            raise
        figures.append(f"metaroce network: NodeStates Ready {took:.1f} s after apply")
        _wait(
            f"{MR_RESOURCE} advertised by both nodes",
            lambda: all(
                json.loads(kube.kubectl("get", "node", n, "-o", "json").stdout)["status"]
                .get("allocatable", {})
                .get(MR_RESOURCE, "0")
                == "4"
                for n in nodes
            ),
        )
        states = _mr_states(kube)
        libs = {s["status"]["transport"]["library"]["checksum"] for s in states}
        assert len(libs) == 1, states  # the same image on both nodes
        library = states[0]["status"]["transport"]["library"]
        assert states[0]["status"]["transport"]["devices"] == ["eth0"], states[0]
        real = kube.real_nodes
        if real is not None and real.guests is not None:
            for g in real.guests:
                listing = g.run(f"stat -c '%U %a %n' {library['directory']}", check=True).stdout
                assert listing.startswith("root 555 "), (g.name, listing)
                filters = g.run("tc filter show dev eth0 egress", check=True).stdout
                # dst and src, for IPv4 and IPv6 endpoints (a pref holds one protocol)
                assert filters.count(f"{MR_PORTS[0]}-{MR_PORTS[1]}") == 4, (g.name, filters)
                assert "protocol ipv6 pref 4794" in filters, (g.name, filters)
                assert "rxe" not in g.run("rdma link", check=True).stdout, g.name

        kube.kubectl("create", "namespace", MR_POD_NAMESPACE, check=False)
        names = ("mr-a", "mr-b")
        docs = pod_transport.mpi_launcher_rbac(MR_POD_NAMESPACE)
        for name, node in zip(names, nodes, strict=True):
            docs.append(annotated_pod(name, MR_POD_NAMESPACE, node, kube.test_image, MR_NETWORK))
        docs[-2]["spec"]["serviceAccountName"] = pod_transport.MPI_LAUNCHER_SA  # mr-a launches
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

        def get(name: str) -> dict[str, Any]:
            out = kube.kubectl("get", "pod", name, "-n", MR_POD_NAMESPACE, "-o", "json").stdout
            return dict(json.loads(out))

        def run(name: str, script: str, timeout: float = 120) -> str:
            return kube.kubectl(
                "exec", "-n", MR_POD_NAMESPACE, name, "--", "sh", "-c", script, timeout=timeout
            ).stdout

        _wait("both metaroce pods Ready", lambda: all(pod_ready(get(n)) for n in names), 240, 1)
        _check_udp_probe(kube, nodes, figures)
        for name in names:
            env = dict(line.split("=", 1) for line in run(name, "env").splitlines() if "=" in line)
            assert env["FI_PROVIDER"] == "metaroce" and env["NCCL_NET_PLUGIN"] == "metaroce", env
            assert f"ports={MR_PORTS[0]}-{MR_PORTS[1]}" in env["MR_CONFIG"], env
            assert "paths=4" in env["MR_CONFIG"] and f"dscp={MR_DSCP}" in env["MR_CONFIG"], env
            assert env["MR_NCCL_IFNAME"] == "=eth0" and env["FI_METAROCE_IFACE"] == "eth0", env
            assert env["MR_TRANSPORT_CHECKSUM"] == library["checksum"], env
            assert env["FI_PROVIDER_PATH"].startswith("/opt/metaroce-transport/lib:"), env
            mounted = run(name, "ls /opt/metaroce-transport/lib /opt/metaroce-transport/bin")
            assert "libnccl-net-metaroce.so" in mounted and "libmetaroce-fi.so" in mounted
            denied = kube.kubectl(
                "exec", "-n", MR_POD_NAMESPACE, name, "--", "touch", "/opt/metaroce-transport/x",
                check=False,
            )  # fmt: skip
            assert denied.returncode != 0 and "Read-only" in denied.stderr, denied.stderr
            # the provider through the pod's own libfabric, with the injected settings
            out = run(
                name,
                'MR_CONFIG="$MR_CONFIG,addr=127.0.0.1" ' + f"{MR_BIN}/metaroce-fi-selftest",
            )
            assert "ALL-OK" in out, out

        # data between the two pods over the transport, with the network's settings
        ip_a, ip_b = (get(n)["status"]["podIP"] for n in names)
        result = pod_perf(
            kube, MR_POD_NAMESPACE, names, (ip_a, ip_b), seconds=2, size=65536,
            port_range=MR_PORTS,  # the server's port is in the network's range
        )  # fmt: skip
        figures.append(
            f"metaroce-perf between the pods (64 KiB messages, 2 s, TCG guests): "
            f"{result['goodput_mbit']} Mbit/s, {result['retransmits']} retransmits of "
            f"{result['packets_sent']} packets over {len(result['paths'])} paths"
        )
        assert result["messages"] > 0 and len(result["paths"]) == 4, result
        took, out = _test_rdma(kube, MR_NETWORK, MR_POD_NAMESPACE, "--perf-flags=--size 65536")
        figures.append(f"metaroce test-rdma (pods it makes, metaroce-perf): {took:.1f} s")
        assert re.search(r"bandwidth \(metaroce-perf, 4 s\): [\d.]+ Gb/s, \d+ retransmits", out)
        assert re.search(r"latency \(metaroce-perf, 8 B round trips\): p50 [\d.]+ us", out), out

        # the library's stats files, in each pod's own directory, exported by its agent
        for name in names:
            assert run(name, 'echo "$MR_STATS_DIR"').strip() == "/run/metaroce-stats"
            assert "ep-" in run(name, "ls /run/metaroce-stats"), name
        sent = received = 0.0

        def exported() -> bool:
            nonlocal sent, received
            sent = _transport_metric(kube, nodes[0], "bytes_sent", "mr-a")
            received = _transport_metric(kube, nodes[1], "bytes_received", "mr-b")
            return sent > 0 and received > 0

        took = _wait("the pods' transport counters in the agents' /metrics", exported, 60, 2)
        figures.append(f"metaroce: the pods' stats exported by the agents {took:.1f} s after")
        assert received >= result["bytes"], (received, result)
        pod_transport.stage_mpi(kube, MR_POD_NAMESPACE, names, (ip_a, ip_b))
        for clients in (pod_transport.pod_clients, pod_transport.pod_mpi):
            figures.extend(clients(kube, MR_POD_NAMESPACE, names, (ip_a, ip_b), "lossless"))
        if real is not None and real.guests is not None:
            figures.extend(_tos_and_agent_restart(kube, real.guests, names, (ip_a, ip_b)))

        if real is None or real.guests is None:
            figures.append("metaroce under netem loss, rxe beside it, pod / node: not run "
                           "(an external cluster: netem needs the harness's guests)")  # fmt: skip
        else:
            arms = pod_transport.measure(
                kube, (real.guests[0], real.guests[1]), MR_POD_NAMESPACE, names,
                (ip_a, ip_b), run("mr-a", 'echo "$MR_CONFIG"').strip(),
                node_runs=TRANSPORT_RUNS, loss_runs=TRANSPORT_RUNS,
                node_arm=False,  # pod ÷ node is test_6's, over the data NIC's attachment
            )  # fmt: skip
            figures.extend(pod_transport.figures(arms))
            for r in arms.reports:  # the transport carried the bytes, loss was really there
                assert r["messages"] > 0 and len(r["paths"]) == 4, r
                assert r["retransmits"] > 0 or r["arm"] != "pod 1%", r
            # Floors against breakage only, far below the issue's figures (0.85 and
            # 0.95, which the tier prints as measured): single runs between TCG
            # guests vary 3x on a busy 2-core host (seen 2026-12-01, load 5: 1% loss
            # 0.70 of lossless, pod / node 0.63 over the pod network's veth and bridge).
            ratio = arms.median("pod 1%") / arms.median("pod 0%")
            assert ratio >= 0.4, (ratio, arms.runs)
            try:  # the real clients again, under 1% loss each way (netem on both nodes)
                for g in real.guests[:2]:
                    set_netem(g, 1.0, NETEM_DELAY_MS)
                for clients in (pod_transport.pod_clients, pod_transport.pod_mpi):
                    figures.extend(
                        clients(kube, MR_POD_NAMESPACE, names, (ip_a, ip_b), "1% netem loss")
                    )
            finally:
                for g in real.guests[:2]:
                    clear_qdisc(g)

        if real is not None and real.guests is not None:
            assert real.images is not None and real.images.agent_next_ref, real.images
            figures.extend(
                _library_upgrade(
                    kube, real.guests[:2], real.images.agent_next_ref, library,
                    names, (ip_a, ip_b), get, run,
                )
            )  # fmt: skip

        kube.kubectl("delete", "namespace", MR_POD_NAMESPACE, "--wait=true", timeout=240)
    finally:
        kube.kubectl("delete", "namespace", MR_POD_NAMESPACE, "--ignore-not-found", check=False)
        _delete_network(kube, MR_NETWORK, "the metaroce network", 240)
    _wait("metaroce agent pods gone", lambda: not _mr_agents(kube), 240)
    real = kube.real_nodes
    if real is not None and real.guests is not None:
        for g in real.guests:
            assert "25000-25999" not in g.run("tc filter show dev eth0 egress", check=True).stdout
            left = g.run(f"ls {MR_LIBDIR} 2>/dev/null || true", check=True).stdout.strip()
            assert not left, (g.name, left)
            stats = f"/run/metaroce/agent/{MR_NETWORK}/stats"
            left = g.run(f"ls {stats} 2>/dev/null || true", check=True).stdout.strip()
            assert not left, (g.name, "stats directories of gone pods", left)


# -- 6: pods reach the data NIC through Multus (issue 14 item 1) ---------------------------

PN_NETWORK = "e2e-podnet"
PN_RESOURCE = f"metaroce.io/{PN_NETWORK}"
PN_SUBNET = "10.56.0.0/16"
PN_POD_NAMESPACE = "e2e-podnet"
MULTUS_STATUS = "k8s.v1.cni.cncf.io/network-status"


def _podnet_network(mode: str) -> str:
    doc = yaml.safe_load(_metaroce_network())
    doc["metadata"]["name"] = PN_NETWORK
    doc["spec"]["attachment"] = {
        "resourceName": PN_RESOURCE,
        "podsPerDevice": 4,
        "podNetwork": {"mode": mode, "subnet": PN_SUBNET},
    }
    return str(yaml.safe_dump(doc))


def _pn_ready_nodes(kube: Kube) -> list[str]:
    out = kube.kubectl(
        "get", "metarocenodestates", "-l", f"metaroce.io/network={PN_NETWORK}", "-o", "json"
    ).stdout
    return sorted(
        s["spec"]["node"]
        for s in json.loads(out)["items"]
        if (s.get("status") or {}).get("phase") == "Ready"
    )


def _mr0(pod: dict[str, Any]) -> str:
    """The pod's mr0 address, from the network-status Multus wrote on the pod."""
    status = json.loads(pod["metadata"].get("annotations", {}).get(MULTUS_STATUS, "[]"))
    found = [s for s in status if s.get("interface") == "mr0"]
    assert found and found[0].get("ips"), status
    return str(found[0]["ips"][0])


def test_6_pods_reach_the_data_nic_through_multus(
    kube: Kube, operator: None, figures: list[str]
) -> None:
    """A metaroce network with podNetwork macvlan, then the same with ipvlan: the
    operator renders its NAD and gives each node a block of the subnet, the agents write
    the nodes' CNI configuration, the webhook adds the pods' Multus entry, and two
    annotated pods get `mr0` on the node's eth0 with an address of their node's block.
    metaroce-perf between those addresses moves its bytes through mr0 (the pods'
    interface counters), not through the pod network's eth0, and pod ÷ node goodput is
    measured over ipvlan (one mode keeps the tier short; `METAROCE_E2E_TRANSPORT_RUNS=5`
    for the issue's median of five); deleting the network (cleanupOnDelete) removes the nodes' CNI
    configuration and the blocks."""
    real = kube.real_nodes
    if real is None or real.guests is None:
        pytest.skip("Multus is the harness's: an external cluster brings its own (docs/kind.md)")
    for mode in ("macvlan", "ipvlan"):
        # one hostNetwork pod and one pod ÷ node measurement: each needs one mode only
        _podnet_round(
            kube, real, mode, figures, host_pod=mode == "macvlan", pod_node=mode == "ipvlan"
        )


def _podnet_round(
    kube: Kube, real: RealNodes, mode: str, figures: list[str], *, host_pod: bool, pod_node: bool
) -> None:
    """test_6 with one attachment mode, from apply to the network's cleanup."""
    assert real.guests is not None
    nodes = kube.nodes[:2]
    kube.kubectl("delete", "metarocenetwork", PN_NETWORK, "--ignore-not-found", timeout=240)
    kube.kubectl("apply", "-f", "-", input=_podnet_network(mode))
    conf = f"/etc/cni/multus/net.d/metaroce-{PN_NETWORK}.conf"
    try:
        took = _wait(
            "podnet NodeStates Ready on both nodes",
            lambda: _pn_ready_nodes(kube) == sorted(nodes),
            420,
        )
        figures.append(f"podNetwork {mode}: NodeStates Ready {took:.1f} s after apply")
        node_objs = {
            n: json.loads(kube.kubectl("get", "node", n, "-o", "json").stdout) for n in nodes
        }
        blocks = {
            n: o["metadata"]["annotations"][f"podnet.metaroce.io/{PN_NETWORK}"]
            for n, o in node_objs.items()
        }
        assert len(set(blocks.values())) == 2, blocks
        nad = json.loads(
            kube.kubectl(
                "get", "network-attachment-definitions.k8s.cni.cncf.io",
                f"metaroce-{PN_NETWORK}", "-n", NAMESPACE, "-o", "json",
            ).stdout
        )  # fmt: skip
        assert not (nad.get("spec") or {}).get("config"), nad
        for g, n in zip(real.guests, nodes, strict=False):
            written = json.loads(g.run(f"cat {conf}", check=True).stdout)
            assert written["type"] == mode and written["master"] == "eth0", written
            ipam = written["ipam"]["ranges"][0][0]
            assert ipam["subnet"] == PN_SUBNET, written
            assert ipam["rangeStart"].rsplit(".", 1)[0] == blocks[n].rsplit(".", 1)[0]

        kube.kubectl("create", "namespace", PN_POD_NAMESPACE, check=False)
        names = ("pn-a", "pn-b")
        docs = []
        for name, node in zip(names, nodes, strict=True):
            docs.append(annotated_pod(name, PN_POD_NAMESPACE, node, kube.test_image, PN_NETWORK))
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

        def get(name: str) -> dict[str, Any]:
            out = kube.kubectl("get", "pod", name, "-n", PN_POD_NAMESPACE, "-o", "json").stdout
            return dict(json.loads(out))

        def run(name: str, script: str) -> str:
            return kube.kubectl(
                "exec", "-n", PN_POD_NAMESPACE, name, "--", "sh", "-c", script, timeout=120
            ).stdout

        took = _wait(
            "both podnet pods Ready", lambda: all(pod_ready(get(n)) for n in names), 240, 1
        )
        figures.append(f"podNetwork {mode}: both pods Ready {took:.1f} s after create")
        pods = {n: get(n) for n in names}
        ips = (_mr0(pods["pn-a"]), _mr0(pods["pn-b"]))
        for name, node, ip in zip(names, nodes, ips, strict=True):
            # the cluster network still comes first, through Multus's default delegate
            assert pods[name]["status"]["podIP"].startswith("10.244."), pods[name]["status"]
            ann = pods[name]["metadata"]["annotations"]
            assert ann["k8s.v1.cni.cncf.io/networks"] == (
                f"{NAMESPACE}/metaroce-{PN_NETWORK}@mr0"
            ), ann
            block = blocks[node]
            assert ip.rsplit(".", 1)[0] == block.rsplit(".", 1)[0], (name, ip, block)
            env = dict(line.split("=", 1) for line in run(name, "env").splitlines() if "=" in line)
            assert env["FI_METAROCE_IFACE"] == "mr0" and env["MR_NCCL_IFNAME"] == "=mr0", env
            assert run(name, "cat /sys/class/net/mr0/operstate").strip() in ("up", "unknown")
        figures.append(f"podNetwork {mode}: mr0 {ips[0]} on {nodes[0]}, {ips[1]} on {nodes[1]}")
        if host_pod:
            # a hostNetwork pod of the network: no attachment, the transport binds the netdev
            host = annotated_pod("pn-host", PN_POD_NAMESPACE, nodes[0], kube.test_image,
                                 PN_NETWORK)  # fmt: skip
            host["spec"]["hostNetwork"] = True
            kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(host))
            _wait("the hostNetwork pod Ready", lambda: pod_ready(get("pn-host")), 240, 1)
            assert "k8s.v1.cni.cncf.io/networks" not in get("pn-host")["metadata"]["annotations"]
            lines = run("pn-host", "env").splitlines()
            env = dict(line.split("=", 1) for line in lines if "=" in line)
            assert env["FI_METAROCE_IFACE"] == "eth0" and env["MR_NCCL_IFNAME"] == "=eth0", env
            kube.kubectl("delete", "pod", "pn-host", "-n", PN_POD_NAMESPACE, "--wait=false")

        counters = (
            "cat /sys/class/net/mr0/statistics/tx_bytes /sys/class/net/mr0/statistics/rx_bytes "
            "/sys/class/net/eth0/statistics/tx_bytes /sys/class/net/eth0/statistics/rx_bytes"
        )

        def read(name: str) -> list[int]:
            return [int(v) for v in run(name, counters).split()]

        before = {n: read(n) for n in names}
        result = pod_perf(
            kube, PN_POD_NAMESPACE, names, ips, seconds=2, size=65536, port_range=MR_PORTS
        )
        after = {n: read(n) for n in names}
        delta = {n: [a - b for a, b in zip(after[n], before[n], strict=True)] for n in names}
        sent = result["bytes"]
        figures.append(
            f"podNetwork {mode}: metaroce-perf {result['goodput_mbit']} Mbit/s over mr0; "
            f"client mr0 tx {delta['pn-a'][0]} B, eth0 tx {delta['pn-a'][2]} B; server mr0 "
            f"rx {delta['pn-b'][1]} B, eth0 rx {delta['pn-b'][3]} B ({sent} B of payload)"
        )
        assert result["messages"] > 0 and sent > 0, result
        # the payload crossed mr0 (the client sends it, the server receives it) ...
        assert delta["pn-a"][0] >= sent and delta["pn-b"][1] >= sent, (delta, sent)
        # ... and not the pod network's eth0 (kubectl exec does not use it)
        assert delta["pn-a"][2] < sent // 10 and delta["pn-b"][3] < sent // 10, (delta, sent)
        if pod_node:
            # Pod ÷ node through the data NIC's own attachment (test_5's pods use the pod
            # network's veth and bridge, which costs the TCG guests a third or more).
            arms = pod_transport.measure(
                kube, (real.guests[0], real.guests[1]), PN_POD_NAMESPACE, names, ips,
                run("pn-a", 'echo "$MR_CONFIG"').strip(), node_runs=TRANSPORT_RUNS, loss_runs=0,
            )  # fmt: skip
            figures.append(pod_transport.pod_node_figure(arms, f"mr0 ({mode} on eth0)"))
            ratio = arms.paired_ratio("pod 0%", "node 0%")
            assert ratio >= 0.3, (ratio, arms.runs)  # a floor against breakage only
        kube.kubectl("delete", "namespace", PN_POD_NAMESPACE, "--wait=true", timeout=240)
    finally:
        kube.kubectl("delete", "namespace", PN_POD_NAMESPACE, "--ignore-not-found", check=False)
        took = _delete_network(kube, PN_NETWORK, f"the {mode} podnet network", 300)
        if took is not None:
            figures.append(f"podNetwork {mode}: network deleted, nodes reverted {took:.1f} s")
    # cleanupOnDelete: the agents removed the nodes' CNI configuration, the operator the
    # blocks and the garbage collector the NAD
    for g in real.guests[:2]:
        assert g.run(f"test -e {conf}").returncode != 0, g.name

    def blocks_gone() -> bool:
        out = kube.kubectl("get", "nodes", "-o", "json").stdout
        return not any(
            f"podnet.metaroce.io/{PN_NETWORK}" in (n["metadata"].get("annotations") or {})
            for n in json.loads(out)["items"]
        )

    _wait("the nodes' pod blocks removed", blocks_gone, 60)
