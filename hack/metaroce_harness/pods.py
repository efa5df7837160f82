"""Annotated pods on real nodes, as the demo (``demo.py``) and the real-node e2e tests
(``tests/e2e/nodes``) use them: one place for both, so the demo shows what the tests check.

- ``Kube``: a kubeconfig, the nodes to use and how to run kubectl against them;
- ``annotated_pod``: what a user writes for a training pod (the annotation and nothing
  else RDMA-related), pinned to a node;
- ``pod_perf``: ``metaroce-perf`` between two pods of a metaroce network, with the settings
  the admission and the device plugin gave them (``MR_CONFIG``);
- ``ib_write_bw``: one ``ib_write_bw`` run between two pods (``in_pod``) or two guests
  (``on_node``), and ``LinkCounters``: what a run cost the link (rxe's retransmission
  counters at both ends, the frames the guests' L2 carried and dropped), with
  ``diagnose`` saying why a run moved nothing;
- ``Arms``: goodput of interleaved runs by arm, with medians and paired ratios.
"""

from __future__ import annotations

import json
import re
import selectors
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metaroce_api import constants
from metaroce_harness.guest_transport import hw_counters, perftest_average_gbps
from metaroce_harness.guests import Guest, GuestCluster, GuestTimeoutError
from metaroce_harness.nodes import RealNodes

MR_BIN = "/opt/metaroce-transport/bin"
"""Where an annotated pod of a metaroce network finds the tools the agent installed."""
PERF_SECONDS = 5.0
PERF_SIZE = 64 << 10
PERF_WINDOW = 32
"""metaroce-perf runs between pods: kubelet, containerd and the agents share each node's
one emulated CPU: seen 15-50 Mbit/s between the pods, so a run of 1 MiB messages moved
about ten of them and its figure was mostly slow start and tail. 64 KiB messages give
hundreds per run."""
RXE = "rxe_eth0"
"""The rxe device a softroce network's agent makes on the guests' eth0."""
REQUESTER_COUNTERS = ("completer_retry_err", "retry_exceeded_err", "rcvd_seq_err")
RESPONDER_COUNTERS = ("duplicate_request", "out_of_seq_request")
"""rxe hw_counters of one RC run: at the requester (node-1) and the responder (node-2).
``completer_retry_err`` counts every go-back-N restart (ACK timeout or NAK), each of
which resends the whole window from the lost packet."""


@dataclass
class Kube:
    """A kubeconfig, the nodes to use and how to run kubectl."""

    kubeconfig: Path
    nodes: list[str]
    test_image: str
    kubectl_bin: str
    real_nodes: RealNodes | None = None  # only when the caller made the cluster
    timings: dict[str, float] = field(default_factory=dict)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc

    def exec_argv(self, namespace: str, pod: str, script: str) -> list[str]:
        """``kubectl exec`` of a shell script in ``pod``, for Popen."""
        return [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", "exec", "-n", namespace,
                pod, "--", "sh", "-c", script]  # fmt: skip

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        out = self.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout
        return dict(json.loads(out))

    def env(self, namespace: str, pod: str) -> dict[str, str]:
        """The environment of ``pod``'s container, as the admission and the device plugin
        left it."""
        out = self.kubectl("exec", "-n", namespace, pod, "--", "env").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def annotated_pod(name: str, namespace: str, node: str, image: str, network: str) -> dict[str, Any]:
    """What a user writes: the annotation and nothing else RDMA-related."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": {constants.NETWORKS_ANNOTATION: network},
        },
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "train", "image": image, "imagePullPolicy": "IfNotPresent"}],
        },
    }


def pod_ready(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or [{"ready": False}]
    return all(c["ready"] for c in statuses)


# -- metaroce-perf between two pods ------------------------------------------------------------


def pod_perf(
    kube: Kube,
    namespace: str,
    pods: tuple[str, str],
    ips: tuple[str, str],
    *,
    seconds: float = PERF_SECONDS,
    size: int = PERF_SIZE,
    window: int = PERF_WINDOW,
    port_range: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One metaroce-perf bandwidth run from ``pods[0]`` to ``pods[1]`` with each pod's
    injected settings; the client's ``--json`` report."""
    client, server = pods
    srv = subprocess.Popen(
        kube.exec_argv(namespace, server,
                       f"exec timeout {seconds + 120:.0f} {MR_BIN}/metaroce-perf server --once "
                       f'--config "$MR_CONFIG,addr={ips[1]},stats_dir=$MR_STATS_DIR"'),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = _listening_url(srv, 60)
        if port_range is not None:
            port = int(url.rsplit(":", 1)[1])
            assert port_range[0] <= port <= port_range[1], (url, port_range)
        out = kube.kubectl(
            "exec", "-n", namespace, client, "--", "sh", "-c",
            f"{MR_BIN}/metaroce-perf client {url} --mode bw --size {size} --window {window} "
            f"--duration {seconds} --json "
            f'--config "$MR_CONFIG,addr={ips[0]},stats_dir=$MR_STATS_DIR"',
            timeout=seconds + 120,
        ).stdout  # fmt: skip
        srv.wait(60)
        return dict(json.loads(out.strip().splitlines()[-1]))
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()


def _listening_url(srv: subprocess.Popen[str], timeout: float) -> str:
    """The server's ``listening on udp://...`` line, or AssertionError with its output."""
    assert srv.stdout is not None
    seen = ""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(srv.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                continue
            line = srv.stdout.readline()
            if not line:
                break
            seen += line
            m = re.search(r"listening on (\S+)", line)
            if m:
                return m.group(1)
    raise AssertionError(f"metaroce-perf server in the pod did not start: {seen[-2000:]!r}")


# -- ib_write_bw between two pods or two guests -------------------------------------------------

StartServer = Callable[[str], Callable[[], None]]
"""Starts a command; returns what waits for its end."""
RunClient = Callable[[str], tuple[int, str]]
"""Runs a command to its end: exit code and output."""


class LinkCounters:
    """What ib_write_bw runs cost the link between the guests: rxe's retransmission
    counters at the requester (node-1) and the responder (node-2), and the frames the
    harness's L2 carried and dropped. Device-wide, so pods and nodes share them."""

    def __init__(self, guests: GuestCluster) -> None:
        self.guests = guests
        self.before = self.read()

    def read(self) -> dict[str, int]:
        req, resp = (hw_counters(g, RXE) for g in self.guests)
        l2 = self.guests.l2_counters()
        found = {f"node-1 {k}": req.get(k, 0) for k in REQUESTER_COUNTERS}
        found |= {f"node-2 {k}": resp.get(k, 0) for k in RESPONDER_COUNTERS}
        found |= {f"L2 ({l2.kind}) frames": l2.frames, f"L2 ({l2.kind}) dropped": l2.dropped}
        found |= {f"{g.name} NIC tx stalls": g.tx_stalls() for g in self.guests}
        return found

    def delta(self) -> dict[str, int]:
        """The counts since the last call (or since construction)."""
        now = self.read()
        delta = {k: v - self.before.get(k, 0) for k, v in now.items()}
        self.before = now
        return delta


def diagnose(delta: dict[str, int]) -> str:
    """What the counters of a run say about why it moved nothing (or retransmitted)."""
    retries = delta.get("node-1 completer_retry_err", 0)
    dupes = delta.get("node-2 duplicate_request", 0)
    dropped = sum(v for k, v in delta.items() if k.endswith("dropped"))
    stalled = [k.split()[0] for k, v in delta.items() if k.endswith("tx stalls") and v]
    if stalled:
        return (
            f"{', '.join(stalled)}: the emulated NIC stopped transmitting (NETDEV WATCHDOG on "
            "the guest's console): a qemu/TCG stall of the guest's virtio NIC, not the "
            "network's settings, loss or an ACK timeout"
        )
    if dropped:
        return (
            f"the guests' L2 dropped {dropped} frame(s): RoCE's go-back-N stalls for an ACK "
            "timeout per loss; the lossless link must not drop (a TCG guest stalled long "
            "enough to fill its tap queue?)"
        )
    if retries:
        return (
            f"retry storm, not loss: the requester's ACK timer expired {retries} time(s) and "
            f"it resent (completer_retry_err +{retries}), the responder saw {dupes} duplicate "
            "request(s), and the L2 dropped nothing: the ACK timeout (-u) is shorter than the "
            "emulated responder takes to ACK a message"
        )
    return "no RoCE retransmission and no drop: the run did not start or the peer failed"


# perftest's get_cpu_mhz() fits cycles against time; under TCG the fit can fall below its
# r^2 of 0.9, and then it prints this and reports every bandwidth as 0 although the
# iterations ran: a fault of the tool's clock, not of the link, so that run is repeated.
CLOCK_NOT_CALIBRATED = "Correlation coefficient r^2"
CALIBRATION_RUNS = 3


def ib_write_bw(
    start_server: StartServer,
    run_client: RunClient,
    server_ip: str,
    flags: str,
    link: LinkCounters | None,
    revive_l2: Callable[[], str | None] | None = None,
) -> tuple[float, dict[str, int]]:
    """One complete ib_write_bw run on ``RXE``: the client's average bandwidth in Gb/s
    and what it cost the link. A run that moves nothing is not retried: it fails
    (AssertionError) with the counters and what they say. Only a run whose bandwidth
    perftest could not compute (its clock not calibrated) is repeated, and, once, a run
    during which the guests' L2 died: ``revive_l2`` (``l2_health.heal_l2``) says None
    while the L2 answers, or revives it and says how."""
    try:
        return _ib_write_bw_calibrated(start_server, run_client, server_ip, flags, link)
    except AssertionError as failure:
        healed = revive_l2() if revive_l2 is not None else None
        if healed is None:
            raise
        print(f"ib_write_bw moved nothing because {healed.splitlines()[0]}; running it "
              f"again\nthe failed run: {str(failure)[:2000]}\n{healed}", flush=True)  # fmt: skip
        return _ib_write_bw_calibrated(start_server, run_client, server_ip, flags, link)


def _ib_write_bw_calibrated(
    start_server: StartServer,
    run_client: RunClient,
    server_ip: str,
    flags: str,
    link: LinkCounters | None,
) -> tuple[float, dict[str, int]]:
    for run in range(1, CALIBRATION_RUNS + 1):
        code, out = _ib_write_bw_once(start_server, run_client, server_ip, flags)
        delta = link.delta() if link is not None else {}
        bw = perftest_average_gbps(out)
        if code == 0 and bw > 0:
            return bw, delta
        if code != 0 or CLOCK_NOT_CALIBRATED not in out or run == CALIBRATION_RUNS:
            break
        print(f"ib_write_bw run {run}: perftest could not calibrate its cycle clock "
              f"(r^2 < 0.9 under TCG) and printed 0 Gb/s; running again", flush=True)  # fmt: skip
    why = diagnose(delta) if link else ""
    if code == 0 and CLOCK_NOT_CALIBRATED in out:
        why = f"perftest could not calibrate its cycle clock in {run} run(s); {why}"
    raise AssertionError(
        f"ib_write_bw moved nothing (exit {code}): {why}\ncounters of the run: {delta}\n{out}"
    )


def _ib_write_bw_once(
    start_server: StartServer, run_client: RunClient, server_ip: str, flags: str
) -> tuple[int, str]:
    """A server and its client's run: the client's exit code and output."""
    out = ""
    code = 1
    finish_server = start_server(f"timeout 150 ib_write_bw -d {RXE} {flags}")
    try:
        for _ in range(10):  # the server listens only once set up (slow under TCG)
            time.sleep(3)
            code, out = run_client(f"timeout 120 ib_write_bw -d {RXE} {flags} {server_ip}")
            if code == 0 or "Couldn't connect" not in out:
                break
    finally:
        finish_server()
    return code, out


def in_pod(kube: Kube, namespace: str, name: str) -> tuple[StartServer, RunClient]:
    """ib_write_bw's server and client callables for a pod."""

    def server(cmd: str) -> Callable[[], None]:
        proc = subprocess.Popen(
            kube.exec_argv(namespace, name, f"exec {cmd}"),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

        def finish() -> None:
            proc.communicate(timeout=180)

        return finish

    def client(cmd: str) -> tuple[int, str]:
        try:
            proc = kube.kubectl("exec", "-n", namespace, name, "--", "sh", "-c", cmd,
                                check=False, timeout=150)  # fmt: skip
        except subprocess.TimeoutExpired as exc:  # the diagnosis of the run says why
            out = exc.output.decode() if isinstance(exc.output, bytes) else str(exc.output or "")
            return 124, f"{out}\n(kubectl exec did not return within {exc.timeout} s)"
        return proc.returncode, proc.stdout + proc.stderr

    return server, client


def on_node(guest: Guest) -> tuple[StartServer, RunClient]:
    """ib_write_bw's server and client callables for a guest itself."""

    def server(cmd: str) -> Callable[[], None]:
        job = guest.start(f"exec {cmd}")

        def finish() -> None:
            job.wait(timeout=180)

        return finish

    def client(cmd: str) -> tuple[int, str]:
        try:
            result = guest.run(cmd, timeout=150)
        except GuestTimeoutError as exc:  # the diagnosis of the run says why
            partial = exc.result.stdout if exc.result is not None else ""
            return 124, f"{partial}\n(did not return within 150 s)"
        return result.returncode, result.stdout + result.stderr

    return server, client


# -- figures of interleaved runs ----------------------------------------------------------------


@dataclass
class Arms:
    """Goodput (Gbit/s) of every run, by arm (e.g. ``pod 0%``, ``pod 1%``)."""

    runs: dict[str, list[float]] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    rxe_failures: int = 0

    def add(self, arm: str, gbps: float) -> None:
        self.runs.setdefault(arm, []).append(gbps)

    def median(self, arm: str) -> float:
        return statistics.median(self.runs[arm])

    def paired_ratio(self, arm: str, base: str) -> float:
        """The median of run-by-run ratios of two interleaved arms: the host's load drifts
        within a run set (seen: one set of node runs 2.5-37 Mbit/s at load 4), and each pair
        ran back to back under about the same load, so this is the steadier figure."""
        pairs = zip(self.runs[arm], self.runs[base], strict=False)
        return statistics.median(a / b if b > 0 else 0.0 for a, b in pairs)
