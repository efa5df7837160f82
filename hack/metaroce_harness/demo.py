"""The demo: the project's main job, end to end on one machine, on real nodes.

1. starts the local control plane and two SoftRoCE qemu guests as its real nodes
   (``RealNodes``: containerd, Multus and the pinned kubelet in each guest), labelled
   ``metaroce.io/rdma=true``;
2. installs the Helm chart (CRDs included) as a platform team would, and runs the real
   operator with the chart's arguments and its ServiceAccount's token (on the host,
   behind the chart's webhook Service: the apiserver cannot reach a pod on a guest);
3. for samples/softroce-dev.yaml, then samples/metaroce-dev.yaml (both claim the
   guests' eth0, so the first is deleted, and its nodes reverted, before the second is
   applied): applies it, waits for its agents (the DaemonSet's pods under the kubelets)
   and for the network to be Ready, prints the network's conditions, node counts and
   each node's devices as its agent reported them; starts two annotated pods, one per
   node, and moves data from the pod on node-1 to the pod on node-2 in interleaved runs,
   lossless and with 1% netem loss on both guests' eth0 (softroce: ``ib_write_bw`` on
   the device, GID and ToS the admission injected; metaroce: ``metaroce-perf`` with the
   injected ``MR_CONFIG``);
4. prints the two side by side: goodput lossless and at 1% loss, the ratio, and the
   retransmissions.

``--keep`` leaves the cluster, the metaroce network and its pods up until Ctrl-C;
teardown removes every process, guest, node address and temporary directory it made.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from metaroce_harness import chart
from metaroce_harness.cluster import REPO_ROOT, HarnessError, LocalCluster, ensure_binaries
from metaroce_harness.guest_transport import (
    BENCH_RXE_FLAGS,
    NETEM_DELAY_MS,
    clear_qdisc,
    paired_ratios,
    set_netem,
    socket_buffers,
)
from metaroce_harness.guests import GuestError, find_image
from metaroce_harness.images import ImageBuildError, find_images
from metaroce_harness.nodes import APISERVER_ARGS, NodeError, RealNodes
from metaroce_harness.pods import (
    Kube,
    LinkCounters,
    annotated_pod,
    ib_write_bw,
    in_pod,
    pod_perf,
    pod_ready,
)

T = TypeVar("T")

RELEASE = "metaroce"
NAMESPACE = "metaroce-system"
POD_NAMESPACE = "demo"
RDMA_LABEL = "metaroce.io/rdma=true"
LOSS_PERCENT = 1.0
SECONDS = 5
"""Each run's length; the client's pod is on node-1, the server's on node-2."""


DETAIL_FIELDS = (
    "sack_holes",
    "rtos",
    "spurious_rtos",
    "late_losses",
    "spurious_late_losses",
    "tlps",
    "spurious_retransmits",
)
"""metaroce-perf's counters behind a run's resends, printed beside them."""


@dataclass(frozen=True)
class Network:
    sample: Path
    name: str
    mode: str
    tool: str
    retransmits: str
    """What the retransmission figure counts."""


SOFTROCE = Network(
    REPO_ROOT / "samples" / "softroce-dev.yaml", "dev-softroce", "softroce",
    "ib_write_bw (RC over rxe)", "go-back-N restarts",
)  # fmt: skip
METAROCE = Network(
    REPO_ROOT / "samples" / "metaroce-dev.yaml", "dev-metaroce", "metaroce",
    "metaroce-perf", "packets resent",
)  # fmt: skip


@dataclass
class Figures:
    """One network's runs: goodput (Gbit/s) and retransmissions per run, by loss %."""

    network: Network
    goodput: dict[float, list[float]] = field(default_factory=dict)
    retransmits: dict[float, list[int]] = field(default_factory=dict)

    def add(self, loss: float, gbps: float, retransmits: int) -> None:
        self.goodput.setdefault(loss, []).append(gbps)
        self.retransmits.setdefault(loss, []).append(retransmits)

    def median(self, loss: float) -> float:
        return statistics.median(self.goodput[loss])

    def ratio(self) -> float:
        lossless = self.median(0.0)
        return self.median(LOSS_PERCENT) / lossless if lossless > 0 else 0.0

    def paired_ratio(self) -> float:
        """The median over runs of each lossy run / the lossless run just before it: the
        emulated guests' speed drifts between runs, and a pair shares most of it."""
        ratios = paired_ratios(self.goodput[LOSS_PERCENT], self.goodput[0.0])
        return statistics.median(ratios) if ratios else 0.0

    def paired_column(self) -> str:
        """The paired ratio, and with two or more pairs the least and greatest pair: a
        pair between TCG guests lands anywhere from about 0.5 to 1.4 of its median, so a
        few runs' figure is no judge of a goal near it (docs/transport-measurements.md)."""
        ratios = paired_ratios(self.goodput[LOSS_PERCENT], self.goodput[0.0])
        median = f"{statistics.median(ratios) if ratios else 0.0:.2f}"
        if len(ratios) < 2:
            return median
        return f"{median} ({min(ratios):.2f}-{max(ratios):.2f})"


def step(title: str) -> float:
    print(f"==> {title}", flush=True)
    return time.monotonic()


def done(started: float, what: str = "done") -> None:
    print(f"    {what} in {time.monotonic() - started:.1f} s", flush=True)


def wait_until(what: str, check: Callable[[], T], timeout: float, every: float = 2.0) -> T:
    """Poll ``check`` until it returns something truthy; print progress every 15 s."""
    started = time.monotonic()
    last_note = started
    while True:
        value = check()
        if value:
            return value
        now = time.monotonic()
        if now - started > timeout:
            raise HarnessError(f"{what}: not within {timeout:.0f} s")
        if now - last_note >= 15:
            print(f"    ... still waiting for {what} ({now - started:.0f} s)", flush=True)
            last_note = now
        time.sleep(every)


class Demo:
    def __init__(self, kube: Kube, nodes: RealNodes, runs: int) -> None:
        self.kube = kube
        self.nodes = nodes
        self.runs = runs
        self.pods = ("demo-a", "demo-b")
        self.env: dict[str, str] = {}
        """The environment of the client's pod (demo-a), as the admission gave it."""

    def get(self, *args: str) -> Any:
        proc = self.kube.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    # -- a network's life ----------------------------------------------------------------

    def apply(self, net: Network, timeout: float) -> None:
        t = step(f"kubectl apply -f samples/{net.sample.name}")
        print("    " + self.kube.kubectl("apply", "-f", str(net.sample)).stdout.strip())
        selector = f"metaroce.io/network={net.name}"

        def agents_ready() -> bool:
            pods = (self.get("pods", "-n", NAMESPACE, "-l", selector) or {}).get("items", [])
            return {p["spec"].get("nodeName") for p in pods if pod_ready(p)} >= set(self.kube.nodes)

        wait_until(f"{net.name}'s agent pods Ready on {', '.join(self.kube.nodes)}",
                   agents_ready, timeout)  # fmt: skip
        done(t, "agents (DaemonSet pods) Ready")
        t = step(f"waiting for {net.name} to be Ready and its resource on both nodes")
        resource = f"metaroce.io/{net.name}"

        def ready() -> bool:
            status = (self.get("metarocenetworks", net.name) or {}).get("status") or {}
            conds = {c["type"]: c["status"] for c in status.get("conditions") or []}
            nodes = (self.get("nodes") or {}).get("items", [])
            allocatable = [n["status"].get("allocatable", {}) for n in nodes]
            advertised = [a for a in allocatable if a.get(resource, "0") != "0"]
            return conds.get("Ready") == "True" and len(advertised) == len(self.kube.nodes)

        wait_until(f"{net.name} Ready", ready, timeout)
        done(t, "Ready")
        print(self.network_summary(net), flush=True)

    def delete(self, net: Network, timeout: float) -> None:
        t = step(f"kubectl delete -f samples/{net.sample.name} (cleanupOnDelete: nodes reverted)")
        for what in (["namespace", POD_NAMESPACE], ["-f", str(net.sample)]):
            self.kube.kubectl("delete", *what, f"--timeout={timeout:.0f}s", timeout=timeout + 30)
        done(t, "deleted, agents gone, nodes reverted")

    def start_pods(self, net: Network) -> tuple[str, str]:
        t = step(f"two annotated pods ({net.name}): {self.pods[0]} on {self.kube.nodes[0]}, "
                 f"{self.pods[1]} on {self.kube.nodes[1]}")  # fmt: skip
        self.kube.kubectl("create", "namespace", POD_NAMESPACE, check=False)
        docs = [
            annotated_pod(name, POD_NAMESPACE, node, self.kube.test_image, net.name)
            for name, node in zip(self.pods, self.kube.nodes, strict=True)
        ]
        self.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        wait_until(
            "both pods Ready",
            lambda: all(pod_ready(self.kube.pod(POD_NAMESPACE, n)) for n in self.pods),
            240,
        )
        done(t, "Running")
        pod = self.kube.pod(POD_NAMESPACE, self.pods[0])
        env = self.env = self.kube.env(POD_NAMESPACE, self.pods[0])
        limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
        shown = ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_TC", "FI_PROVIDER",
                 "NCCL_NET_PLUGIN", "MR_CONFIG")  # fmt: skip
        print(f"    the admission gave {self.pods[0]}: limits {limits}; "
              + ", ".join(f"{k}={env[k]}" for k in shown if k in env), flush=True)  # fmt: skip
        ips = tuple(self.kube.pod(POD_NAMESPACE, n)["status"]["podIP"] for n in self.pods)
        return ips[0], ips[1]

    # -- moving data ---------------------------------------------------------------------

    def measure(self, net: Network, ips: tuple[str, str]) -> Figures:
        t = step(
            f"moving data {self.pods[0]} -> {self.pods[1]} with {net.tool}: {self.runs} "
            f"interleaved runs of {SECONDS} s, lossless and at {LOSS_PERCENT:g}% netem loss "
            f"(both with {NETEM_DELAY_MS:g} ms delay) on both guests' eth0"
        )
        figures = Figures(net)
        guests = self.nodes.guests
        assert guests is not None
        run = self.softroce_run if net.mode == "softroce" else self.metaroce_run
        try:
            with socket_buffers(guests):
                for i in range(self.runs):
                    for loss in (0.0, LOSS_PERCENT):
                        for g in guests:
                            set_netem(g, loss, NETEM_DELAY_MS)
                        gbps, retx, detail = run(ips)
                        figures.add(loss, gbps, retx)
                        print(f"    run {i + 1}, {loss:g}% loss: {gbps * 1000:.1f} Mbit/s, "
                              f"{retx} {net.retransmits}{detail}", flush=True)  # fmt: skip
        finally:
            for g in guests:
                clear_qdisc(g)
        done(t)
        return figures

    def softroce_run(self, ips: tuple[str, str]) -> tuple[float, int, str]:
        """ib_write_bw from pod a to pod b on the injected device, GID index and ToS, with
        a 0.5 s ACK timeout (-u 17) instead of the network's NCCL_IB_TIMEOUT (20: 4.3 s),
        which under loss lets a 5 s run complete no write at all."""
        guests = self.nodes.guests
        assert guests is not None
        flags = (f"{BENCH_RXE_FLAGS} -D {SECONDS} -x {self.env['NCCL_IB_GID_INDEX']} "
                 f"--tclass={self.env['NCCL_IB_TC']}")  # fmt: skip
        link = LinkCounters(guests)
        server = in_pod(self.kube, POD_NAMESPACE, self.pods[1])[0]
        client = in_pod(self.kube, POD_NAMESPACE, self.pods[0])[1]
        try:
            gbps, _ = ib_write_bw(server, client, ips[1], flags, None)
        except AssertionError:
            gbps = 0.0  # RC gave up (retry count exceeded): nothing moved
        return gbps, link.delta()["node-1 completer_retry_err"], ""

    def metaroce_run(self, ips: tuple[str, str]) -> tuple[float, int, str]:
        """Goodput, packets resent, and what gave them up: gaps in a path's sequence (a
        later packet of the path acknowledged: the losses the wire made), timeouts, the
        late rule (a path's oldest packet overdue while later ones were acknowledged),
        tail probes, and how many the receiver already had (spurious)."""
        report = pod_perf(self.kube, POD_NAMESPACE, self.pods, ips, seconds=SECONDS)
        if not report.get("messages"):
            raise HarnessError(f"metaroce-perf moved nothing between the pods: {report}")
        r = {k: report.get(k, "-") for k in DETAIL_FIELDS}
        detail = (
            f" (gaps {r['sack_holes']}; timeouts {r['rtos']}, {r['spurious_rtos']} spurious; "
            f"late {r['late_losses']}, {r['spurious_late_losses']} spurious; tail probes "
            f"{r['tlps']}; the receiver had {r['spurious_retransmits']} already)"
        )
        return float(report["goodput_gbps"]), int(report["retransmits"]), detail

    # -- what it prints --------------------------------------------------------------------

    def network_summary(self, net: Network) -> str:
        k = self.kube.kubectl
        selector = f"metaroce.io/network={net.name}"
        lines = ["$ kubectl get metarocenetworks", k("get", "metarocenetworks").stdout.rstrip()]
        obj = self.get("metarocenetworks", net.name) or {}
        st, meta = obj.get("status") or {}, obj.get("metadata") or {}
        lines.append(f"network {net.name} (generation {meta.get('generation')}, "
                     f"observed {st.get('observedGeneration')})")  # fmt: skip
        for cond in st.get("conditions") or []:
            lines.append(
                f"  {cond['type']:<12} {cond['status']:<6} {cond.get('reason', ''):<24} "
                f"{cond.get('message', '')}"[:160]
            )
        counts = st.get("nodes") or {}
        lines.append("  nodes: " + ", ".join(f"{name} {n}" for name, n in counts.items()))
        lines.append("devices as the agents reported them (MetaRoceNodeStates):")
        states = self.get("metarocenodestates", "-l", selector) or {"items": []}
        for ns in states["items"]:
            s = ns.get("status") or {}
            qos = s.get("qos") or {}
            lines.append(f"  {ns['spec']['node']}: phase {s.get('phase')}, agent "
                         f"{s.get('agentVersion')}, QoS knobs applied "
                         f"{len(qos.get('applied') or [])}, skipped "
                         f"{len(qos.get('skipped') or [])}")  # fmt: skip
            for dev in s.get("inventory") or []:
                if not dev.get("rdmaDevice"):  # metaroce: a netdev, no RDMA device
                    lines.append(f"    {dev.get('netdev')} (driver {dev.get('driver')})")
                    continue
                lines.append(
                    f"    {dev.get('rdmaDevice')} on {dev.get('netdev')} ({dev.get('rdmaKind')}, "
                    f"driver {dev.get('driver')}): port {dev.get('portState')}, "
                    f"MTU {dev.get('activeMtu')}, GID[{dev.get('gidIndex')}] {dev.get('gid')}"
                )
            transport = s.get("transport") or {}
            library = transport.get("library") or {}
            if library:
                lines.append(f"    library {library.get('directory')} (sha256 "
                             f"{str(library.get('checksum'))[:16]}...) on "
                             f"{', '.join(transport.get('devices') or [])}")  # fmt: skip
            elif transport:
                lines.append(
                    f"    transport {transport.get('mode')}: {transport.get('message', '')}"
                )
        lines += [
            f"$ kubectl get pods -n {NAMESPACE} -l {selector} -o wide",
            k("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "wide").stdout.rstrip(),
        ]
        return "\n".join("    " + line for line in "\n".join(lines).splitlines())

    def side_by_side(self, results: Sequence[Figures]) -> str:
        loss = f"{LOSS_PERCENT:g}%"
        head = ("network", "transport", "tool", "lossless", f"{loss} loss", "ratio", "paired",
                f"retransmits per run, lossless / {loss}")  # fmt: skip
        rows = [head]
        for f in results:
            retx = [statistics.median(f.retransmits[x]) for x in (0.0, LOSS_PERCENT)]
            rows.append((
                f.network.name, f.network.mode, f.network.tool,
                f"{f.median(0.0) * 1000:.1f} Mbit/s", f"{f.median(LOSS_PERCENT) * 1000:.1f} Mbit/s",
                f"{f.ratio():.2f}", f.paired_column(),
                f"{retx[0]:g} / {retx[1]:g} {f.network.retransmits}",
            ))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        table = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                 for r in rows]  # fmt: skip
        notes = (
            f"Two annotated pods ({self.kube.nodes[0]} -> {self.kube.nodes[1]}), {SECONDS} s "
            f"runs, the medians of {self.runs} interleaved run(s) per column; netem on both "
            f"guests' eth0, with {NETEM_DELAY_MS:g} ms delay in both columns. Ratio: goodput "
            f"at {loss} loss / lossless; paired: the median of each lossy run / the lossless run "
            f"just before it (in brackets the least and the greatest pair). Retransmits: "
            f"rxe's completer_retry_err at "
            f"{self.kube.nodes[0]} (each go-back-N restart resends the window from the lost "
            "packet; device-wide, so the agents' probes count too); metaroce-perf's packets "
            "resent. Single runs between TCG guests vary up to 3x."
        )
        return "\n".join([
            "", "=" * 78, "MetaRoCE demo: softroce and metaroce side by side", "=" * 78,
            *table, "", textwrap.fill(notes, 100),
            f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        ])  # fmt: skip


def run(keep: bool, runs: int, timeout: float) -> int:
    t0 = time.monotonic()
    t = step("checking the guest image and the container images (built once, reused after)")
    find_image(build=True)  # the guests find it again, built
    images = find_images(build=True)
    done(t)
    with contextlib.ExitStack() as stack:
        t = step("starting the local control plane")
        cluster = stack.enter_context(LocalCluster(extra_apiserver_args=APISERVER_ARGS))
        assert cluster.kubeconfig is not None
        done(t, f"ready (KUBECONFIG={cluster.kubeconfig})")
        t = step("booting 2 SoftRoCE guests as real nodes (containerd, Multus, kubelet)")
        nodes = stack.enter_context(RealNodes(cluster, count=2, images=images))
        done(t, f"{', '.join(nodes.names)} Ready ({nodes.timings})")
        kube = Kube(cluster.kubeconfig, nodes.names, images.rdma_test.ref,
                    ensure_binaries()["kubectl"], real_nodes=nodes)  # fmt: skip
        kube.kubectl("label", "--overwrite", "node", *nodes.names, RDMA_LABEL)
        t = step(f"helm install {RELEASE} charts/metaroce (with its CRDs, namespace {NAMESPACE})")
        chart.install(cluster, RELEASE, NAMESPACE)
        done(t)
        t = step("starting the operator with the chart's arguments and ServiceAccount token")
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        operator = chart.start_host_operator(cluster, RELEASE, NAMESPACE, workdir)
        stack.callback(operator.stop, 20)
        print(f"    log: {operator.log_path}", flush=True)
        done(t, "leading, webhooks served")

        demo = Demo(kube, nodes, runs)
        results: list[Figures] = []
        for net in (SOFTROCE, METAROCE):
            if results:
                demo.delete(results[-1].network, timeout)
            demo.apply(net, timeout)
            ips = demo.start_pods(net)
            results.append(demo.measure(net, ips))
        print(demo.side_by_side(results), flush=True)
        print(f"\ndemo finished in {time.monotonic() - t0:.0f} s", flush=True)
        if keep:
            print(
                f"\nkept running: export KUBECONFIG={cluster.kubeconfig}\n"
                f"  kubectl get metarocenetworks,metarocenodestates; kubectl get pods -n "
                f"{POD_NAMESPACE}\nCtrl-C stops it and removes everything it made.",
                flush=True,
            )
            signal.pause()
        t = step("teardown: operator, guests, node addresses, control plane")
    done(t)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/demo.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep everything up until Ctrl-C")
    parser.add_argument(
        "--runs", type=int, default=3, help="interleaved runs per network and loss (default 3)"
    )
    parser.add_argument(
        "--timeout", type=float, default=420, help="seconds to wait for each step (default 420)"
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs={args.runs}: give 1 or more")
    logging.basicConfig(level=logging.WARNING, format="    %(message)s")
    logging.getLogger("metaroce.harness.nodes").setLevel(logging.INFO)  # boot progress
    try:
        return run(args.keep, args.runs, args.timeout)
    except KeyboardInterrupt:
        print("stopped; everything the demo made is removed")
        return 0
    except (HarnessError, GuestError, NodeError, ImageBuildError, AssertionError,
            subprocess.TimeoutExpired) as exc:  # fmt: skip
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
