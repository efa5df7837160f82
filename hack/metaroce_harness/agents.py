"""Real node agents in SoftRoCE guests: the process a DaemonSet pod would run.

The local cluster's nodes are kwok's (their pods only pretend to run), so the agent of a
node runs in the qemu guest of the same name, from the repository share, with the
config the operator rendered into the network's ConfigMap and the credentials of the
agents' ServiceAccount. Used by the demo; the e2e tests start theirs the same way.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path

from metaroce_harness.cluster import GUEST_HOST_ADDRESS, LocalCluster
from metaroce_harness.guests import BackgroundCommand, Guest

AGENT_LOG = "/tmp/metaroce-agent.log"
AGENT_CONFIG = "/tmp/agent-config.yaml"
AGENT_KUBECONFIG = "/tmp/kubeconfig"
METRICS_PORT = 9478


def agent_argv(node: str, *extra: str, metrics_port: int = METRICS_PORT) -> list[str]:
    """`metaroce agent` as the guest runs it (pyverbs required: the probe is real)."""
    return [
        "python3", "-m", "metaroce_agent", "agent",
        "--config", AGENT_CONFIG, "--kubeconfig", AGENT_KUBECONFIG,
        "--node-name", node, "--require-pyverbs", "--metrics-port", str(metrics_port),
        *extra,
    ]  # fmt: skip


def service_account_kubeconfig(cluster: LocalCluster, namespace: str, name: str) -> str:
    """Kubeconfig text for a guest (it reaches the host at 10.0.2.2) with a token of
    the ServiceAccount `namespace/name`: the agent has exactly its pod's permissions."""
    from metaroce_harness.chart import token_kubeconfig

    with tempfile.TemporaryDirectory() as tmp:
        path = token_kubeconfig(
            cluster, namespace, name, Path(tmp) / "kubeconfig",
            server=f"https://{GUEST_HOST_ADDRESS}:{cluster.api_port}",
        )  # fmt: skip
        return path.read_text()


def start_agent(
    guest: Guest, config_yaml: str, kubeconfig: str, *extra: str, log: str = AGENT_LOG
) -> BackgroundCommand:
    """Write the config and credentials into the guest and start the agent there."""
    guest.write_file(AGENT_CONFIG, config_yaml)
    guest.write_file(AGENT_KUBECONFIG, kubeconfig, mode=0o600)
    argv = agent_argv(guest.name, *extra)
    return guest.start(f"exec {shlex.join(argv)} >>{log} 2>&1")


def agent_log(guest: Guest, lines: int = 60, log: str = AGENT_LOG) -> str:
    return str(guest.run(f"tail -n {lines} {log}", timeout=30).stdout)


def stop_agents(jobs: Sequence[BackgroundCommand]) -> None:
    for job in jobs:
        if job.poll() is None:
            job.kill()
