"""`metaroce status` against the real apiserver (issue 17): a network with the status an
operator writes and NodeStates as agents report them, read by the installed `metaroce`
command with a kubeconfig -- the failing step, its fix, and the exit status."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_api import constants as c
from metaroce_api.nodestate import nodestate_labels, nodestate_name
from metaroce_harness.cluster import REPO_ROOT, LocalCluster

NOW = "2026-12-01T10:00:00Z"


def _condition(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": NOW, "observedGeneration": 1}  # fmt: skip


def _metaroce(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    return subprocess.run(
        [sys.executable, "-m", "metaroce_cli.main", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture
def reported_network(cluster: LocalCluster) -> Iterator[str]:
    cluster.kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        f"crd/{c.NETWORK_CRD_NAME}", f"crd/{c.NODESTATE_CRD_NAME}",
    )  # fmt: skip
    name = f"status-{secrets.token_hex(3)}"
    body = yaml.safe_load((REPO_ROOT / "samples" / "softroce-dev.yaml").read_text())
    body["metadata"]["name"] = name
    body["spec"]["attachment"].pop("resourceName", None)
    cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(body))
    status = {"status": {
        "observedGeneration": 1,
        "nodes": {"desired": 2, "configured": 1, "healthy": 1, "failed": 1, "summary": "1/2"},
        "conditions": [
            _condition("Ready", "False", c.REASON_NODES_FAILED, "1 of 2 nodes failed"),
            _condition("Progressing", "False", c.REASON_RECONCILED, ""),
            _condition(c.CONDITION_DEGRADED, "True", c.REASON_NODES_FAILED, "kwok-a2: apply"),
        ],
        "failingNodes": [{"node": "kwok-a2", "reason": "ApplyFailed", "message": "mtu"}],
    }}  # fmt: skip
    cluster.kubectl("patch", c.NETWORK_PLURAL, name, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))  # fmt: skip
    for node, phase, errors in (
        ("kwok-a1", "Ready", []),
        ("kwok-a2", "Failed", [{"step": "apply mtu", "message": "eth0: MTU 9000 refused",
                                "time": NOW}]),
    ):  # fmt: skip
        state = {
            "apiVersion": c.API_VERSION, "kind": c.NODESTATE_KIND,
            "metadata": {"name": nodestate_name(name, node),
                         "labels": nodestate_labels(name, node)},
            "spec": {"network": name, "node": node},
            "status": {"phase": phase, "errors": errors,
                       "transport": {"mode": "softroce", "ready": phase == "Ready"},
                       "inventory": [{"netdev": "eth0", "rdmaDevice": "rxe_eth0",
                                      "rdmaKind": "softroce", "portState": "ACTIVE"}]},
        }  # fmt: skip
        cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(state))
    try:
        yield name
    finally:
        cluster.kubectl("delete", c.NODESTATE_PLURAL, "-l", f"{c.NETWORK_LABEL}={name}",
                        "--wait=false", check=False)  # fmt: skip
        # no operator here to lift the cleanup finalizer (if any): delete without waiting
        cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--wait=false", check=False)


def test_status_of_a_network_shows_the_failing_step_and_its_fix(
    cluster: LocalCluster, reported_network: str
) -> None:
    done = _metaroce(cluster, "status", reported_network)
    assert done.returncode == 1, done.stdout + done.stderr  # not Ready
    out = done.stdout
    assert f"network {reported_network}: transport softroce, nodes desired 2" in out
    assert "Ready=False NodesFailed: 1 of 2 nodes failed" in out
    assert "kwok-a1" in out and "rxe_eth0/eth0 ACTIVE" in out
    assert "apply mtu: eth0: MTU 9000 refused" in out
    assert "fix: the step failed and the node was rolled back" in out
    assert "`metaroce doctor --node kwok-a2`" in out


def test_status_overview_and_unknown_network(cluster: LocalCluster, reported_network: str) -> None:
    done = _metaroce(cluster, "status")
    assert done.returncode == 1
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith(reported_network)]
    assert line.split()[1:3] == ["False", "1/2"]
    missing = _metaroce(cluster, "status", "no-such-network")
    assert missing.returncode == 2 and "no MetaRoceNetwork 'no-such-network'" in missing.stdout


def test_status_names_the_kubeconfig_problem(tmp_path: Path) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("not: [a kubeconfig")
    done = subprocess.run(
        [sys.executable, "-m", "metaroce_cli.main", "status", f"--kubeconfig={bad}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "cannot use the kubeconfig" in done.stdout, done.stdout
