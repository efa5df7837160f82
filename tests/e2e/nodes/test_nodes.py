"""Real nodes: kubelets registered, pods scheduled on two nodes talk over the pod
network, the apiserver reaches the kubelets (logs, exec) and pods reach the apiserver
through the ``kubernetes`` Service (in-cluster config, as the agent uses it)."""

from __future__ import annotations

import json
import time

import pytest
from conftest import Kube

pytestmark = pytest.mark.e2e

NAMESPACE = "default"


def _pod(name: str, node: str, image: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "metaroce-e2e"}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "infinity"],
                }
            ],
        },
    }


def _wait_running(kube: Kube, names: list[str], timeout: float = 300.0) -> dict[str, str]:
    """Pod name -> pod IP once every pod is Running."""
    deadline = time.monotonic() + timeout
    while True:
        out = kube.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json").stdout
        pods = {p["metadata"]["name"]: p for p in json.loads(out)["items"]}
        ips = {
            n: pods[n]["status"].get("podIP", "")
            for n in names
            if n in pods and pods[n]["status"].get("phase") == "Running"
        }
        if len(ips) == len(names) and all(ips.values()):
            return ips
        if time.monotonic() > deadline:
            described = kube.kubectl("describe", "pods", "-n", NAMESPACE, *names, check=False)
            raise AssertionError(f"pods not Running in {timeout} s:\n{described.stdout[-3000:]}")
        time.sleep(2)


def test_nodes_are_ready_kubelets(kube: Kube) -> None:
    nodes = json.loads(kube.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    for name in kube.nodes:
        node = by_name[name]
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", (name, ready)
        info = node["status"]["nodeInfo"]
        assert info["containerRuntimeVersion"].startswith("containerd://"), info
        assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})


def test_pods_on_two_nodes(kube: Kube) -> None:
    names = ["e2e-pod-a", "e2e-pod-b"]
    manifests = [_pod(n, node, kube.test_image) for n, node in zip(names, kube.nodes, strict=False)]
    t0 = time.monotonic()
    kube.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(m) for m in manifests))
    try:
        ips = _wait_running(kube, names)
        started = time.monotonic() - t0
        print(f"two pods Running on {kube.nodes[:2]} in {started:.1f} s: {ips}")
        # Pod to pod across nodes, with the pods' own addresses.
        ping = kube.kubectl(
            "exec", "-n", NAMESPACE, names[0], "--",
            "ping", "-c", "3", "-W", "5", ips[names[1]],
            timeout=60,
        )  # fmt: skip
        assert " 0% packet loss" in ping.stdout, ping.stdout
        # The in-cluster config of a pod (the kubernetes Service VIP) reaches the apiserver.
        probe = (
            "import ssl, urllib.request\n"
            "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
            "token = open(sa + '/token').read()\n"
            "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
            "req = urllib.request.Request('https://10.96.0.1:443/version',"
            " headers={'Authorization': 'Bearer ' + token})\n"
            "print(urllib.request.urlopen(req, context=ctx, timeout=20).read().decode())\n"
        )
        version = kube.kubectl(
            "exec", "-n", NAMESPACE, names[1], "--", "python3", "-c", probe, timeout=60
        )
        assert '"gitVersion"' in version.stdout, version.stdout
        logs = kube.kubectl("logs", "-n", NAMESPACE, names[0], timeout=60)
        assert logs.returncode == 0
    finally:
        kube.kubectl(
            "delete", "pod", "-n", NAMESPACE, *names, "--ignore-not-found", "--wait=true",
            timeout=180, check=False,
        )  # fmt: skip


def test_kubelet_restart_keeps_node_ready(kube: Kube) -> None:
    nodes = kube.real_nodes
    if nodes is None or nodes.guests is None:
        pytest.skip("restarting a kubelet needs the guests this session made")
    nodes.restart_kubelet(nodes.guests[0])
