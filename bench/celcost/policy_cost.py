"""The policy mode's admission policies in the apiserver's own code (celcost): the same
pods and refusals as another revision's, and their CPU per pod beside the floors.

Not a timed test. 1. every shared admission case (tests/fixtures/admission_cases.py, with
its namespace's Pod Security label) and extra container shapes, with each order of the
networks' MutatingAdmissionPolicies and then the chart's ValidatingAdmissionPolicy, as the
working tree and the git revision `--against` render them: the pods out and the refusals
must be identical. 2. the usual pod (one container, nothing set) through the working
tree's network policy, the revision's, a policy of the same ops as constants (the floor of
this mutation: the JSON patch round trip) and a one-op policy (the floor of any JSONPatch
policy), then the network policy with the chart's ValidatingAdmissionPolicy of each:
CPU per pod, the best of `--repeat` runs.

    .venv/bin/python bench/celcost/policy_cost.py [--against HEAD] [--repeat 3]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "unit" / "operator"))

from fixtures.admission_cases import BE_SPEC, CASES, Case, Names, fe_spec  # noqa: E402
from operator_testlib import network  # noqa: E402

from metaroce_harness.cluster import ensure_binaries  # noqa: E402
from metaroce_operator.render import podpolicy  # noqa: E402
from metaroce_operator.settings import RenderSettings  # noqa: E402

SETTINGS = RenderSettings(
    namespace="metaroce-system", agent_image="example.com/agent:v1", admission_mode="policy"
)
NAMES = Names("be", "fe")
R = NAMES.r_be
EXTRA: list[list[dict[str, Any]]] = [
    [{"name": "m", "image": "x", "resources": {"requests": {"cpu": "1"}}}],
    [{"name": "m", "image": "x", "resources": {"limits": {"cpu": "1"}}}],
    [{"name": "m", "image": "x", "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}}],
    [{"name": "m", "image": "x", "resources": {"requests": {R: "1"}}}],
    [{"name": "m", "image": "x", "resources": {"limits": {R: "3"}}}],
    [{"name": "m", "image": "x", "securityContext": {"runAsUser": 1}}],
    [{"name": "m", "image": "x", "securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}],
    [{"name": "m", "image": "x", "securityContext": {"capabilities": {"add": ["NET_RAW"]}}}],
    [{"name": "m", "image": "x", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}],
    [{"name": "m", "image": "x", "env": [{"name": "A", "value": "1"}]}],
    [{"name": "m", "image": "x", "env": []}],
    [
        {
            "name": "m",
            "image": "x",
            "env": [
                {"name": "NCCL_IB_TC", "value": "184"},
                {"name": "NCCL_IB_TIMEOUT", "value": "20"},
            ],
        }
    ],
    [{"name": "a", "image": "x"}, {"name": "b", "image": "x"}],
    [
        {"name": "a", "image": "x", "resources": {"limits": {R: "1"}}},
        {
            "name": "b",
            "image": "x",
            "resources": {"requests": {R: "1"}},
            "env": [{"name": "Z", "value": "1"}],
        },
    ],
]


PARAMS = json.dumps(
    {"apiVersion": "metaroce.io/v1alpha1", "kind": "MetaRoceNetwork", "metadata": {"name": "n"}}
)


def module_at(rev: str, workdir: Path) -> ModuleType:
    text = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:operator/metaroce_operator/render/podpolicy.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = workdir / "podpolicy_at_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("podpolicy_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chart_policy(rev: str | None, workdir: Path) -> dict[str, Any]:
    """The chart's ValidatingAdmissionPolicy of the policy mode (at `rev`, else the tree's)."""
    chart = workdir / f"chart-{rev or 'tree'}"
    shutil.copytree(REPO / "charts" / "metaroce", chart)
    template = "templates/pod-policies.yaml"
    if rev:
        (chart / template).write_text(
            subprocess.run(
                ["git", "-C", str(REPO), "show", f"{rev}:charts/metaroce/{template}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
    helm = ensure_binaries().bin_dir / "helm"
    args = ["template", "r", str(chart), "--set", "admission.mode=policy"]
    args += ["--kube-version", "v1.37.2", "--show-only", template]
    out = subprocess.run(
        [str(helm), *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    policy: dict[str, Any] = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")
    return policy


def celcost(
    iterations: int, pod: Path, *policies: Path, labels: dict[str, str] | None = None
) -> tuple[str, float | None]:
    proc = subprocess.run(
        [str(HERE / "celcost"), str(iterations), str(pod), *map(str, policies)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "GOMAXPROCS": "1",
            "NAMESPACE_LABELS": json.dumps(labels or {}),
            "PARAMS": PARAMS,  # the network, as the binding's paramRef gives it
        },
    )
    if proc.returncode:
        return "ERROR " + proc.stderr[-400:], None
    found = re.search(r"cpu ([0-9.]+) us", proc.stderr)
    return proc.stdout, float(found.group(1)) if found else None


def build() -> None:
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off", "GOTOOLCHAIN": "local"}
    subprocess.run(["go", "build", "-o", "celcost", "."], cwd=HERE, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default="HEAD", help="git revision to compare with")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=3000)
    args = parser.parse_args(argv)
    build()
    work = Path(tempfile.mkdtemp(prefix="metaroce-celcost-"))
    modules = {"tree": podpolicy, "rev": module_at(args.against, work)}
    nets = {"be": network("be", **BE_SPEC), "fe": network("fe", **fe_spec(NAMES.r_fe))}
    files: dict[tuple[str, str], Path] = {}
    for tag, module in modules.items():
        for name, net in nets.items():
            files[(tag, name)] = work / f"{tag}-{name}.json"
            files[(tag, name)].write_text(json.dumps(module.render_pod_policy(net, SETTINGS)[0]))
        files[(tag, "vap")] = work / f"{tag}-vap.json"
        files[(tag, "vap")].write_text(
            json.dumps(chart_policy(None if tag == "tree" else args.against, work))
        )
    cases = list(CASES) + [
        Case(f"extra-{i}", nets_, containers=cs)
        for i, cs in enumerate(EXTRA)
        for nets_ in ("{be}", "{be},{fe}", "{fe},{be}")
    ]
    cases.append(Case("extra-init", "{be}", init_containers=[{"name": "i", "image": "x"}]))
    runs = differ = refused = 0
    pod_file = work / "pod.json"
    for case in cases:
        if case.networks is None:
            continue
        pod_file.write_text(json.dumps(case.pod(NAMES, "p")))
        labels = (
            {"pod-security.kubernetes.io/enforce": case.pod_security} if case.pod_security else {}
        )
        present = [n for n in nets if n in case.networks]
        for order in itertools.permutations(present):
            outs = {
                tag: celcost(
                    0, pod_file, *(files[(tag, n)] for n in (*order, "vap")), labels=labels
                )[0]
                for tag in modules
            }
            refused += "\ndeny " in outs["tree"]
            runs += 1
            if outs["tree"] != outs["rev"] or outs["tree"].startswith("ERROR"):
                differ += 1
                print(
                    f"[celcost] DIFFERENT {case.id} {order}:\n  {args.against}: {outs['rev']}\n"
                    f"  tree: {outs['tree']}"
                )
    print(
        f"[celcost] {runs} pods (case x network order), {refused} of them refused: "
        f"{differ} differ from {args.against}"
    )

    # CPU per pod for the usual pod.
    usual = Case("usual", "{be}").pod(NAMES, "p")
    pod_file.write_text(json.dumps(usual))
    tree_policy = json.loads(files[("tree", "be")].read_text())
    out, _ = celcost(0, pod_file, files[("tree", "be")])
    patched = json.loads(out)
    main_c = patched["spec"]["containers"][0]
    record_key = podpolicy.record_key("be")
    record = patched["metadata"]["annotations"][record_key]
    env_list = ", ".join(
        f"{{'name': '{e['name']}', 'value': '{e['value']}'}}" for e in main_c["env"]
    )
    ops = [
        f"JSONPatch{{op: 'add', path: '/spec/containers/0/resources', value: "
        f"{{'requests': {{'{R}': '1'}}, 'limits': {{'{R}': '1'}}}}}}",
        "JSONPatch{op: 'add', path: '/spec/containers/0/securityContext', "
        "value: {'capabilities': {'add': ['IPC_LOCK']}}}",
        f"JSONPatch{{op: 'add', path: '/spec/containers/0/env', value: [{env_list}]}}",
        f"JSONPatch{{op: 'add', path: '/metadata/annotations/' + jsonpatch.escapeKey("
        f"'{record_key}'), value: '{record}'}}",
    ]
    floors = {
        "constant ops": "[" + ", ".join(ops) + "]",
        "one op": "[" + ops[-1].replace(f"'{record}'", "'{}'") + "]",
    }
    candidates: dict[str, list[Path]] = {
        "tree": [files[("tree", "be")]],
        args.against: [files[("rev", "be")]],
    }
    for label, expression in floors.items():
        policy = copy.deepcopy(tree_policy)
        policy["spec"]["variables"] = []
        policy["spec"]["mutations"][0]["jsonPatch"]["expression"] = expression
        path = work / f"{label.replace(' ', '-')}.json"
        path.write_text(json.dumps(policy))
        if label == "constant ops":
            same, _ = celcost(0, pod_file, path)
            assert same == out, "the constant ops do not give the same pod"
        candidates[label] = [path]
    candidates["tree + its VAP"] = [files[("tree", "be")], files[("tree", "vap")]]
    candidates[f"tree + {args.against}'s VAP"] = [files[("tree", "be")], files[("rev", "vap")]]
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        for label, paths in candidates.items():
            _, cpu = celcost(args.iterations, pod_file, *paths)
            assert cpu is not None, label
            best[label] = min(best.get(label, cpu), cpu)
    print(
        f"[celcost] the usual pod, CPU per pod (best of {args.repeat} x {args.iterations}; "
        f"load {os.getloadavg()[0]:.1f}):"
    )
    for label, cpu in best.items():
        print(f"  {label:24s} {cpu:7.1f} us")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
