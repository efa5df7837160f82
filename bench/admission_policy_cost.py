"""Where the policy mode's admission cost goes: apiserver CPU per pod create, per variant.

Not a timed test: it prints figures. On a local control plane (the harness, profiling on),
dry-run pod creates (`?dryRun=All`: the whole admission chain, no etcd write) in rounds,
the variants interleaved round by round, each measured as the apiserver's utime+stime per
create and the admission plugins' own durations
(`apiserver_admission_controller_admission_duration_seconds` per plugin and type):

- `none`: nothing of MetaRoCE (the floor of a create);
- `hand`: the issue's hand-written policy (no params, no variables, three literal ops);
- `trivial`: a MutatingAdmissionPolicy with the same match condition as the network's and a
  single JSONPatch op (one annotation): the floor of any JSONPatch policy;
- `network`: the network's MutatingAdmissionPolicy as the operator renders it;
- `noparam`: the network's policy without its param (what converting the param costs);
- `vap`: the chart's ValidatingAdmissionPolicy beside the network's policy (the policy mode).

    .venv/bin/python bench/admission_policy_cost.py [--rounds 3] [--pods 300]
        [--concurrency 4] [--pprof DIR] [--variants none,trivial,hand,network,vap]

`--pprof DIR` saves a CPU profile of the apiserver during annotated creates of each
variant (`go tool pprof -top -cum <kube-apiserver> DIR/apiserver-<variant>.pprof`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from test_webhooks_env import WebhookEnv, wait_for  # noqa: E402
from webhook_admission import GATE, Client, burst, clean, cpu_seconds  # noqa: E402

from metaroce_api import constants as c  # noqa: E402
from metaroce_harness.cluster import FakeNode, LocalCluster  # noqa: E402
from metaroce_operator.render.podpolicy import ADMISSION_API  # noqa: E402

NAMESPACE = "bench"
PLUGIN_METRIC = "apiserver_admission_controller_admission_duration_seconds"
TRIVIAL = "metaroce-cost-trivial"
HAND = "metaroce-cost-hand"


def pod_body(network: str | None) -> bytes:
    meta: dict[str, Any] = {"generateName": "c-", "labels": {"bench": "1"}}
    if network:
        meta["annotations"] = {c.NETWORKS_ANNOTATION: network}
    spec = {
        "containers": [{"name": "main", "image": "registry.invalid/train:1"}],
        "schedulingGates": [{"name": GATE}],
    }
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}).encode()


def trivial_policy(network: str) -> str:
    """The floor: the network's match condition, one JSONPatch op."""
    ann = "object.metadata.annotations"
    policy = {
        "apiVersion": ADMISSION_API,
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": TRIVIAL},
        "spec": {
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "matchConditions": [
                {
                    "name": "named",
                    "expression": f"has({ann}) && '{c.NETWORKS_ANNOTATION}' in {ann} && "
                    f"!('{c.POLICY_INJECTED_PREFIX}/{network}' in {ann}) && "
                    f"{ann}['{c.NETWORKS_ANNOTATION}'].contains('{network}')",
                }
            ],
            "mutations": [
                {
                    "patchType": "JSONPatch",
                    "jsonPatch": {
                        "expression": "[JSONPatch{op: 'add', path: '/metadata/annotations/' + "
                        f"jsonpatch.escapeKey('{c.POLICY_INJECTED_PREFIX}/{network}'), "
                        "value: '{}'}]"
                    },
                }
            ],
        },
    }
    binding = {
        "apiVersion": ADMISSION_API,
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": TRIVIAL},
        "spec": {"policyName": TRIVIAL},
    }
    return json.dumps(policy) + "\n---\n" + json.dumps(binding)


def hand_policy(network: str, resource: str) -> str:
    """The issue's hand-written policy (2026-12-01): pods whose annotation contains the
    network and carry no record yet; JSONPatch adding NCCL_IB_TC, the resource limit and
    the record to the first container. No params, no namespace selector, no variables."""
    ann = "object.metadata.annotations"
    record = f"{c.POLICY_INJECTED_PREFIX}/{network}"
    policy = {
        "apiVersion": ADMISSION_API,
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": HAND},
        "spec": {
            "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "matchConditions": [
                {
                    "name": "named",
                    "expression": f"has({ann}) && '{c.NETWORKS_ANNOTATION}' in {ann} && "
                    f"{ann}['{c.NETWORKS_ANNOTATION}'].contains('{network}') && "
                    f"!('{record}' in {ann})",
                }
            ],
            "mutations": [
                {
                    "patchType": "JSONPatch",
                    "jsonPatch": {
                        "expression": "[JSONPatch{op: 'add', path: '/spec/containers/0/env', "
                        "value: [{'name': 'NCCL_IB_TC', 'value': '106'}]}, "
                        "JSONPatch{op: 'add', path: '/spec/containers/0/resources', "
                        f"value: {{'limits': {{'{resource}': '1'}}}}}}, "
                        "JSONPatch{op: 'add', path: '/metadata/annotations/' + "
                        f"jsonpatch.escapeKey('{record}'), value: '{{}}'}}]"
                    },
                }
            ],
        },
    }
    binding = {
        "apiVersion": ADMISSION_API,
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": HAND},
        "spec": {"policyName": HAND},
    }
    return json.dumps(policy) + "\n---\n" + json.dumps(binding)


def without_params(documents: str) -> str:
    """The network's policy and binding with no param (no paramKind, no paramRef, no
    deletionTimestamp test): what the param costs."""
    out = []
    for text in documents.split("\n---\n"):
        obj = json.loads(text)
        obj["spec"].pop("paramKind", None)
        obj["spec"].pop("paramRef", None)
        for cond in obj["spec"].get("matchConditions", []):
            cond["expression"] = cond["expression"].replace(
                " && !has(params.metadata.deletionTimestamp)", ""
            )
        out.append(json.dumps(obj))
    return "\n---\n".join(out)


def plugin_sums(text: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(plugin, type) -> (sum seconds, count) of the per-plugin admission histogram."""
    out: dict[tuple[str, str], list[float]] = {}
    for line in text.splitlines():
        if not line.startswith(PLUGIN_METRIC + "_sum{") and not line.startswith(
            PLUGIN_METRIC + "_count{"
        ):
            continue
        head, value = line.rsplit(" ", 1)
        labels = dict(
            part.split("=", 1) for part in head[head.index("{") + 1 : head.rindex("}")].split(",")
        )
        if labels.get("operation") != '"CREATE"':
            continue
        key = (labels["name"].strip('"'), labels["type"].strip('"'))
        slot = out.setdefault(key, [0.0, 0.0])
        slot[0 if "_sum{" in head else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pprof", type=Path, help="a CPU profile of each variant (annotated)")
    parser.add_argument("--pprof-seconds", type=int, default=15)
    parser.add_argument("--variants", default="none,trivial,network,vap")
    parser.add_argument(
        "--stored",
        action="store_true",
        help="real creates (stored in etcd, pods gated from scheduling, deleted between "
        "bursts; etcd's CPU counted too) instead of dry-run ones",
    )
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    print(f"[cost] load average at the start: {os.getloadavg()}", flush=True)
    extra = ["--profiling=true"] if args.pprof else []
    with LocalCluster(extra_apiserver_args=extra) as cluster:
        env = WebhookEnv(cluster, tag="cost", mode="webhook")
        env.install()
        network = "bench-net"
        cluster.add_nodes([FakeNode("cost-0", capacity={f"metaroce.io/{network}": "100"})])
        env.create_network(network, healthy=1)
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
        cluster.kubectl("delete", "-f", "-", input=env.rendered_configurations())
        docs = {
            "none": "",
            "trivial": trivial_policy(network),
            "hand": hand_policy(network, f"metaroce.io/{network}"),
            "network": env.pod_policy_documents(network),
            "noparam": without_params(env.pod_policy_documents(network)),
            "vap": env.pod_policy_documents(network) + "\n---\n" + env.rendered_pod_policies(),
        }
        current = [""]
        apiserver = next(x for x in cluster.components if x.name == "kube-apiserver")
        etcd = next(x for x in cluster.components if x.name == "etcd")
        pids = {"apiserver": apiserver.process.pid, "etcd": etcd.process.pid}
        dry_path = f"/api/v1/namespaces/{NAMESPACE}/pods?dryRun=All"
        path = f"/api/v1/namespaces/{NAMESPACE}/pods" if args.stored else dry_path
        record = f"{c.POLICY_INJECTED_PREFIX}/{network}".encode()

        def dry(body: bytes) -> tuple[int, bytes]:
            return client.request("POST", dry_path, body)

        def set_variant(v: str) -> None:
            if current[0]:
                cluster.kubectl("delete", "-f", "-", input=current[0])
            if docs[v]:
                cluster.kubectl("apply", "--server-side", "-f", "-", input=docs[v])
            current[0] = docs[v]

            def effective() -> bool:
                status, data = dry(pod_body(network))
                return status == 201 and (record in data) == (v != "none")

            wait_for(f"variant {v}", effective, timeout=60)
            if v == "vap":
                wait_for(
                    "the ValidatingAdmissionPolicy",
                    lambda: dry(pod_body("nosuch"))[0] != 201,
                    timeout=60,
                )
            for _ in range(30):
                dry(pod_body(network))
                dry(pod_body(None))

        def dry_burst(body: bytes) -> None:
            burst_client = client

            class Dry:
                def create(self, b: bytes) -> float:
                    status, data = burst_client.request("POST", path, b)
                    if status != 201:
                        raise RuntimeError(f"{status} {data[:300]!r}")
                    return 0.0

            burst(Dry(), body, args.pods, args.concurrency)  # type: ignore[arg-type]

        cpu: dict[tuple[str, str], list[float]] = {}
        etcd_cpu: dict[tuple[str, str], list[float]] = {}
        rates: dict[tuple[str, str], list[float]] = {}
        plugins: dict[tuple[str, str], dict[tuple[str, str], float]] = {}
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                set_variant(v)
                for kind, body in (("plain", pod_body(None)), ("annotated", pod_body(network))):
                    before_m = plugin_sums(cluster.kubectl("get", "--raw", "/metrics").stdout)
                    before = cpu_seconds(pids)
                    started = time.perf_counter()
                    dry_burst(body)
                    rate = args.pods / (time.perf_counter() - started)
                    after = cpu_seconds(pids)
                    after_m = plugin_sums(cluster.kubectl("get", "--raw", "/metrics").stdout)
                    if args.stored:
                        clean(client)
                    spent = {n: (after[n] - before[n]) * 1000 / args.pods for n in pids}
                    cpu.setdefault((v, kind), []).append(spent["apiserver"])
                    etcd_cpu.setdefault((v, kind), []).append(spent["etcd"])
                    rates.setdefault((v, kind), []).append(rate)
                    slot = plugins.setdefault((v, kind), {})
                    for key, (s, _count) in after_m.items():
                        s0, _ = before_m.get(key, (0.0, 0.0))
                        slot[key] = slot.get(key, 0.0) + (s - s0) * 1000
            print(
                f"[cost] round {r + 1}: "
                + ", ".join(
                    f"{v}/{k} {cpu[(v, k)][-1]:.2f}"
                    for v in variants
                    for k in ("plain", "annotated")
                ),
                flush=True,
            )
        for profiled in variants if args.pprof else []:
            assert args.pprof is not None
            args.pprof.mkdir(parents=True, exist_ok=True)
            set_variant(profiled)
            stop = threading.Event()

            def load(stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    dry_burst(pod_body(network))

            t = threading.Thread(target=load, daemon=True)
            t.start()
            status, data = client.request(
                "GET", f"/debug/pprof/profile?seconds={args.pprof_seconds}"
            )
            stop.set()
            t.join()
            target = args.pprof / f"apiserver-{profiled}.pprof"
            target.write_bytes(data)
            print(f"[cost] profile ({status}) saved to {target}", flush=True)
        if current[0]:
            cluster.kubectl("delete", "-f", "-", input=current[0])
        env.teardown()
    total = args.rounds * args.pods
    what = "stored" if args.stored else "dry-run"
    print(
        f"\n[cost] apiserver (etcd) CPU ms per {what} create, median of {args.rounds} x "
        f"{args.pods}; pods/s of {args.concurrency} clients as a ratio to none/plain:"
    )

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    base = sum(rates[("none", "plain")]) if "none" in variants else None
    for v in variants:
        line = []
        for kind in ("plain", "annotated"):
            rate = f", rate {sum(rates[(v, kind)]) / base:.2f}" if base else ""
            line.append(
                f"{kind} {median(cpu[(v, kind)]):.2f} ({median(etcd_cpu[(v, kind)]):.2f}){rate}"
            )
        print(f"  {v:8s} " + "; ".join(line))
    print("[cost] admission plugins, ms per create (mean over all rounds), CREATE:")
    for v in variants:
        for kind in ("plain", "annotated"):
            slot = plugins[(v, kind)]
            top = sorted(slot.items(), key=lambda kv: -kv[1])[:6]
            print(
                f"  {v:8s} {kind:9s} "
                + ", ".join(f"{n}/{t} {ms / total:.3f}" for (n, t), ms in top if ms > 0)
            )
    print(f"[cost] load average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
