"""The operator's DaemonSet runs the agents on real nodes: SoftRoCE up, QoS applied, the
device plugin registered with the kubelet (the nodes advertise the resource), a kubelet
restart keeps the resource without restarting the agent, and deleting the network
removes the agents and cleans the nodes.

The operator runs on the host against the cluster (as an operator pod could not reach
the guests' network from the harness's pod network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO_ROOT, Kube

from metaroce_harness.cluster import free_port

pytestmark = pytest.mark.e2e

NAMESPACE = "metaroce-system"
NETWORK = "e2e-softroce"
RESOURCE = f"metaroce.io/{NETWORK}"
LABEL = "metaroce.io/e2e-rdma"


def _wait(what: str, check: Callable[[], bool], timeout: float = 240.0) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(2)
    return time.monotonic() - t0


def _agent_image() -> str:
    version = subprocess.run(
        ["bash", str(REPO_ROOT / "hack/app-version.sh")], capture_output=True, text=True
    ).stdout.strip()
    return os.environ.get("METAROCE_E2E_AGENT_IMAGE", f"ghcr.io/metaroce/metaroce-agent:{version}")


@pytest.fixture
def operator(kube: Kube, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    for crd in sorted((REPO_ROOT / "charts/metaroce/crds").glob("*.yaml")):
        kube.kubectl("apply", "--server-side", "-f", str(crd))
    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    kube.kubectl(
        "label", "--overwrite", "namespace", NAMESPACE,
        "pod-security.kubernetes.io/enforce=privileged",
    )  # fmt: skip
    kube.kubectl("label", "--overwrite", "node", *kube.nodes[:2], f"{LABEL}=true")
    log = (tmp_path / "operator.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "metaroce_operator",
            f"--namespace={NAMESPACE}", f"--agent-image={_agent_image()}",
            f"--metrics-port={free_port()}", f"--health-port={free_port()}",
            # No webhooks here: pod attachment is not part of this test.
            "--webhook-port=0", "--identity=e2e-operator",
        ],
        env={**os.environ, "KUBECONFIG": str(kube.kubeconfig), "POD_NAME": "e2e-operator"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        kube.kubectl("delete", "metarocenetwork", NETWORK, "--ignore-not-found", check=False)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        kube.kubectl("label", "node", *kube.nodes[:2], f"{LABEL}-", check=False)


def _network() -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "metaroce.io/v1alpha1",
            "kind": "MetaRoceNetwork",
            "metadata": {"name": NETWORK},
            "spec": {
                "nodeSelector": {"matchLabels": {LABEL: "true"}},
                "nics": {"interfaceNames": ["eth0"]},
                "transport": {"mode": "softroce"},
                "qos": {"profile": "lossless", "onUnsupported": "skip"},
                "attachment": {"resourceName": RESOURCE, "podsPerDevice": 4},
                "cleanupOnDelete": True,
            },
        }
    )


def _agent_pods(kube: Kube) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "pods", "-n", NAMESPACE, "-l", f"metaroce.io/network={NETWORK}", "-o", "json"
    ).stdout
    return list(json.loads(out)["items"])


def _restarts(kube: Kube) -> dict[str, int]:
    return {
        p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
        for p in _agent_pods(kube)
    }


def _allocatable(kube: Kube) -> dict[str, str]:
    nodes = json.loads(kube.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return {
        n["metadata"]["name"]: n["status"].get("allocatable", {}).get(RESOURCE, "") for n in nodes
    }


def test_agents_as_daemonset_pods(kube: Kube, operator: subprocess.Popen[bytes]) -> None:
    nodes = kube.nodes[:2]
    kube.kubectl("apply", "-f", "-", input=_network())

    def agents_ready() -> bool:
        assert operator.poll() is None, "the operator exited: read operator.log in tmp_path"
        pods = _agent_pods(kube)
        ready = {
            p["spec"]["nodeName"]
            for p in pods
            if all(c["ready"] for c in p["status"].get("containerStatuses") or [{"ready": False}])
        }
        return set(nodes) <= ready

    took = _wait("agent pods Ready on both nodes", agents_ready, 300)
    print(f"agent pods Ready in {took:.1f} s")
    took = _wait(
        f"{RESOURCE} advertised by both nodes",
        lambda: all(_allocatable(kube).get(n) not in ("", "0") for n in nodes),
    )
    print(f"resource advertised {took:.1f} s later: {_allocatable(kube)}")
    states = json.loads(kube.kubectl("get", "metarocenodestates", "-o", "json").stdout)["items"]
    phases = [st.get("status", {}).get("phase") for st in states]
    assert len(phases) >= 2 and set(phases) == {"Ready"}, phases

    real = kube.real_nodes
    if real is not None and real.guests is not None:
        g = real.guests[0]
        assert "rxe" in g.run("rdma link", check=True).stdout
        restarts_before = {
            p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
            for p in _agent_pods(kube)
        }
        real.restart_kubelet(g)  # returns once the new kubelet reported Ready
        _wait(
            f"{RESOURCE} back on {g.name} after the kubelet restart",
            lambda: _allocatable(kube).get(g.name) not in ("", "0"),
        )
        restarts_after = {
            p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
            for p in _agent_pods(kube)
        }
        assert restarts_after == restarts_before

    kube.kubectl("delete", "metarocenetwork", NETWORK, "--wait=true", timeout=240)
    _wait("agent pods gone", lambda: not _agent_pods(kube), 240)
    if real is not None and real.guests is not None:
        for g in real.guests:
            assert "rxe" not in g.run("rdma link", check=True).stdout, g.name
            assert "clsact" not in g.run("tc qdisc show dev eth0", check=True).stdout, g.name
