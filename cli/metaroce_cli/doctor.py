"""`metaroce doctor`: on a node, the agent's own doctor; `metaroce doctor --node N` runs
that doctor inside N's agent pod (one per network on the node) through `kubectl exec`,
with the config the operator rendered for it.

Without --node every argument goes to the agent's doctor unchanged (it runs on the node
itself, as root)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from metaroce_api import constants as c
from metaroce_cli.cluster import KubectlMissing, kubectl

AGENT_SELECTOR = f"{c.COMPONENT_LABEL}={c.COMPONENT_AGENT}"
AGENT_CONFIG = "/etc/metaroce/agent.yaml"
"""Where the DaemonSet mounts the rendered config (operator render/common.py CONFIG_DIR)."""


def wants_remote(argv: Sequence[str]) -> bool:
    """`--node` exactly (the agent's doctor has `--node-name`, which argparse would also
    take `--node` for)."""
    return any(a == "--node" or a.startswith("--node=") for a in argv)


def agent_pods(pods: Mapping[str, Any], network: str | None) -> list[dict[str, Any]]:
    """The running agent pods of a PodList (one node's), of `network` if given, by network."""
    out = []
    for pod in pods.get("items") or []:
        labels = pod["metadata"].get("labels") or {}
        if network and labels.get(c.NETWORK_LABEL) != network:
            continue
        out.append(dict(pod))
    return sorted(out, key=lambda p: str(p["metadata"]["labels"].get(c.NETWORK_LABEL, "")))


def exec_argv(pod: Mapping[str, Any], as_json: bool) -> list[str]:
    """`kubectl exec` of the agent's doctor in `pod`, with the pod's own config."""
    meta = pod["metadata"]
    return [
        "exec", "-n", str(meta["namespace"]), str(meta["name"]), "-c", "agent", "--",
        "metaroce", "doctor", "--config", AGENT_CONFIG, "--require-pyverbs",
        *(["--json"] if as_json else []),
    ]  # fmt: skip


def remote_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="metaroce doctor --node", description=__doc__)
    p.add_argument("--node", required=True, help="the node whose agent pods run the doctor")
    p.add_argument("--network", help="only this network's agent (default: every one there)")
    p.add_argument("--json", action="store_true", help="the doctor's JSON, one per network")
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    args = p.parse_args(list(argv))
    try:
        found = kubectl(
            ["get", "pods", "-A", "-l", AGENT_SELECTOR,
             f"--field-selector=spec.nodeName={args.node}", "-o", "json"],
            args.kubeconfig,
        )  # fmt: skip
        if found.returncode != 0:
            print(f"metaroce doctor: cannot list the agent pods: {found.stderr.strip()}")
            return 2
        pods = agent_pods(json.loads(found.stdout), args.network)
        if not pods:
            which = f"of network {args.network} " if args.network else ""
            print(
                f"metaroce doctor: no agent pod {which}runs on node {args.node}: is the node "
                "selected by a network (`metaroce status`), and is its agent scheduled "
                "(`kubectl get pods -A -l app.kubernetes.io/component=node-agent -o wide`)?"
            )
            return 2
        worst = 0
        for pod in pods:
            network = pod["metadata"]["labels"].get(c.NETWORK_LABEL, "?")
            print(f"== network {network}: {pod['metadata']['namespace']}/{pod['metadata']['name']}")
            done = kubectl(exec_argv(pod, args.json), args.kubeconfig, timeout=120)
            sys.stdout.write(done.stdout)
            if done.returncode not in (0, 1):  # 1: the doctor found problems (shown above)
                print(f"metaroce doctor: the doctor did not run: {done.stderr.strip()}")
            worst = max(worst, done.returncode if done.returncode in (0, 1) else 2)
        return worst
    except KubectlMissing as e:
        print(f"metaroce doctor: {e}")
        return 2


def main(argv: Sequence[str]) -> int:
    if wants_remote(argv):
        return remote_main(argv)
    from metaroce_agent.cli import doctor_main

    return doctor_main(list(argv))
