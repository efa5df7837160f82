"""Operator convergence at scale, side by side in one run (not a timed test).

On a local control plane with N kwok nodes (default 1,000):

1. baseline: the network's own rendered DaemonSet (with its ServiceAccount and ConfigMap)
   applied alone in another namespace; time until every pod is Running;
1b. limit: the same DaemonSet plus the simulated agents' NodeState creates (the load
   generator, as in the operator arm) with no operator running; time until every node's
   NodeState is written. Any design with a per-node report costs this much: the operator
   is judged against it too (target 1.05);
2. operator: `kubectl apply` of the MetaRoceNetwork with the real operator process
   running and the load generator writing each node's NodeState once its agent pod is
   Running; time until the network's status says Ready with every node configured;
3. idle: ~20 s after Ready, the operator's API writes (apiserver audit log, which records
   only the operator's user's writes) other than its Lease renewals;
4. the baseline and the limit again (warm cluster, the operator idling): each operator
   run is compared with the faster of the runs of each arm just before and after it, so a
   cold first run cannot flatter the operator; with `--rounds N` the median ratio of N
   rounds is reported with its spread (this machine is shared: single runs vary by tens
   of percent).

Apiserver writes per node, per arm: the apiserver's own `apiserver_request_total`
counters (POST, PUT, PATCH, APPLY, DELETE; Lease renewals left out, they count time, not
work) read before and after each run, divided by N. They do not drift with the machine's
noise, so they compare the arms where the times cannot.

Prints the ratios (operator / baseline, target <= 1.2; operator / limit, target <= 1.05),
the operator's peak memory
(VmHWM), and the writes to the network's status (audit log and the operator's counter).
Where the time goes, per operator run: when the last agent pod turned Running (compare
with the baseline), when the last NodeState was written (the agents' share), when the
status said Ready (the operator's share), and the CPU-seconds every component used (the
machine is shared: CPU-seconds compare runs better than wall time).

    .venv/bin/python bench/operator_scale.py [--nodes 1000] [--rounds 3] [--idle 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration" / "operator"))

from operator_env import (  # noqa: E402
    CRD_DIR,
    POD,
    LoadGenerator,
    OperatorProcess,
    condition,
    cpu_seconds,
    network_manifest,
)

from metaroce_api import constants as c  # noqa: E402
from metaroce_api import validate_network  # noqa: E402
from metaroce_harness.cluster import FakeNode, LocalCluster, free_port  # noqa: E402
from metaroce_operator.cli import chart_arguments  # noqa: E402
from metaroce_operator.kube import KINDS, Kube, load_credentials  # noqa: E402
from metaroce_operator.render import render_network  # noqa: E402
from metaroce_operator.settings import RenderSettings  # noqa: E402

AGENT_IMAGE = "example.com/metaroce-agent:v0.1.0"
OPERATOR_USER = "metaroce-bench-operator"
"""The operator's own identity here (a client certificate in system:masters, as admin's
is): the audit log is there to count ITS writes, so only its user is logged."""
WRITE_VERBS = ["create", "update", "patch", "delete", "deletecollection"]
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    # Auditing every write of every user (kwok's 1,000 node leases and pod statuses, the
    # agents' NodeStates) costs the apiserver CPU in both arms of the comparison; the
    # operator's writes (its kopf part included: one login) are all the bench reads.
    "rules": [
        {"level": "Metadata", "users": [OPERATOR_USER], "verbs": WRITE_VERBS},
        {"level": "None"},
    ],
}


WRITE_REQUEST_VERBS = ("POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION")


def write_counts(cluster: LocalCluster) -> Counter[str]:
    """The apiserver's write requests so far, by resource (its /metrics), Leases left out."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    return parse_write_counts(text)


def parse_write_counts(text: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_text, _, value = line[len("apiserver_request_total{") :].rpartition("} ")
        labels = dict(part.split("=", 1) for part in labels_text.split(",") if "=" in part)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("verb") not in WRITE_REQUEST_VERBS or labels.get("resource") == "leases":
            continue
        sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
        out[f"{labels.get('resource')}{sub}"] += int(float(value))
    return out


def per_node(before: Counter[str], after: Counter[str], nodes: int) -> tuple[float, str]:
    """(writes per node, the biggest resources' share) between two readings."""
    delta = Counter({k: after[k] - before.get(k, 0) for k in after})
    delta = Counter({k: v for k, v in delta.items() if v > 0})
    top = ", ".join(f"{k} {v / nodes:.2f}" for k, v in delta.most_common(8))
    return sum(delta.values()) / nodes, top


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", flush=True)


def running_pods(
    kubeconfig: Path, namespace: str, selector: str, want: int, timeout: float
) -> float:
    """Seconds from now until `want` distinct pods are Running (watch, not polling)."""

    async def watch() -> float:
        kube = Kube(load_credentials(str(kubeconfig)), user_agent="bench")
        started = time.monotonic()
        running: set[str] = set()
        try:
            while True:
                items, rv = await kube.list_with_version(POD, namespace, label_selector=selector)
                for pod in items:
                    if (pod.get("status") or {}).get("phase") == "Running":
                        running.add(pod["metadata"]["name"])
                if len(running) >= want:
                    return time.monotonic() - started
                async for kind, pod in kube.watch(
                    POD, namespace, resource_version=rv, label_selector=selector
                ):
                    if kind == "ERROR":
                        break
                    name = pod["metadata"]["name"]
                    running_now = (pod.get("status") or {}).get("phase") == "Running"
                    if kind != "DELETED" and running_now and name not in running:
                        running.add(name)
                        if len(running) % 200 == 0:
                            say(f"  {len(running)}/{want} pods Running")
                        if len(running) >= want:
                            return time.monotonic() - started
                    if time.monotonic() - started > timeout:
                        raise TimeoutError(f"only {len(running)}/{want} pods Running")
        finally:
            await kube.close()

    return asyncio.run(watch())


def wait_gone(cluster: LocalCluster, namespace: str, selector: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "name").stdout
        if not out.strip():
            return
        time.sleep(1)
    raise TimeoutError("pods were not deleted")


def audit_writes(path: Path, since: float, user_agent: str) -> list[dict[str, Any]]:
    """Write requests in the audit log from `since` on whose user agent starts so."""
    out = []
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("userAgent", "").startswith(user_agent) and stamp(ev) >= since - 1:
            out.append(ev)
    return out


def stamp(ev: dict[str, Any]) -> float:
    """The audit event's time as epoch seconds."""
    text = ev.get("stageTimestamp") or ev.get("requestReceivedTimestamp") or ""
    return time.mktime(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone


def describe(ev: dict[str, Any]) -> str:
    ref = ev.get("objectRef") or {}
    sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
    return f"{ev['verb']} {ref.get('resource')}{sub}"


class CpuMeter:
    """CPU seconds per component between two points (where the time goes on a busy box)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = self.read()

    def read(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = cpu_seconds(pid)
            except OSError:
                out[name] = 0.0
        return out

    def used(self) -> str:
        now = self.read()
        return ", ".join(f"{k} {now[k] - self.start[k]:.1f}" for k in self.pids)

    def total(self) -> float:
        now = self.read()
        return sum(now[k] - self.start[k] for k in self.pids)


def row(label: str, value: str, extra: str = "") -> None:
    print(f"{label:<42} {value:>10}  {extra}".rstrip())


def tally(events: list[dict[str, Any]]) -> str:
    return str(dict(Counter(map(describe, events)))) if events else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle observation")
    parser.add_argument("--status-interval", default="2s")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="operator runs, each between two baseline runs (more rounds, less noise)",
    )
    parser.add_argument("--verbose", action="store_true", help="print every status change")
    parser.add_argument(
        "--no-limit", action="store_true", help="skip the limit arm (DaemonSet + NodeStates)"
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="the operator arm's network has cleanupOnDelete (its nodes carry the managed "
        "node label, one Node write each; the simulated agents revert before it is deleted)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="the load generator's connections (agents writing at the same time)",
    )
    args = parser.parse_args()
    if args.nodes < 1:
        parser.error(f"--nodes {args.nodes}: give at least 1")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")

    work = Path(tempfile.mkdtemp(prefix="metaroce-bench-"))
    policy = work / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    audit_log = work / "audit.log"
    cluster = LocalCluster(
        extra_apiserver_args=[
            f"--audit-policy-file={policy}",
            f"--audit-log-path={audit_log}",
            "--audit-log-mode=batch",
            "--audit-log-batch-max-wait=1s",
        ],
    )
    cluster.start()
    op: OperatorProcess | None = None
    gen: LoadGenerator | None = None
    try:
        say(f"control plane ready in {cluster.ready_seconds:.1f} s; adding {args.nodes} kwok nodes")
        took = cluster.add_nodes(
            [FakeNode(f"node-{i:04d}", labels={"rdma": "yes"}) for i in range(args.nodes)]
        )
        say(f"{args.nodes} nodes Ready in {took:.1f} s")
        cluster.kubectl("apply", "--server-side", "-f", str(CRD_DIR))
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{c.NETWORK_CRD_NAME}")
        for ns in ("metaroce-system", "baseline"):
            cluster.kubectl("create", "namespace", ns)
            cluster.kubectl(
                "label", "namespace", ns, "pod-security.kubernetes.io/enforce=privileged"
            )
        manifest = network_manifest("scale", nodeSelector={"matchLabels": {"rdma": "yes"}})
        selector = f"{c.NETWORK_LABEL}=scale"
        node_names = [f"node-{i:04d}" for i in range(args.nodes)]

        # 1. Baseline: the same DaemonSet (and what its pods need), alone.
        meta = {**manifest["metadata"], "generation": 1}
        net = validate_network({**manifest, "metadata": meta})
        children = render_network(net, RenderSettings("baseline", AGENT_IMAGE))
        needed = [o for o in children if o["kind"] in ("ServiceAccount", "ConfigMap")]
        ds = next(o for o in children if o["kind"] == "DaemonSet")
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(needed))

        components = {c.name: c.process.pid for c in cluster.components}
        components["bench (load generator, watches)"] = os.getpid()

        baseline_cpu: list[float] = []

        baseline_writes: list[float] = []
        limit_writes: list[float] = []
        operator_writes: list[float] = []
        breakdown: dict[str, str] = {}
        operator_write_starts: list[Counter[str]] = []
        settled_writes: list[float] = []

        def baseline_run(label: str) -> float:
            meter = CpuMeter(components)
            say(f"baseline ({label}): applying the DaemonSet alone")
            before = write_counts(cluster)
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(ds))
            took = running_pods(cluster.kubeconfig, "baseline", selector, args.nodes, 900)
            writes, breakdown["baseline"] = per_node(before, write_counts(cluster), args.nodes)
            baseline_writes.append(writes)
            say(f"baseline ({label}): {args.nodes} pods Running in {took:.1f} s")
            say(f"  CPU seconds: {meter.used()}")
            baseline_cpu.append(meter.total())
            cluster.kubectl(
                "delete", "daemonset", ds["metadata"]["name"], "-n", "baseline", "--wait=false"
            )
            wait_gone(cluster, "baseline", selector)
            say("baseline pods deleted")
            return took

        limit_cpu: list[float] = []

        def limit_run(label: str) -> float:
            """The DaemonSet and the agents' NodeState creates, no operator running."""
            meter = CpuMeter(components)
            agents = LoadGenerator(
                cluster.kubeconfig, "baseline", "scale", concurrency=args.concurrency
            ).start()
            before = write_counts(cluster)
            say(f"limit ({label}): the DaemonSet and the agents' NodeStates, no operator")
            started = time.monotonic()
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(ds))
            deadline = started + 900
            while len(agents.written) < args.nodes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(agents.written)}/{args.nodes} NodeStates")
                time.sleep(0.05)
            took = agents.last_write - started
            writes, breakdown["limit"] = per_node(before, write_counts(cluster), args.nodes)
            limit_writes.append(writes)
            agents.stop()
            say(f"limit ({label}): {args.nodes} NodeStates written in {took:.1f} s")
            say(f"  CPU seconds: {meter.used()}")
            limit_cpu.append(meter.total())
            cluster.kubectl(
                "delete", "daemonset", ds["metadata"]["name"], "-n", "baseline", "--wait=false"
            )
            wait_gone(cluster, "baseline", selector)
            # One deletecollection, as the operator's clean-up does (kubectl deletes one by
            # one: a minute for 300).
            cluster.kubectl(
                "delete",
                "--raw",
                f"/apis/{c.API_VERSION}/{c.NODESTATE_PLURAL}?labelSelector="
                + urllib.parse.quote(selector),
            )
            while cluster.kubectl("get", c.NODESTATE_PLURAL, "-l", selector, "-o", "name").stdout:
                time.sleep(0.5)
            say("limit: pods and NodeStates deleted")
            return took

        baselines = [baseline_run("before round 1")]
        limits = [limit_run("before round 1")] if not args.no_limit else []

        # 2. The operator: kubectl apply -> status Ready.
        op_args = [
            *(a for a in chart_arguments("metaroce-system", AGENT_IMAGE) if "-port" not in a),
            f"--metrics-port={free_port()}",
            f"--health-port={free_port()}",
            f"--status-interval={args.status_interval}",
        ]
        op = OperatorProcess(
            op_args,
            kubeconfig=cluster.kubeconfig_for(OPERATOR_USER, ["system:masters"]),
            log_path=work / "operator.log",
            identity="bench-operator",
        ).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and op.metric_safe("metaroce_operator_leader") != 1:
            time.sleep(0.5)
        components["operator"] = op.pid

        phases: list[tuple[float, float]] = []
        """Per operator run: seconds from apply to the last pod Running, to the last write."""
        operator_cpu: list[float] = []

        def operator_run(label: str) -> tuple[float, float, float]:
            """(seconds to Ready, seconds after the last NodeState write, wall start)."""
            nonlocal gen
            gen = LoadGenerator(
                cluster.kubeconfig, "metaroce-system", "scale", concurrency=args.concurrency
            )
            gen.start()
            say(f"operator ({label}): applying the network with kubectl")
            kube_probe = Kube(load_credentials(str(cluster.kubeconfig)), user_agent="bench")
            started_wall = time.time()
            meter = CpuMeter(components)
            writes_before = write_counts(cluster)
            operator_write_starts.append(writes_before)
            started = time.monotonic()
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))

            async def until_ready() -> None:
                """Watch the network (not polling: the bench must not load the apiserver
                more than it has to, and sees Ready the moment it is written)."""
                kind = KINDS[(c.API_VERSION, c.NETWORK_KIND)]
                last = ""

                def done(body: dict[str, Any]) -> bool:
                    nonlocal last
                    if body.get("metadata", {}).get("name") != "scale":
                        return False
                    ready = condition(body, c.CONDITION_READY)
                    nodes = (body.get("status") or {}).get("nodes") or {}
                    summary = f"{ready.get('reason')} {nodes.get('summary')}"
                    if summary != last and (args.verbose or ready.get("status") == "True"):
                        say(f"  status: Ready={ready.get('status')} {summary}")
                    last = summary
                    return bool(
                        ready.get("status") == "True" and nodes.get("configured") == args.nodes
                    )

                try:
                    while True:
                        items, rv = await kube_probe.list_with_version(kind)
                        if any(done(body) for body in items):
                            return
                        async for event, body in kube_probe.watch(
                            kind, resource_version=rv, timeout=60
                        ):
                            if event == "ERROR":
                                break
                            if event != "DELETED" and done(body):
                                return
                            if time.monotonic() - started > 900:
                                raise TimeoutError("the network did not become Ready")
                finally:
                    await kube_probe.close()

            asyncio.run(until_ready())
            ready_at = time.monotonic()
            writes, breakdown["operator"] = per_node(
                writes_before, write_counts(cluster), args.nodes
            )
            operator_writes.append(writes)
            say(f"operator ({label}): Ready with {args.nodes} nodes in {ready_at - started:.1f} s")
            say(f"  CPU seconds: {meter.used()}")
            operator_cpu.append(meter.total())
            phases.append((gen.last_running - started, gen.last_write - started))
            say(
                f"  last pod Running at {phases[-1][0]:.1f} s, last NodeState write at "
                f"{phases[-1][1]:.1f} s, Ready at {ready_at - started:.1f} s"
            )
            return ready_at - started, ready_at - gen.last_write, started_wall

        runs: list[tuple[float, float]] = []
        status_writes: list[dict[str, Any]] = []
        writes: list[dict[str, Any]] = []
        kopf_writes: list[dict[str, Any]] = []
        idle_writes: list[dict[str, Any]] = []
        lease_renewals: list[dict[str, Any]] = []
        status_writes_metric = 0.0
        nodestate_writes = 0
        if args.cleanup:
            manifest["spec"]["cleanupOnDelete"] = True  # after the baselines rendered theirs
        for round_no in range(1, args.rounds + 1):
            converge, own_delay, started_wall = operator_run(f"round {round_no}")
            runs.append((converge, own_delay))
            if round_no == 1:
                # 3. Idle: what the operator writes when nothing changes.
                ready_wall = time.time()
                status_writes_metric = op.metric(
                    "metaroce_operator_status_writes_total", network="scale"
                )
                say(f"idle: observing {args.idle:.0f} s")
                time.sleep(args.idle + 2)
                idle_from, idle_to = ready_wall + 2, ready_wall + 2 + args.idle
                time.sleep(2)  # audit batches flush every second
                # The node labels (one patch per node) come from the node pass, partly after
                # Ready: count round 1's writes again once idle.
                settled, breakdown["operator, settled"] = per_node(
                    operator_write_starts[0], write_counts(cluster), args.nodes
                )
                settled_writes.append(settled)
                ours = audit_writes(audit_log, started_wall, "metaroce-operator")
                kopf_writes = audit_writes(audit_log, started_wall, "kopf")
                writes = [e for e in ours if stamp(e) <= ready_wall]
                status_writes = [
                    e
                    for e in writes
                    if (e.get("objectRef") or {}).get("resource") == c.NETWORK_PLURAL
                    and (e.get("objectRef") or {}).get("subresource") == "status"
                ]
                idle = [e for e in ours + kopf_writes if idle_from <= stamp(e) <= idle_to]
                idle_writes = [
                    e for e in idle if (e.get("objectRef") or {}).get("resource") != "leases"
                ]
                lease_renewals = [
                    e for e in idle if (e.get("objectRef") or {}).get("resource") == "leases"
                ]
            assert gen is not None
            if args.cleanup:
                written = gen.writes
                gen.revert(node_names)  # the finalizer waits for every node's reverted report
                deadline = time.monotonic() + 300
                while gen.writes < written + args.nodes and time.monotonic() < deadline:
                    time.sleep(0.5)
            gen.stop()
            nodestate_writes += gen.writes
            # 4. The baseline again (warm cluster; the operator idles meanwhile).
            cluster.kubectl("delete", c.NETWORK_PLURAL, "scale", "--wait=true", "--timeout=300s")
            wait_gone(cluster, "metaroce-system", selector)
            deadline = time.monotonic() + 300
            while (
                time.monotonic() < deadline
                and cluster.kubectl("get", c.NODESTATE_PLURAL, "-o", "name").stdout.strip()
            ):
                time.sleep(1)  # the baseline must not share the box with the clean-up
            # Nor with the removal of the network's node labels (one patch per node, by
            # the node pass, after the deletion): counted in the next arm's writes before.
            label = c.node_label("scale")
            while (
                time.monotonic() < deadline
                and cluster.kubectl("get", "nodes", "-l", label, "-o", "name").stdout.strip()
            ):
                time.sleep(1)
            baselines.append(baseline_run(f"after round {round_no}"))
            if not args.no_limit:
                limits.append(limit_run(f"after round {round_no}"))
        peak_kib = op.peak_rss_kib()
        op.stop()

        # Each operator run against the faster of the baselines just before and after it.
        ratios = [conv / min(baselines[i], baselines[i + 1]) for i, (conv, _) in enumerate(runs)]
        ratio = statistics.median(ratios)
        limit_ratios = [
            conv / min(limits[i], limits[i + 1]) for i, (conv, _) in enumerate(runs) if limits
        ]
        limit_ratio = statistics.median(limit_ratios) if limit_ratios else None
        print()
        row("nodes", f"{args.nodes}")
        row("rounds (baseline, operator, baseline, ...)", f"{args.rounds}")
        row(
            "baseline: DaemonSet alone, all Running",
            ", ".join(f"{b:.1f}" for b in baselines) + " s",
        )
        row(
            "operator: kubectl apply -> status Ready", ", ".join(f"{r[0]:.1f}" for r in runs) + " s"
        )
        row(
            "  last agent pod Running",
            ", ".join(f"{p[0]:.1f}" for p in phases) + " s",
            "(the rollout itself)",
        )
        row(
            "  last NodeState written",
            ", ".join(f"{p[1]:.1f}" for p in phases) + " s",
            f"(the agents, {args.concurrency} at a time)",
        )
        row(
            "  of which after the last NodeState write",
            ", ".join(f"{r[1]:.1f}" for r in runs) + " s",
            "(status batching)",
        )
        row("CPU-seconds, baseline runs", ", ".join(f"{x:.1f}" for x in baseline_cpu))
        row(
            "CPU-seconds, operator runs",
            ", ".join(f"{x:.1f}" for x in operator_cpu),
            "(all components, apply -> Ready)",
        )
        row("ratio per round (vs faster adjacent baseline)", ", ".join(f"{r:.2f}" for r in ratios))
        row(
            "ratio, median (target <= 1.2)",
            f"{ratio:.2f}",
            f"{'OK' if ratio <= 1.2 else 'OVER'}; spread {min(ratios):.2f}-{max(ratios):.2f}",
        )
        if limit_ratio is not None:
            row(
                "limit: DaemonSet + NodeStates, no operator",
                ", ".join(f"{x:.1f}" for x in limits) + " s",
            )
            row("CPU-seconds, limit runs", ", ".join(f"{x:.1f}" for x in limit_cpu))
            row(
                "operator / limit per round",
                ", ".join(f"{r:.2f}" for r in limit_ratios),
            )
            row(
                "operator / limit, median (target <= 1.05)",
                f"{limit_ratio:.2f}",
                f"{'OK' if limit_ratio <= 1.05 else 'OVER'}; spread "
                f"{min(limit_ratios):.2f}-{max(limit_ratios):.2f}",
            )
        for arm, values in (
            ("baseline", baseline_writes),
            ("limit", limit_writes),
            ("operator", operator_writes),
        ):
            if values:
                row(
                    f"apiserver writes per node, {arm}",
                    ", ".join(f"{x:.2f}" for x in values),
                    f"(last run: {breakdown.get(arm, '')})",
                )
        if settled_writes:
            row(
                "apiserver writes per node, operator settled",
                f"{settled_writes[0]:.2f}",
                f"(round 1, apply -> Ready + idle: {breakdown['operator, settled']})",
            )
        row("load average (1, 5, 15 min) at the end", " ".join(f"{x:.2f}" for x in os.getloadavg()))
        row("operator peak memory (VmHWM)", f"{peak_kib / 1024:.1f} MiB")
        row("status writes, round 1 (audit log)", f"{len(status_writes)}")
        row("status writes, round 1 (operator's counter)", f"{status_writes_metric:.0f}")
        row("NodeState writes (load generator, all rounds)", f"{nodestate_writes}")
        row("operator writes while converging (round 1)", f"{len(writes)}", tally(writes))
        row("kopf's own writes (round 1 + idle)", f"{len(kopf_writes)}", tally(kopf_writes))
        row(
            f"idle writes in {args.idle:.0f} s (not lease)",
            f"{len(idle_writes)}",
            tally(idle_writes),
        )
        row("lease renewals in the same time", f"{len(lease_renewals)}")
        print(f"logs: {work}")
        return 0 if ratio <= 1.2 and not idle_writes else 1
    finally:
        if gen is not None:
            gen.stop()
        if op is not None:
            op.stop()
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
