"""Reaching the cluster from the CLI, offline-safe: no kubeconfig or no answer is a reason
to print, never a traceback. Uses the agent's small stdlib client (no kubernetes package)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from metaroce_agent.kube import KubeClient, KubeError

TIMEOUT_SECONDS = 5.0


def kubeconfig_path(flag: str | None) -> str | None:
    """--kubeconfig, else the first existing file of $KUBECONFIG, else ~/.kube/config."""
    if flag:
        return flag
    for part in (os.environ.get("KUBECONFIG") or "").split(os.pathsep):
        if part and Path(part).is_file():
            return part
    default = Path.home() / ".kube" / "config"
    return str(default) if default.is_file() else None


def connect(flag: str | None) -> tuple[KubeClient | None, str]:
    """A client with a short timeout, or None and why (no kubeconfig, unreadable one)."""
    path = kubeconfig_path(flag)
    try:
        if path is not None:
            client = KubeClient.from_kubeconfig(path)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            client = KubeClient.in_cluster()
        else:
            return None, "no kubeconfig: set KUBECONFIG or pass --kubeconfig"
    except (KubeError, OSError, KeyError, TypeError, ValueError, AttributeError) as e:
        return None, f"cannot use the kubeconfig {path}: {e}" if path else str(e)
    client.timeout = TIMEOUT_SECONDS
    return client, ""


class KubectlMissing(RuntimeError):
    """kubectl is not on PATH (exec and logs go through it)."""


def kubectl(
    args: Sequence[str],
    kubeconfig: str | None = None,
    *,
    input: str | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run kubectl (for what the small REST client cannot do: exec, logs), never raising
    on its exit status; a hung call ends with exit 124 and says so."""
    binary = shutil.which("kubectl")
    if binary is None:
        raise KubectlMissing(
            "kubectl is not on PATH: install it (https://kubernetes.io/docs/tasks/tools/)"
        )
    argv = [binary, *([f"--kubeconfig={kubeconfig}"] if kubeconfig else []), *args]
    try:
        return subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else ""
        return subprocess.CompletedProcess(
            argv, 124, out, f"kubectl {' '.join(args[:2])} did not return in {timeout:.0f} s"
        )
