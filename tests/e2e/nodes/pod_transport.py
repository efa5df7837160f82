"""metaroce-perf between two annotated pods on the real nodes, and the figures issue 14
asks of it: goodput at 1% netem loss against lossless (rxe's ratio beside it, in the
same run and under the same netem) and pod ÷ node goodput.

The pods' traffic crosses the guests' eth0 (each node routes the other's pod CIDR via
its eth0 address), so netem on both guests' eth0 impairs data and ACKs alike for the
pod arm, the node arm and rxe. The pod arm runs the library the agent installed, with
the environment the webhook and the device plugin gave the pod (`MR_CONFIG`); the node
arm runs the host's build of the same source in the guests' root namespace with the
same paths and MSS, so the ratio is the pod's network path and nothing else.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from conftest import REPO_ROOT

from metaroce_harness.guest_transport import (
    BENCH_RXE_FLAGS,
    NETEM_DELAY_MS,
    RXE,
    clear_qdisc,
    ensure_rxe,
    ib_write_bw,
    load_average,
    metaroce_perf,
    set_netem,
    socket_buffers,
    stage_perf,
)
from metaroce_harness.guests import Guest
from metaroce_harness.pods import (
    MR_BIN,
    PERF_SECONDS,
    PERF_SIZE,
    PERF_WINDOW,
    Arms,
    Kube,
    pod_perf,
)

_RUN_FIELDS = (
    "packets_sent",
    "retransmits",
    "spurious_retransmits",
    "rtos",
    "spurious_rtos",
    "tlps",
    "late_losses",
    "spurious_late_losses",
)


NODE_ARM_OWN = ("ports", "addr", "stats_dir")
"""`MR_CONFIG` keys the node arm sets itself (`metaroce_perf`'s ports and address; no
stats); it takes the rest, so both arms run the same paths, MTU, DSCP and timers."""


def measure(
    kube: Kube,
    guests: tuple[Guest, Guest],
    namespace: str,
    pods: tuple[str, str],
    ips: tuple[str, str],
    mr_config: str,
    *,
    node_runs: int = 2,
    loss_runs: int = 2,
    rxe_runs: int = 0,
    node_arm: bool = True,
) -> Arms:
    """Interleaved runs: ``node_runs`` lossless (pod arm, the node arm unless
    ``node_arm`` is false, rxe), then ``loss_runs`` at 1% netem loss (pod arm, rxe).
    ``mr_config`` carries the network's transport settings into the node arm. The
    nodes' socket buffer caps are raised for the pods' sockets (``socket_buffers``).

    The defaults keep the e2e tier short: its floors catch breakage, and the figures the
    issue asks for (medians of five, rxe beside metaroce) come from the real-node demo,
    ``bash hack/demo.sh --runs 5``, which runs the same arms."""
    perf = stage_perf()
    arms = Arms()
    had_rxe = [g.run(f"rdma link show {RXE}/1", timeout=30).returncode == 0 for g in guests]
    node_config = ",".join(  # the network's transport settings; the node arm's own ports
        kv for kv in mr_config.split(",") if kv and kv.split("=", 1)[0] not in NODE_ARM_OWN
    )
    try:
        with socket_buffers(guests):
            for g in guests if rxe_runs else ():
                ensure_rxe(g)
            for loss, runs in ((0.0, node_runs), (1.0, loss_runs)):
                if runs == 0:
                    continue
                for g in guests:
                    set_netem(g, loss, NETEM_DELAY_MS)
                for i in range(runs):
                    report = pod_perf(kube, namespace, pods, ips)
                    arms.reports.append(report | {"arm": f"pod {loss:g}%"})
                    print(  # shown with -s: where each run's resends came from
                        f"pod {loss:g}% run {i + 1}: {report['goodput_mbit']:.1f} Mbit/s, "
                        + ", ".join(f"{k} {report.get(k, '-')}" for k in _RUN_FIELDS),
                        flush=True,
                    )
                    arms.add(f"pod {loss:g}%", float(report["goodput_gbps"]))
                    if loss == 0.0 and node_arm:
                        node = metaroce_perf(guests[0], guests[1], perf, PERF_SECONDS,
                                             PERF_SIZE, PERF_WINDOW, node_config)  # fmt: skip
                        arms.add("node 0%", node.gbps)
                    if i < rxe_runs:
                        try:
                            bw = ib_write_bw(guests[0], guests[1], int(PERF_SECONDS),
                                             attempts=1, flags=BENCH_RXE_FLAGS)  # fmt: skip
                        except AssertionError:
                            arms.rxe_failures += 1
                            bw = 0.0  # RC gave up (retry exceeded): no goodput
                        arms.add(f"rxe {loss:g}%", bw)
    finally:
        for g, rxe in zip(guests, had_rxe, strict=True):
            clear_qdisc(g)
            if not rxe:
                g.run(f"rdma link delete {RXE}", timeout=60)
    return arms


def pod_node_figure(arms: Arms, via: str) -> str:
    """The pod ÷ node line of lossless interleaved runs (``measure`` with no loss runs)."""
    return (
        f"metaroce pod / node goodput over {via}, lossless: median of the paired runs' "
        f"ratios {arms.paired_ratio('pod 0%', 'node 0%'):.2f}, of the medians "
        f"{arms.median('pod 0%') / arms.median('node 0%'):.2f} ({len(arms.runs['pod 0%'])} "
        f"interleaved runs each: {arms.runs['pod 0%']} / {arms.runs['node 0%']} Gbit/s; "
        f"load average {load_average()})"
    )


def figures(arms: Arms) -> list[str]:
    """The table lines the e2e tier prints of loss runs (pod ÷ node: ``pod_node_figure``)."""
    mr = arms.median("pod 1%") / arms.median("pod 0%")
    rxe0 = arms.median("rxe 0%") if "rxe 0%" in arms.runs else 0.0
    rxe = arms.median("rxe 1%") / rxe0 if rxe0 > 0 else 0.0
    retx = [r["retransmits"] for r in arms.reports if r["arm"] == "pod 1%"]
    rcvbuf = sorted({r["sock_rcvbuf"] for r in arms.reports})
    return [
        f"metaroce between the pods at 1% netem loss: {mr:.2f} of lossless "
        f"({arms.median('pod 1%'):.3f} of {arms.median('pod 0%'):.3f} Gbit/s, medians of "
        f"{len(arms.runs['pod 1%'])} and {len(arms.runs['pod 0%'])} runs; retransmits {retx}); "
        + (
            f"rxe beside it: {rxe:.2f} ({arms.median('rxe 1%'):.3f} of {rxe0:.3f} Gbit/s, "
            f"{arms.rxe_failures} rxe runs moved nothing)"
            if "rxe 1%" in arms.runs
            else "rxe beside it: see the demo (bash hack/demo.sh --runs 5)"
        ),
        f"the pods' socket buffers {rcvbuf}",
    ]


# -- real clients between the pods ------------------------------------------------------------

STATS_DIR = "/run/metaroce-stats"  # MR_STATS_DIR in every annotated pod
PINGPONG_PORT = 47592  # fi_pingpong's out-of-band TCP port (over the pod network)
NCCL_BOOTSTRAP_PORT = 5555


def _pod_sh(kube: Kube, namespace: str, pod: str, script: str) -> list[str]:
    return [kube.kubectl_bin, f"--kubeconfig={kube.kubeconfig}", "exec", "-n", namespace, pod,
            "--", "sh", "-c", script]  # fmt: skip


def _stats(kube: Kube, namespace: str, pod: str) -> dict[str, dict[str, int]]:
    """Every stats file in the pod's stats directory: file name -> its counters."""
    out = kube.kubectl(
        "exec", "-n", namespace, pod, "--", "sh", "-c",
        f'for f in {STATS_DIR}/ep-*.json; do [ -f "$f" ] && echo "$f $(cat "$f")"; done; true',
    ).stdout  # fmt: skip
    files: dict[str, dict[str, int]] = {}
    for line in out.splitlines():
        name, _, doc = line.partition(" ")
        if doc.startswith("{"):
            files[name] = json.loads(doc)["counters"]
    return files


def _new_bytes(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> int:
    """Payload bytes received by the endpoints that appeared (or grew) since `before`."""
    return sum(
        c["bytes_rcvd"] - before.get(name, {}).get("bytes_rcvd", 0) for name, c in after.items()
    )


def _run_pair(
    kube: Kube,
    namespace: str,
    server: tuple[str, str],
    client: tuple[str, str],
    ready: str,
    timeout: float,
) -> tuple[str, str, int, int]:
    """Start `server` (pod, script), wait until `ready` (a shell test) holds in its pod, run
    `client`; both outputs and exit codes. Both are bounded by `timeout`."""
    srv = subprocess.Popen(
        _pod_sh(kube, namespace, server[0], f"exec timeout {timeout:.0f} {server[1]}"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while kube.kubectl("exec", "-n", namespace, server[0], "--", "sh", "-c", ready,
                           check=False).returncode != 0:  # fmt: skip
            if srv.poll() is not None or time.monotonic() > deadline:
                out = srv.communicate()[0] if srv.poll() is not None else "(still running)"
                raise AssertionError(f"{server[0]}: {server[1]!r} did not get ready: {out}")
            time.sleep(1)
        cl = subprocess.run(
            _pod_sh(kube, namespace, client[0], f"exec timeout {timeout:.0f} {client[1]}"),
            capture_output=True, text=True, timeout=timeout + 30, check=False,
        )  # fmt: skip
        srv_out, _ = srv.communicate(timeout=60)
        return srv_out, cl.stdout + cl.stderr, srv.returncode, cl.returncode
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def pod_clients(
    kube: Kube, namespace: str, pods: tuple[str, str], ips: tuple[str, str], label: str
) -> list[str]:
    """Clients we did not write, between the pods, with nothing but the environment the
    admission and the device plugin gave them: Debian's fi_pingpong through the provider
    (data checked) and the NCCL net plugin's conformance harness (two ranks, every byte
    checked). Each must pass AND the pods' metaroce stats must show the bytes: libfabric
    and NCCL both fall back silently to other transports. Returns figure lines."""
    a, b = pods
    figures = []
    before = (_stats(kube, namespace, a), _stats(kube, namespace, b))
    t0 = time.monotonic()
    iters, size = 100, 65536
    pp = f"fi_pingpong -p metaroce -e rdm -m tagged -c -S {size} -I {iters} -B {PINGPONG_PORT}"
    srv_out, cl_out, srv_rc, cl_rc = _run_pair(
        kube, namespace, (b, pp), (a, f"{pp} -P {PINGPONG_PORT} {ips[1]}"),
        f"ss -ltn | grep -q ':{PINGPONG_PORT} '", 300,
    )  # fmt: skip
    assert cl_rc == 0 and srv_rc == 0, f"fi_pingpong ({label}):\n{cl_out}\nserver:\n{srv_out}"
    rows = [r.split() for r in cl_out.splitlines() if r.split()[:1] and r[0].isdigit()]
    # "#sent" == "#ack": every message came back, and -c found no corrupted byte
    assert len(rows) == 1 and rows[0][2].startswith("="), cl_out
    after = (_stats(kube, namespace, a), _stats(kube, namespace, b))
    carried = [_new_bytes(x, y) for x, y in zip(before, after, strict=True)]
    assert min(carried) >= iters * size, ("fi_pingpong bytes not on metaroce", carried)
    figures.append(
        f"fi_pingpong -p metaroce between the pods ({label}): {iters} x {size} B each way, "
        f"data checked, {time.monotonic() - t0:.1f} s; metaroce received {carried} B"
    )

    before = after
    t0 = time.monotonic()
    check = f'env LD_LIBRARY_PATH="$MR_LIB_DIR" {MR_BIN}/nccl-net-check --version 12 --bulk-mib 4'
    boot = f"--bootstrap {ips[0]}:{NCCL_BOOTSTRAP_PORT}"
    r0, r1, rc0, rc1 = _run_pair(
        kube, namespace, (a, f"{check} --rank 0 {boot}"), (b, f"{check} --rank 1 {boot}"),
        f"ss -ltn | grep -q ':{NCCL_BOOTSTRAP_PORT} '", 300,
    )  # fmt: skip
    assert rc0 == 0 and rc1 == 0, f"nccl-net-check ({label}):\nrank 0:\n{r0}\nrank 1:\n{r1}"
    assert "ALL OK" in r0 and "ALL OK" in r1, (r0, r1)
    after = (_stats(kube, namespace, a), _stats(kube, namespace, b))
    carried = [_new_bytes(x, y) for x, y in zip(before, after, strict=True)]
    assert min(carried) >= 4 << 20, ("NCCL harness bytes not on metaroce", carried)
    figures.append(
        f"NCCL net plugin conformance harness (v12) between the pods ({label}): ALL OK, "
        f"{time.monotonic() - t0:.1f} s; metaroce received {carried} B"
    )
    return figures


# -- an Open MPI job spanning the two pods --------------------------------------------------

MPI_LAUNCHER_SA = "mpi-launcher"
MPI_CHECKS = REPO_ROOT / "transport" / "fabric" / "mpi_checks.py"


def mpi_launcher_rbac(namespace: str) -> list[dict[str, Any]]:
    """What an MPI operator gives its launcher pod: exec into the job's other pods."""
    meta = {"name": MPI_LAUNCHER_SA, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": MPI_LAUNCHER_SA},
            "subjects": [{"kind": "ServiceAccount", "name": MPI_LAUNCHER_SA,
                          "namespace": namespace}],
        },
    ]  # fmt: skip


def _kexec(namespace: str, pods: tuple[str, str], ips: tuple[str, str]) -> str:
    """Open MPI's rsh agent, as MPI operators write it: `kexec HOST CMD...` runs CMD in the
    pod with that address through `kubectl exec` (the launcher's ServiceAccount)."""
    cases = "\n".join(f"  {ip}) pod={pod} ;;" for pod, ip in zip(pods, ips, strict=True))
    return (
        '#!/bin/sh\nhost=$1; shift\ncase "$host" in\n' + cases + "\n"
        '  *) echo "kexec: no pod has address $host" >&2; exit 1 ;;\nesac\n'
        f'exec /tmp/kubectl exec -i -n {namespace} "$pod" -- /bin/sh -c "$*"\n'
    )


def stage_mpi(kube: Kube, namespace: str, pods: tuple[str, str], ips: tuple[str, str]) -> None:
    """kubectl into the launcher (pods[0]); the rsh agent and the mpi4py checks into both."""
    launcher = pods[0]
    kube.kubectl("cp", kube.kubectl_bin, f"{namespace}/{launcher}:/tmp/kubectl", timeout=300)
    script = _kexec(namespace, pods, ips)
    # the agent in both pods: Open MPI 4.1's orted opens its rsh component too and
    # aborts if the configured agent is not there, though with `routed direct` it never
    # launches anything
    for pod in pods:
        kube.kubectl(
            "exec", "-i", "-n", namespace, pod, "--", "sh", "-c",
            "cat >/tmp/kexec && chmod 755 /tmp/kexec", input=script,
        )  # fmt: skip
        kube.kubectl(
            "exec", "-i", "-n", namespace, pod, "--", "sh", "-c",
            "cat >/tmp/mpi_checks.py", input=MPI_CHECKS.read_text(),
        )  # fmt: skip
    kube.kubectl("exec", "-n", namespace, launcher, "--", "chmod", "755", "/tmp/kubectl")


def pod_mpi(
    kube: Kube, namespace: str, pods: tuple[str, str], ips: tuple[str, str], label: str
) -> list[str]:
    """An Open MPI job of 4 ranks, 2 in each pod, launched from pods[0] as an MPI operator
    launches (mpirun, rsh agent `kubectl exec`), with `pml cm` and `mtl ofi` restricted to
    the metaroce provider: the mpi4py semantics checks (pickled recv, ANY_SOURCE/ANY_TAG,
    order, Cancel, truncation, Issend, allreduce), data checked, and the pods' metaroce
    counters showing the bytes (Open MPI falls back silently too)."""
    before = (_stats(kube, namespace, pods[0]), _stats(kube, namespace, pods[1]))
    t0 = time.monotonic()
    mpirun = (
        # the rsh agent as an environment variable, as MPI Operator sets it
        "OMPI_MCA_plm_rsh_agent=/tmp/kexec "
        "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
        f"timeout 600 mpirun -np 4 -H {ips[0]}:2,{ips[1]}:2 "
        "--mca routed direct --mca oob_tcp_if_include eth0 "
        "--mca pml cm --mca mtl ofi --mca mtl_ofi_provider_include metaroce "
        "-x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "
        "python3 /tmp/mpi_checks.py semantics --skip large"
    )
    run = kube.kubectl(
        "exec", "-n", namespace, pods[0], "--", "sh", "-c", mpirun, check=False, timeout=660
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "ALL OK" in out, f"Open MPI across the pods ({label}):\n{out}"
    after = (_stats(kube, namespace, pods[0]), _stats(kube, namespace, pods[1]))
    carried = [_new_bytes(x, y) for x, y in zip(before, after, strict=True)]
    assert min(carried) > 0, ("Open MPI bytes not on metaroce", carried, out)
    checks = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("OK ")]
    return [
        f"Open MPI (4 ranks, 2 per pod, mpirun with a kubectl-exec rsh agent, pml cm, mtl ofi, "
        f"metaroce) between the pods ({label}): ALL OK ({len(checks)} checks), "
        f"{time.monotonic() - t0:.1f} s; metaroce received {carried} B"
    ]
