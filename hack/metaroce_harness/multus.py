"""Multus on the real-node guests, installed as a platform installs it (issue 14).

- the binary: the thin plugin (`cmd/multus`) built from its Go module at the pinned
  version (``hack/build-multus.sh``, cached like the kubelet), shared into the guests
  over 9p and copied into containerd's CNI bin dir (``/usr/lib/cni``, where Debian's
  containernetworking-plugins put bridge, macvlan, ipvlan and host-local);
- the cluster prerequisites (`install_prerequisites`, once per cluster): Multus's own
  NetworkAttachmentDefinition CRD from the same module (not the metaroce chart's to ship),
  and a ServiceAccount `kube-system/multus` with least privilege: get NADs, get pods and
  update their status (Multus writes the `network-status` annotation), create and patch
  events. Upstream's ClusterRole grants `*` on k8s.cni.cncf.io; the thin plugin only
  reads NADs;
- per guest (`guest_files`): a kubeconfig with a token of that ServiceAccount, and
  ``/etc/cni/net.d/00-multus.conf``, first in containerd's conf dir, which delegates the
  cluster network to the guest's own bridge + host-local conflist (``nodes.cni_config``)
  and reads config-less NADs from ``/etc/cni/multus/net.d``. ``namespaceIsolation`` is on:
  a pod may use NADs of its own namespace and of ``globalNamespaces`` only, which names
  the metaroce agents' namespace (where the operator renders each network's NAD) and
  ``default``.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from metaroce_harness.cluster import HarnessError, LocalCluster

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack" / "build-multus.sh"
GUEST_MULTUS_DIR = "/opt/multus"
"""Where the guests see the build's cache directory (bin/multus, nad-crd.yaml)."""
CNI_BIN_DIR = "/usr/lib/cni"
CONF_FILE = "/etc/cni/net.d/00-multus.conf"
KUBECONFIG = "/etc/cni/net.d/multus.d/multus.kubeconfig"
NAD_CONF_DIR = "/etc/cni/multus/net.d"
NAMESPACE = "kube-system"
SERVICE_ACCOUNT = "multus"
GLOBAL_NAMESPACES = ("default", "metaroce-system")
TOKEN_DURATION = "48h"

_built: Path | None = None
_lock = threading.Lock()


def ensure_multus() -> Path:
    """The build's directory (``bin/multus``, ``nad-crd.yaml``), built or from the cache."""
    global _built
    with _lock:
        if _built is None:
            proc = subprocess.run(
                ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False
            )
            if proc.returncode != 0:
                raise HarnessError(
                    f"building Multus failed ({BUILD_SCRIPT} exited {proc.returncode}); its "
                    "last lines above name the log to read"
                )
            _built = Path(proc.stdout.strip().splitlines()[-1]).parent
        return _built


def rbac_objects() -> list[dict[str, Any]]:
    """Multus's ServiceAccount, ClusterRole and binding (least privilege, see above)."""
    labels = {"app.kubernetes.io/name": "multus", "app.kubernetes.io/part-of": "metaroce-harness"}
    meta = {"name": SERVICE_ACCOUNT, "labels": labels}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {**meta, "namespace": NAMESPACE},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": [
                {
                    "apiGroups": ["k8s.cni.cncf.io"],
                    "resources": ["network-attachment-definitions"],
                    "verbs": ["get"],
                },
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["update"]},
                {
                    "apiGroups": ["", "events.k8s.io"],
                    "resources": ["events"],
                    "verbs": ["create", "patch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": SERVICE_ACCOUNT,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}
            ],
        },
    ]


def install_prerequisites(cluster: LocalCluster, built: Path, timeout: float = 60.0) -> str:
    """The NAD CRD and Multus's RBAC on `cluster`; returns a token of its ServiceAccount."""
    cluster.kubectl("apply", "--server-side", "-f", str(built / "nad-crd.yaml"))
    docs = "\n---\n".join(json.dumps(o) for o in rbac_objects())
    cluster.kubectl("apply", "--server-side", "-f", "-", input=docs)
    deadline = time.monotonic() + timeout
    while True:
        got = cluster.kubectl("get", "--raw", "/apis/k8s.cni.cncf.io/v1", check=False, timeout=30)
        if got.returncode == 0 and "network-attachment-definitions" in got.stdout:
            break
        if time.monotonic() > deadline:
            raise HarnessError(f"the NetworkAttachmentDefinition CRD is not served: {got.stderr}")
        time.sleep(0.5)
    token = cluster.kubectl(
        "create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE, f"--duration={TOKEN_DURATION}"
    ).stdout.strip()
    if not token:
        raise HarnessError("kubectl create token returned no token for Multus")
    return token


def kubeconfig(server: str, ca_pem: bytes, token: str) -> str:
    import base64

    user = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "multus", "context": {"cluster": "local", "user": user}}],
        "current-context": "multus",
    }
    return yaml.safe_dump(config)


def multus_config(cluster_network: dict[str, Any]) -> str:
    """``00-multus.conf``: Multus first, the guest's own network as its default delegate."""
    conf = {
        "cniVersion": cluster_network.get("cniVersion", "0.4.0"),
        "name": "multus-cni-network",
        "type": "multus",
        "kubeconfig": KUBECONFIG,
        "confDir": NAD_CONF_DIR,
        "cniDir": "/var/lib/cni/multus",
        "binDir": CNI_BIN_DIR,
        "logFile": "/var/log/metaroce/multus.log",
        "logLevel": "verbose",
        "namespaceIsolation": True,
        "globalNamespaces": ",".join(GLOBAL_NAMESPACES),
        "delegates": [cluster_network],
    }
    return json.dumps(conf, indent=2) + "\n"


def guest_setup_script() -> str:
    """Shell run in each guest: the binary into the CNI bin dir, the config directories."""
    return (
        "set -eu\n"
        # the secondary interfaces' drivers (in the guest image, hack/build-guest.sh)
        "modprobe macvlan\nmodprobe ipvlan\n"
        f"install -m 0755 {GUEST_MULTUS_DIR}/bin/multus {CNI_BIN_DIR}/multus\n"
        f"mkdir -p {NAD_CONF_DIR} $(dirname {KUBECONFIG}) /var/lib/cni/multus\n"
        f"{CNI_BIN_DIR}/multus -version\n"
    )
