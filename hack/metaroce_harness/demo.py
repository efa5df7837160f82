"""The demo: the project's main job, end to end on one machine.

1. starts the local control plane with simulated (kwok) nodes, and - at the same time,
   in the background - boots two SoftRoCE qemu guests for the nodes `node-1` and `node-2`;
2. installs the Helm chart (CRDs included) as a platform team would;
3. runs the real operator with the chart's arguments and its ServiceAccount's token (the
   cluster has no kubelet for its pods, so it runs on the host, in the pod network behind
   the chart's webhook Service);
4. applies samples/softroce-dev.yaml (through the validating webhook);
5. starts the real node agent in each guest, with the config the operator rendered and
   the agents' ServiceAccount token, as the DaemonSet's pods would;
6. waits for the network to be Ready and prints a summary: networks, conditions, node
   counts, and each node's RDMA devices as its agent reported them.

`--keep` leaves everything running until Ctrl-C; teardown removes every process,
network namespace and temporary directory it made.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from metaroce_api.constants import AGENT_CONFIG_KEY
from metaroce_harness import agents, chart
from metaroce_harness.cluster import REPO_ROOT, Component, FakeNode, HarnessError, LocalCluster
from metaroce_harness.guests import BackgroundCommand, GuestCluster, GuestError, find_image
from metaroce_operator.render.common import child_name

log = logging.getLogger("metaroce.demo")

RELEASE = "metaroce"
NAMESPACE = "metaroce-system"
SAMPLE = REPO_ROOT / "samples" / "softroce-dev.yaml"
NETWORK = "dev-softroce"
CHILD = child_name(NETWORK)
RDMA_LABEL = {"metaroce.io/rdma": "true"}
# node-1 and node-2 are backed by the SoftRoCE guests of the same names (real agents);
# the CPU nodes are not selected by the sample network.
DEMO_NODES = [
    FakeNode("node-1", labels={**RDMA_LABEL, "topology.kubernetes.io/zone": "a"}),
    FakeNode("node-2", labels={**RDMA_LABEL, "topology.kubernetes.io/zone": "b"}),
    FakeNode("cpu-node-1", labels={"topology.kubernetes.io/zone": "a"}),
    FakeNode("cpu-node-2", labels={"topology.kubernetes.io/zone": "b"}),
]
GUESTS = 2


def step(title: str) -> float:
    print(f"==> {title}", flush=True)
    return time.monotonic()


def done(started: float, what: str = "done") -> None:
    print(f"    {what} in {time.monotonic() - started:.1f} s", flush=True)


def wait_until(what: str, check: Any, timeout: float, every: float = 1.0) -> Any:
    """Poll `check` until it returns something truthy; print progress every 15 s."""
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


def get_json(cluster: LocalCluster, *args: str) -> Any:
    proc = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


class Demo:
    def __init__(self, cluster: LocalCluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.operator: Component | None = None
        self.agents: list[BackgroundCommand] = []

    # -- the steps ------------------------------------------------------------------------

    def install_chart(self) -> None:
        t = step(f"helm install {RELEASE} charts/metaroce (with its CRDs, namespace {NAMESPACE})")
        chart.install(self.cluster, RELEASE, NAMESPACE)
        done(t)

    def start_operator(self) -> None:
        t = step("starting the operator with the chart's arguments and ServiceAccount token")
        self.operator = chart.start_host_operator(self.cluster, RELEASE, NAMESPACE, self.workdir)
        print(f"    log: {self.operator.log_path}", flush=True)
        done(t, "leading, webhooks served")

    def apply_sample(self) -> None:
        t = step(f"kubectl apply -f samples/{SAMPLE.name}")
        print(self.cluster.kubectl("apply", "-f", str(SAMPLE)).stdout.rstrip(), flush=True)
        wait_until(
            "the operator to render the agents' DaemonSet, ConfigMap and RBAC",
            lambda: (
                get_json(self.cluster, "configmap", CHILD, "-n", NAMESPACE)
                and get_json(self.cluster, "serviceaccount", CHILD, "-n", NAMESPACE)
            ),
            60,
        )
        done(t, "DaemonSet, ConfigMap, ServiceAccount and ClusterRoleBinding rendered")

    def start_agents(self, guests: GuestCluster) -> None:
        t = step(
            f"starting the real node agent in each guest ({', '.join(g.name for g in guests)})"
        )
        cm = get_json(self.cluster, "configmap", CHILD, "-n", NAMESPACE)
        config = cm["data"][AGENT_CONFIG_KEY]
        kubeconfig = agents.service_account_kubeconfig(self.cluster, NAMESPACE, CHILD)
        for guest in guests:
            self.agents.append(agents.start_agent(guest, config, kubeconfig))
        done(t, "started")

    def wait_ready(self, guests: GuestCluster, timeout: float) -> bool:
        t = step(f"waiting for {NETWORK} to be Ready on {len(guests)} nodes")

        def ready() -> bool:
            for job, guest in zip(self.agents, guests, strict=True):
                if job.poll() is not None:
                    raise HarnessError(
                        f"the agent on {guest.name} exited:\n{agents.agent_log(guest)}"
                    )
            net = get_json(self.cluster, "metarocenetworks", NETWORK) or {}
            conds = {
                c["type"]: c["status"] for c in (net.get("status") or {}).get("conditions") or []
            }
            return conds.get("Ready") == "True"

        try:
            wait_until(f"{NETWORK} Ready", ready, timeout, every=2)
        except HarnessError as exc:
            print(f"    not Ready: {exc}", flush=True)
            for guest in guests:
                print(f"    --- agent log of {guest.name}:\n{agents.agent_log(guest, 20)}")
            return False
        done(t, "Ready")
        return True

    # -- the summary -------------------------------------------------------------------------

    def summary(self) -> str:
        lines = ["", "=" * 78, "MetaRoCE demo summary", "=" * 78, ""]
        k = self.cluster.kubectl
        lines += [
            "$ kubectl get metarocenetworks",
            k("get", "metarocenetworks").stdout.rstrip(),
            "",
        ]
        nets = get_json(self.cluster, "metarocenetworks") or {"items": []}
        for net in nets["items"]:
            st = net.get("status") or {}
            meta = net["metadata"]
            lines.append(
                f"network {meta['name']} (generation {meta.get('generation')}, "
                f"observed {st.get('observedGeneration')})"
            )
            for cond in st.get("conditions") or []:
                lines.append(
                    f"  {cond['type']:<12} {cond['status']:<6} {cond.get('reason', ''):<24} "
                    f"{cond.get('message', '')}"[:160]
                )
            counts = st.get("nodes") or {}
            lines.append("  nodes: " + ", ".join(f"{k2} {v}" for k2, v in counts.items()))
            if st.get("transport"):
                lines.append(f"  transport: {json.dumps(st['transport'])}")
            lines.append("")
        lines += ["$ kubectl get nodes -L metaroce.io/rdma",
                  k("get", "nodes", "-L", "metaroce.io/rdma").stdout.rstrip(), ""]  # fmt: skip
        lines += [
            "$ kubectl get metarocenodestates",
            k("get", "metarocenodestates").stdout.rstrip(),
            "",
        ]
        states = get_json(self.cluster, "metarocenodestates") or {"items": []}
        lines.append("RDMA devices as the agents reported them:")
        for ns in states["items"]:
            st = ns.get("status") or {}
            node = ns["spec"]["node"]
            qos = st.get("qos") or {}
            applied = len(qos.get("applied") or [])
            skipped = len(qos.get("skipped") or [])
            lines.append(f"  {node}: phase {st.get('phase')}, agent {st.get('agentVersion')}, "
                         f"QoS knobs applied {applied}, skipped {skipped}")  # fmt: skip
            for dev in st.get("inventory") or []:
                lines.append(
                    f"    {dev.get('rdmaDevice')} on {dev.get('netdev')} ({dev.get('rdmaKind')}, "
                    f"driver {dev.get('driver')}): port {dev.get('portState')}, "
                    f"MTU {dev.get('activeMtu')}, GID[{dev.get('gidIndex')}] {dev.get('gid')}"
                )
            transport = st.get("transport") or {}
            if transport:
                lines.append(
                    f"    transport {transport.get('mode')}: {transport.get('message', '')}"
                )
            probe = st.get("probe") or {}
            if probe:
                lines.append(f"    probe: healthy={probe.get('healthy')}")
        pods = k("get", "pods,daemonsets", "-n", NAMESPACE, "-o", "wide").stdout.rstrip()
        lines += ["", f"$ kubectl get pods,daemonsets -n {NAMESPACE} -o wide", pods]
        lines.append(
            "(the operator's pods stay Pending: it runs on this host instead, as its pod "
            "would; kwok pretends to run the agents' pods, whose agents run in the guests)"
        )
        return "\n".join(lines)

    def stop(self) -> None:
        agents.stop_agents(self.agents)
        if self.operator is not None:
            self.operator.stop(grace=20)


def run(keep: bool, ready_timeout: float) -> int:
    t0 = time.monotonic()
    t = step("checking the SoftRoCE guest image (built once, reused afterwards)")
    image = find_image(build=True)
    done(t)
    guests = GuestCluster(count=GUESTS, memory_mb=1024, image=image)
    pool = ThreadPoolExecutor(1, thread_name_prefix="guests")
    step(f"booting {GUESTS} SoftRoCE guests in the background (qemu, software emulation)")
    booting: Future[GuestCluster] = pool.submit(guests.start)
    ok = False
    try:
        t = step(f"starting the local control plane with {len(DEMO_NODES)} simulated nodes")
        with LocalCluster(DEMO_NODES) as cluster, tempfile.TemporaryDirectory() as tmp:
            done(t, f"ready (KUBECONFIG={cluster.kubeconfig})")
            demo = Demo(cluster, Path(tmp))
            try:
                demo.install_chart()
                demo.start_operator()
                demo.apply_sample()
                t = step("waiting for the guests to boot")
                wait_until("the guests", booting.done, 600, every=1)
                booting.result()  # raises the boot error, if any
                done(t, f"booted ({guests.boot_seconds:.1f} s for {GUESTS})")
                demo.start_agents(guests)
                ok = demo.wait_ready(guests, ready_timeout)
                print(demo.summary(), flush=True)
                print(f"\ndemo {'finished' if ok else 'FAILED'} in {time.monotonic() - t0:.0f} s "
                      f"(load average {os.getloadavg()[0]:.2f})")  # fmt: skip
                if keep:
                    print(
                        f"\nkept running: export KUBECONFIG={cluster.kubeconfig}\n"
                        "  kubectl get metarocenetworks,metarocenodestates\n"
                        "Ctrl-C stops it and removes everything it made.",
                        flush=True,
                    )
                    signal.pause()
            finally:
                demo.stop()
    finally:
        booting.cancel()
        guests.close()
        pool.shutdown(wait=True)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/demo.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep everything up until Ctrl-C")
    parser.add_argument(
        "--ready-timeout", type=float, default=300, help="seconds to wait for Ready (default 300)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="    %(message)s")
    try:
        return run(args.keep, args.ready_timeout)
    except KeyboardInterrupt:
        print("stopped; everything the demo made is removed")
        return 0
    except (HarnessError, GuestError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
