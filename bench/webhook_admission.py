"""Pod admission: the webhook and the admission policies, side by side in one run.

Not a timed test: it prints the figures and whether each target holds.

On a local control plane (the harness), three states of what admits annotated pods:
`none` (nothing of MetaRoCE), `webhook` (the chart-rendered configurations, one webhook
replica in the pod network behind the Service, certificates from the leader's code) and
`policy` (the network's MutatingAdmissionPolicy + binding as the operator renders them, and
the chart's ValidatingAdmissionPolicy; no webhook in the path):

1. throughput: rounds of N pod creations (K concurrent keep-alive HTTPS clients, one
   pre-encoded body per arm), six arms (unannotated / annotated pods in each state)
   interleaved round by round in rotating order. Two modes: `create` times the API calls
   of pods gated from scheduling (the admission path alone: the worst case), `start` times
   until the pods run on kwok nodes (what a Job sees). Pods are deleted between rounds (not
   timed). Ratios from the totals of every round: pods/s in a state / pods/s with nothing
   (targets: >= 0.98 unannotated, >= 0.9 annotated), and annotated / unannotated in the same
   state (>= 0.9, goal 0.98), with the control plane's CPU per pod beside them
   (utime+stime of etcd, apiserver, controllers, kwok and the webhook): the CPU-cost ratio
   is what a CPU-bound control plane would show, whatever else the host runs;
2. latency: pods created open-loop at 50 pods/s, annotated with the webhook, annotated
   with the policy, then unannotated. The apiserver exports its trace spans to an OTLP
   receiver in this process (`otlp_sink.py`; sampling rate 0, so only these requests,
   which carry a sampled `traceparent`, are traced). The webhook's "Call mutating
   webhook" span times each call exactly (target: <= 10 ms). The apiserver has no span
   for admission policies (v1.37: k8s.io/apiserver/pkg/admission/plugin/policy traces
   nothing), so for all three the same window is taken from the spans of each request:
   the "Create" span's event "About to store object in database" to the start of its
   "Create etcd3" span (mutating admission, defaulting, validation, validating admission),
   and compared with the unannotated baseline. Beside it: the HTTP round trip inside the
   webhook span, etcd's write (no admission in it: the host's own scheduling tail), the
   apiserver's histograms (`apiserver_admission_webhook_admission_duration_seconds`, only
   5/25 ms buckets near the target; `apiserver_mutating_admission_policy_check_duration_
   seconds`, 1/10 ms), the webhook server's own handling time, and the creation latency
   the client sees.

    .venv/bin/python bench/webhook_admission.py [--rounds 12] [--pods 100] [--concurrency 8]
        [--modes create,start] [--rate 50] [--latency-seconds 30] [--pprof DIR] [--hand]
        [--states none,policy,hand] [--client http|kubectl]

`--pprof DIR` turns the apiserver's profiling on and saves a CPU profile of it taken
during each latency phase, the webhook's and the policy's (`go tool pprof -top -cum
<kube-apiserver> DIR/...`): the mutating webhook's share is under
`mutatingDispatcher.callAttrMutatingHook`, the policies' under the policy dispatchers.

Where the annotated pods' extra cost goes with the webhook (profiled on this 2-CPU host,
load ~5): the apiserver spends about 1.5 ms of CPU per webhook call, most of it applying
the JSON patch (`json-patch Apply`) and decoding the patched pod again
(`Serializer.Decode`), about 0.2 ms on the HTTP round trip and 0.2 ms on matchConditions;
the webhook server about 0.3-0.7 ms. On a host whose control plane is CPU-bound at about
3.7 ms per pod, that caps the webhook's annotated create-throughput ratio near 0.6-0.65,
whatever the webhook does. The policy applies its JSON patch in process too, but with no
TLS call, no AdmissionReview encoding and no webhook server. But any mutation (webhook or
policy) also makes the apiserver run its whole mutating chain a second time (admission's
`reinvoker`), and a policy's result is defaulted and compared (DeepEqual) again: with
`--hand`, the issue's hand-written three-op policy alone costs about what the operator's
does (2026-12-02: control-plane CPU per annotated pod 6.71 ms against 6.88, none 4.45;
annotated / plain 0.60 against 0.55, webhook 0.58; load 2-3.5), so on this host no
mutating policy meets the 0.9 target.

Why the issue's hand measurement found 1.04 (300 annotated vs 300 plain creates, 8
client threads, the hand-written policy): its ratio measures the client as much as the
admission. `--client kubectl` creates each pod with its own `kubectl create` process, as
a shell loop does; each costs about 150 ms of CPU here (Go start-up, kubeconfig, TLS
handshake, discovery) and the control plane 16-19 ms per pod (serving that discovery
too), so the mutation's 2.2 ms is about 1 % of the CPU per pod and annotated / plain is 1
within the rounds' noise (2026-12-02, `--client kubectl --hand --states none,hand --pods
150 --rounds 3`, load 3 rising to 17: 0.885 overall, rounds 1.06 / 0.84 / 0.82, 6.5 against
7.3 pods/s; control-plane CPU per pod plain 16.38 ms, annotated 18.62 ms). With the
keep-alive clients (the default) the same policy's annotated pods cost 1.7-2.7 ms more
control-plane CPU than plain ones over a plain pod's 4.3-6 ms, and annotated / plain
stays near 0.5-0.8 (per-round medians) at any load seen here.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from otlp_sink import STORE_EVENT, SpanSink, traceparent  # noqa: E402
from test_webhooks_env import WebhookEnv, wait_for  # noqa: E402

from metaroce_api import constants as c  # noqa: E402
from metaroce_harness.cluster import FakeNode, LocalCluster  # noqa: E402
from metaroce_operator.render.podpolicy import policy_name  # noqa: E402

NAMESPACE = "bench"
GATE = "bench.metaroce.io/hold"
WEBHOOK = c.POD_WEBHOOK_NAME
SPAN = "Call mutating webhook"  # the apiserver's span around one webhook call
HTTP_SPAN = "HTTP POST"  # its HTTP client's span: the round trip to the webhook
ETCD_SPAN = "Create etcd3"  # the storage write of the same request


def pod_body(network: str | None, *, gated: bool = True) -> bytes:
    meta: dict[str, Any] = {"generateName": "b-", "labels": {"bench": "1"}}
    if network:
        meta["annotations"] = {c.NETWORKS_ANNOTATION: network}
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "registry.invalid/train:1"}]}
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}).encode()


def running(client: Client) -> int:
    status, data = client.request(
        "GET",
        f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=bench%3D1"
        "&fieldSelector=status.phase%3DRunning",
    )
    return len(json.loads(data)["items"]) if status == 200 else 0


class Client:
    """Keep-alive HTTPS to the apiserver as admin (cheap per request, same for every arm)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.port = cluster.api_port
        self.ctx = ssl.create_default_context(cafile=str(cluster.ca.pair.cert))
        self.ctx.load_cert_chain(str(cluster.admin_pair.cert), str(cluster.admin_pair.key))
        self.local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=30)
            self.local.conn = conn
        return conn

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        for attempt in (0, 1):
            conn = self._conn()
            try:
                all_headers = {"Content-Type": "application/json", **(headers or {})}
                conn.request(method, path, body, all_headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def create(self, body: bytes, *, traced: bool = False) -> float:
        headers = {"traceparent": traceparent()} if traced else {}
        started = time.perf_counter()
        status, data = self.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body, headers)
        if status != 201:
            raise RuntimeError(f"pod create failed: {status} {data[:300]!r}")
        return time.perf_counter() - started


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime+stime of each process, in seconds."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            out[name] = 0.0
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def kubectl_creator(cluster: LocalCluster) -> Callable[[bytes], object]:
    """A pod create as a hand measurement makes it: one `kubectl create -f -` process per
    pod (a Go binary's start-up, kubeconfig, TLS handshake and discovery each time)."""
    assert cluster.binaries is not None, "the cluster is not started"
    argv = [cluster.binaries["kubectl"], f"--kubeconfig={cluster.kubeconfig}",
            "create", "-n", NAMESPACE, "-o", "name", "-f", "-"]  # fmt: skip

    def create(body: bytes) -> object:
        proc = subprocess.run(argv, input=body, capture_output=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl create failed: {proc.stderr[:300]!r}")
        return None

    return create


def children_cpu() -> float:
    """utime+stime of this process's ended children (the kubectl clients), in seconds."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def burst(
    client: Client,
    body: bytes,
    count: int,
    concurrency: int,
    create: Callable[[bytes], object] | None = None,
) -> float:
    """Create `count` pods with `concurrency` workers (`create`, default the keep-alive
    HTTPS client); returns pods/s."""
    create = create or client.create
    left = [count]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            try:
                create(body)
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return count / elapsed


def open_loop(
    client: Client,
    body: bytes,
    rate: float,
    seconds: float,
    workers: int = 32,
    *,
    traced: bool = False,
) -> list[float]:
    """Create pods on a fixed schedule (`rate`/s for `seconds`) with a pool of keep-alive
    workers; each latency counts from the request's scheduled time, so a slow answer that
    delays the next requests is charged to them too (no coordinated omission)."""
    total = int(rate * seconds)
    latencies: list[float] = []
    lock = threading.Lock()
    next_index = [0]
    started = time.perf_counter() + 0.1

    def work() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= total:
                    return
                next_index[0] += 1
            due = started + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            client.create(body, traced=traced)
            done = time.perf_counter()
            with lock:
                latencies.append(done - due)

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def clean(client: Client) -> None:
    client.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=bench%3D1")

    def gone() -> bool:
        status, data = client.request(
            "GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=bench%3D1&limit=1"
        )
        return status == 200 and not json.loads(data)["items"]

    wait_for("the benchmark pods to be deleted", gone, timeout=300, every=0.5)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def histogram(text: str, name: str, match: Callable[[dict[str, str]], bool]) -> dict[float, float]:
    """Cumulative bucket counts {le: count} of histogram `name` for series that `match`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and match(sample.labels):
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


def counter(text: str, name: str) -> float:
    """Sum of every series of counter `name`."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def bucket_quantile(
    before: dict[float, float], after: dict[float, float], q: float
) -> tuple[float, int]:
    """(q-quantile interpolated in the buckets, observations) of the increase after-before."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    total = counts[-1] if counts else 0
    if not total:
        return float("nan"), 0
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in zip(les, counts, strict=True):
        if count >= rank:
            if le == float("inf"):
                return prev_le, int(total)
            span = count - prev_count
            frac = (rank - prev_count) / span if span else 1.0
            return prev_le + (le - prev_le) * frac, int(total)
        prev_le, prev_count = le, count
    return les[-1], int(total)


def fraction_within(before: dict[float, float], after: dict[float, float], le: float) -> float:
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    return (after[le] - before.get(le, 0.0)) / total if total else float("nan")


def profile_apiserver(
    cluster: LocalCluster, directory: Path | None, seconds: float, state: str
) -> threading.Thread | None:
    """A thread taking a CPU profile of the apiserver for about `seconds` into `directory`."""
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"apiserver-annotated-latency-{state}.pprof"
    length = max(1, int(seconds) - 1)

    def take() -> None:
        client = Client(cluster)
        status, data = client.request("GET", f"/debug/pprof/profile?seconds={length}")
        if status != 200:
            print(f"[bench] apiserver profile failed: {status} {data[:200]!r}", flush=True)
            return
        target.write_bytes(data)
        print(f"[bench] apiserver CPU profile ({length} s) saved to {target}", flush=True)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


STATES = ("none", "webhook", "policy")
"""What admits annotated pods in an arm: nothing of MetaRoCE, the pod webhook, or the
network's MutatingAdmissionPolicy (+ the chart's ValidatingAdmissionPolicy). With
`--hand`, a fourth: `hand`, the issue's hand-written policy alone (three literal ops, no
validation; bench/admission_policy_cost.py `hand_policy`), the floor of a policy that
mutates at all."""
Arm = tuple[str, str]
"""(plain | annotated, state)."""


@dataclass
class Throughput:
    """Rates and CPU of the arms of one throughput mode."""

    mode: str
    pods: int
    rates: dict[Arm, list[float]] = field(default_factory=dict)
    cpu: dict[Arm, dict[str, float]] = field(default_factory=dict)
    client_ms: dict[Arm, float] = field(default_factory=dict)
    """CPU per pod of the kubectl client processes (`--client kubectl` only)."""

    def overall(self, arm: Arm) -> float:
        # Total pods / total time over every round of the arm.
        runs = self.rates[arm]
        return len(runs) * self.pods / sum(self.pods / x for x in runs)

    def ratio(self, kind: str, state: str, base: Arm | None = None) -> float:
        """pods/s of (kind, state) over those of `base` (default: kind without admission)."""
        return self.overall((kind, state)) / self.overall(base or (kind, "none"))

    def per_round(self, kind: str, state: str, base: Arm | None = None) -> float:
        base = base or (kind, "none")
        pairs = zip(self.rates[(kind, state)], self.rates[base], strict=True)
        return statistics.median(a / b for a, b in pairs)

    def cpu_ms(self, arm: Arm) -> float:
        return sum(self.cpu[arm].values()) / (self.pods * len(self.rates[arm])) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds per throughput mode")
    parser.add_argument("--pods", type=int, default=100, help="pods per round and arm")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=50.0, help="pods/s in the latency phase")
    parser.add_argument("--latency-seconds", type=float, default=30.0)
    parser.add_argument(
        "--pprof",
        type=Path,
        help="save a CPU profile of the apiserver during the latency phase in this directory",
    )
    parser.add_argument(
        "--modes",
        default="create,start",
        help="throughput modes: create (API admission path, pods gated from scheduling), "
        "start (created, scheduled and Running on kwok nodes); comma list or empty",
    )
    parser.add_argument(
        "--hand", action="store_true", help="a fourth state: the hand-written policy alone"
    )
    parser.add_argument(
        "--client",
        choices=("http", "kubectl"),
        default="http",
        help="how pods are created in the throughput rounds: http (keep-alive HTTPS "
        "clients, the admission's cost shows) or kubectl (a `kubectl create` process per "
        "pod, as a hand measurement with a shell loop does: the client's cost dominates)",
    )
    parser.add_argument(
        "--states",
        default="",
        help="only these states (comma list of none,webhook,policy,hand); default all",
    )
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    states = (*STATES, "hand") if args.hand else STATES
    if args.states:
        wanted = args.states.split(",")
        unknown = sorted(set(wanted) - set(states))
        if unknown:
            parser.error(f"--states {args.states!r}: {unknown} unknown (with --hand for hand)")
        states = tuple(s for s in states if s in wanted)

    load = os.getloadavg()
    print(f"[bench] host load average at the start: {load[0]:.1f} on {os.cpu_count()} CPUs")
    sink = SpanSink().start()
    tracing_dir = Path(tempfile.mkdtemp(prefix="metaroce-bench-"))
    extra = [f"--tracing-config-file={sink.config_file(tracing_dir)}"]
    extra += ["--profiling=true"] if args.pprof else []
    with LocalCluster(extra_apiserver_args=extra) as cluster:
        env = WebhookEnv(cluster, tag="bench", mode="webhook")
        env.install()
        network = "bench-net"
        cluster.add_nodes(
            [FakeNode(f"bench-{i}", capacity={f"metaroce.io/{network}": "1000"}) for i in range(4)]
        )
        env.create_network(network, healthy=2)
        env.wait_cached(network)
        cluster.kubectl("create", "namespace", NAMESPACE)
        wait_for(
            "the bench namespace's ServiceAccount",
            lambda: (
                cluster.kubectl("get", "sa", "default", "-n", NAMESPACE, check=False).returncode
                == 0
            ),
        )
        client = Client(cluster)
        configs = env.rendered_configurations()
        policies = env.rendered_pod_policies() + "\n---\n" + env.pod_policy_documents(network)
        from admission_policy_cost import hand_policy

        hand = hand_policy(network, f"metaroce.io/{network}")
        record = f"{c.POLICY_INJECTED_PREFIX}/{network}".encode()
        current = ["webhook"]

        def set_state(state: str) -> None:
            """Install what admits annotated pods in `state` (and remove the rest)."""
            if state == current[0]:
                return
            if current[0] == "webhook":
                cluster.kubectl("delete", "-f", "-", input=configs)
            elif current[0] == "policy":
                cluster.kubectl("delete", "-f", "-", input=policies)
            elif current[0] == "hand":
                cluster.kubectl("delete", "-f", "-", input=hand)
            if state == "webhook":
                cluster.kubectl("apply", "-f", "-", input=configs)
                env.lead_certificates()  # caBundle, as the leader would after the chart
            elif state == "policy":
                cluster.kubectl("apply", "--server-side", "-f", "-", input=policies)
            elif state == "hand":
                cluster.kubectl("apply", "--server-side", "-f", "-", input=hand)
            current[0] = state

            def effective() -> bool:
                status, data = client.request(
                    "POST", f"/api/v1/namespaces/{NAMESPACE}/pods?dryRun=All", pod_body(network)
                )
                by = (
                    "webhook"
                    if c.INJECTED_ANNOTATION.encode() in data
                    else "policy"
                    if record in data
                    else "none"
                )
                return status == 201 and by == ("policy" if state == "hand" else state)

            wait_for(f"admission by {state}", effective, timeout=60)
            for _ in range(20):  # warm the apiserver's webhook connections / policy caches
                client.request(
                    "POST", f"/api/v1/namespaces/{NAMESPACE}/pods?dryRun=All", pod_body(network)
                )

        assert env.replica is not None
        pids = {comp.name: comp.process.pid for comp in cluster.components}
        pids["webhook"] = env.replica.process.pid
        results: list[Throughput] = []
        creator = kubectl_creator(cluster) if args.client == "kubectl" else None
        for mode in modes:
            gated = mode == "create"
            arms = [(kind, state) for state in states for kind in ("plain", "annotated")]
            bodies = {
                "plain": pod_body(None, gated=gated),
                "annotated": pod_body(network, gated=gated),
            }
            result = Throughput(mode, args.pods, {a: [] for a in arms}, {a: {} for a in arms})
            results.append(result)
            print(
                f"[bench] throughput ({mode}): {args.rounds} rounds x {args.pods} pods per arm, "
                f"{args.concurrency} concurrent clients",
                flush=True,
            )

            client_cpu: dict[Arm, float] = {a: 0.0 for a in arms}

            def one(kind: str, bodies: dict[str, bytes] = bodies, gated: bool = gated) -> float:
                started = time.perf_counter()
                burst(client, bodies[kind], args.pods, args.concurrency, creator)
                if not gated:
                    wait_for(
                        "the pods to run",
                        lambda: running(client) >= args.pods,
                        timeout=600,
                        every=0.1,
                    )
                return float(args.pods) / (time.perf_counter() - started)

            one("plain")  # warm-up
            clean(client)
            # Each round runs both kinds in every state (one change of state per third),
            # rotating which state and which kind go first, so drift in the machine's load
            # falls on every arm alike.
            for r in range(args.rounds):
                line = []
                n = len(states)
                order = list(states[r % n :] + states[: r % n])
                if current[0] in order:  # start where we are: one toggle fewer
                    i = order.index(current[0])
                    order = order[i:] + order[:i]
                for state in order:
                    set_state(state)
                    # Alternate every round: with (r // 3) % 2, a run of 4 rounds had the
                    # annotated arm first (right after a state change and a cleanup) in 3.
                    kinds = ["plain", "annotated"] if r % 2 else ["annotated", "plain"]
                    for kind in kinds:
                        before, client_before = cpu_seconds(pids), children_cpu()
                        rate = one(kind)
                        after = cpu_seconds(pids)
                        client_cpu[(kind, state)] += children_cpu() - client_before
                        clean(client)
                        result.rates[(kind, state)].append(rate)
                        spent = result.cpu[(kind, state)]
                        for name in pids:
                            if name != "webhook" or state == "webhook":
                                spent[name] = spent.get(name, 0.0) + after[name] - before[name]
                        line.append(f"{kind}/{state} {rate:6.1f}")
                print(f"[bench] round {r + 1}: " + ", ".join(line), flush=True)
            if args.client == "kubectl":
                result.client_ms = {
                    a: cpu / (args.pods * len(result.rates[a])) * 1000
                    for a, cpu in client_cpu.items()
                }

        # --- latency at a fixed rate -----------------------------------------------------
        metric = "apiserver_admission_webhook_admission_duration_seconds"
        policy_metric = "apiserver_mutating_admission_policy_check_duration_seconds"

        def ours(labels: dict[str, str]) -> bool:
            return labels.get("name") == WEBHOOK

        def our_policy(labels: dict[str, str]) -> bool:
            return labels.get("policy") == policy_name(network)

        def mutate_endpoint(labels: dict[str, str]) -> bool:
            return labels.get("endpoint") == "/mutate-pod"

        srv_metric = "metaroce_webhook_request_duration_seconds"
        windows: dict[str, list[float]] = {}
        print(
            f"[bench] latency: annotated pods at {args.rate:.0f}/s for "
            f"{args.latency_seconds:.0f} s with the webhook, then with the policy; "
            "unannotated pods as the baseline",
            flush=True,
        )
        set_state("webhook")
        api_before = histogram(cluster.kubectl("get", "--raw", "/metrics").stdout, metric, ours)
        srv_text = env.metrics_text()
        srv_before = histogram(srv_text, srv_metric, mutate_endpoint)
        conns_before = counter(srv_text, "metaroce_webhook_connections_total")
        profiler = profile_apiserver(cluster, args.pprof, args.latency_seconds, "webhook")
        sink.clear()
        annotated = open_loop(
            client, pod_body(network), args.rate, args.latency_seconds, traced=True
        )
        spans = sink.wait_for(SPAN, len(annotated), webhook=WEBHOOK)
        # where the time goes, for the same traced requests: the HTTP round trip to the
        # webhook (inside the call span) and etcd's write (no webhook involved: the
        # host's own scheduling tail)
        round_trips = sink.durations(HTTP_SPAN)
        etcd_writes = sink.durations(ETCD_SPAN)
        windows["webhook"] = sink.wait_for_windows(len(annotated))
        if profiler is not None:
            profiler.join()
        api_after = histogram(cluster.kubectl("get", "--raw", "/metrics").stdout, metric, ours)
        srv_text = env.metrics_text()
        srv_after = histogram(srv_text, srv_metric, mutate_endpoint)
        new_connections = counter(srv_text, "metaroce_webhook_connections_total") - conns_before
        clean(client)

        set_state("policy")
        pol_before = histogram(
            cluster.kubectl("get", "--raw", "/metrics").stdout, policy_metric, our_policy
        )
        profiler = profile_apiserver(cluster, args.pprof, args.latency_seconds, "policy")
        sink.clear()
        annotated_policy = open_loop(
            client, pod_body(network), args.rate, args.latency_seconds, traced=True
        )
        windows["policy"] = sink.wait_for_windows(len(annotated_policy))
        if profiler is not None:
            profiler.join()
        policy_etcd = sink.durations(ETCD_SPAN)
        pol_after = histogram(
            cluster.kubectl("get", "--raw", "/metrics").stdout, policy_metric, our_policy
        )
        clean(client)
        sink.clear()
        plain = open_loop(client, pod_body(None), args.rate, args.latency_seconds, traced=True)
        windows["plain"] = sink.wait_for_windows(len(plain))
        clean(client)
        env.teardown()
        cluster.kubectl("delete", "-f", "-", input=policies, check=False)
    sink.stop()
    shutil.rmtree(tracing_dir, ignore_errors=True)

    api_p99, api_n = bucket_quantile(api_before, api_after, 0.99)
    srv_p99, srv_n = bucket_quantile(srv_before, srv_after, 0.99)
    within5 = fraction_within(api_before, api_after, 0.005)
    within25 = fraction_within(api_before, api_after, 0.025)
    srv_within10 = fraction_within(srv_before, srv_after, 0.01)
    pol_within1 = fraction_within(pol_before, pol_after, 0.001)
    pol_n = int(pol_after.get(float("inf"), 0) - pol_before.get(float("inf"), 0))

    def mark(ok: bool) -> str:
        return "OK  " if ok else "MISS"

    print()
    for result in results:
        what = {
            "create": "pod create API calls, pods gated from scheduling (admission path alone)",
            "start": "pods created, scheduled and Running on kwok nodes",
        }[result.mode]
        print(f"=== throughput ({result.mode}): {what} ===")
        for kind in ("plain", "annotated"):
            print(
                f"  {kind:9s} pods/s: "
                + ", ".join(f"{s} {result.overall((kind, s)):7.1f}" for s in states)
                + ";  control-plane CPU per pod (ms): "
                + ", ".join(f"{s} {result.cpu_ms((kind, s)):.2f}" for s in states)
            )
        for state in states[1:]:
            for kind, target in (("plain", 0.98), ("annotated", 0.9)):
                ratio = result.ratio(kind, state)
                cpu_ratio = result.cpu_ms((kind, "none")) / result.cpu_ms((kind, state))
                print(
                    f"  {mark(ratio >= target)} {state:7s} {kind:9s} ratio {ratio:.3f} "
                    f"(pods/s with the {state} / without; target >= {target}; per-round "
                    f"median {result.per_round(kind, state):.3f}; CPU-cost ratio "
                    f"{cpu_ratio:.3f})"
                )
            side = result.ratio("annotated", state, ("plain", state))
            print(
                f"  {mark(side >= 0.9)} {state:7s} annotated / plain (both with the {state}) "
                f"{side:.3f} (target >= 0.9, goal 0.98; per-round median "
                f"{result.per_round('annotated', state, ('plain', state)):.3f})"
            )
        if result.client_ms:
            print(
                "  kubectl client CPU per pod (ms): "
                + ", ".join(f"{k}/{s} {v:.1f}" for (k, s), v in result.client_ms.items())
            )
        for state in states[1:]:
            split = result.cpu[("annotated", state)]
            n = result.pods * len(result.rates[("annotated", state)])
            print(
                f"  annotated with the {state}, CPU per pod by process (ms): "
                + ", ".join(f"{k} {v / n * 1000:.2f}" for k, v in sorted(split.items()) if v)
            )
    print(f"=== admission latency, annotated pods at {args.rate:.0f} pods/s ===")
    traced_p99 = percentile(spans, 0.99) if spans else float("nan")
    print(
        f"  {mark(traced_p99 <= 0.010)} webhook call p99 as the apiserver times it (its "
        f"'{SPAN}' trace spans, exact): {traced_p99 * 1000:.2f} ms over {len(spans)} of "
        f"{len(annotated)} calls; p50 {percentile(spans, 0.5) * 1000 if spans else 0:.2f} ms, "
        f"max {max(spans, default=0) * 1000:.2f} ms (target <= 10 ms)"
    )
    for what, values in (
        ("HTTP round trip to the webhook", round_trips),
        ("etcd write of the same requests (no webhook in it)", etcd_writes),
    ):
        if values:
            print(
                f"       {what}: p50 {percentile(values, 0.5) * 1000:.2f} ms, "
                f"p99 {percentile(values, 0.99) * 1000:.2f} ms ({len(values)} spans)"
            )
    print(
        f"       the apiserver's histogram, interpolated in its 5/25 ms buckets: "
        f"{api_p99 * 1000:.2f} ms over {api_n} calls ({within5:.1%} <= 5 ms, "
        f"{within25:.1%} <= 25 ms)"
    )
    print(
        f"       webhook server p99 (its own handling): {srv_p99 * 1000:.2f} ms over {srv_n} "
        f"requests ({srv_within10:.1%} <= 10 ms); {new_connections:.0f} new TLS connections "
        "from the apiserver"
    )
    print(
        "  admission window from the trace spans (the 'Create' span's event "
        f"'{STORE_EVENT}' to its '{ETCD_SPAN}' span: mutating admission, defaulting, "
        "validation, validating admission; the apiserver has no span of its own for "
        "admission policies):"
    )
    base = percentile(windows["plain"], 0.5) if windows["plain"] else float("nan")
    for state in ("webhook", "policy", "plain"):
        values = windows[state]
        if not values:
            print(f"       {state}: no spans")
            continue
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        label = "unannotated (baseline)" if state == "plain" else f"annotated, {state}"
        extra_ms = "" if state == "plain" else f"; p50 - baseline p50 {(p50 - base) * 1000:.2f} ms"
        print(
            f"       {label:24s} p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms "
            f"({len(values)} requests){extra_ms}"
        )
    if policy_etcd:
        print(
            f"       etcd write in the policy run: p50 {percentile(policy_etcd, 0.5) * 1000:.2f} "
            f"ms, p99 {percentile(policy_etcd, 0.99) * 1000:.2f} ms"
        )
    print(
        f"       the apiserver's policy histogram ({policy_metric}, buckets 1/10 ms): "
        f"{pol_within1:.1%} of {pol_n} evaluations <= 1 ms"
    )
    for label, values in (
        ("annotated, webhook", annotated),
        ("annotated, policy", annotated_policy),
        ("unannotated", plain),
    ):
        print(
            f"       pod create as the client sees it ({label}): p50 "
            f"{percentile(values, 0.5) * 1000:.1f} ms, p99 {percentile(values, 0.99) * 1000:.1f} ms"
        )
    load = os.getloadavg()
    print(f"  (host load average at the end: {load[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
