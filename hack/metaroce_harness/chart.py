"""The Helm chart on the local control plane: install it, and run its operator from the host.

The local cluster has no kubelet for the operator's pods (kwok only pretends to run
them), so the operator runs as a host process, but as the chart's Deployment would: with
the rendered arguments, the chart's ServiceAccount credentials (`kubectl create token`),
and its webhooks reached through the chart's Service (an EndpointSlice pointing at the
pod network, where the process listens). Used by the demo, the chart's tests and the
real-node e2e tests.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from metaroce_harness.cluster import REPO_ROOT, Component, HarnessError, LocalCluster
from metaroce_harness.polling import wait_for

CHART_DIR = REPO_ROOT / "charts" / "metaroce"
CRD_DIR = REPO_ROOT / "crds"
HOST_OPERATOR_VALUES: dict[str, Any] = {
    "operator": {"nodeSelector": {"harness.metaroce.io/operator-runs-on": "host"}}
}
"""Values for a release whose operator runs on the host: the Deployment's pods select no
node and stay Pending. kwok would otherwise "run" them and mark them Ready with made-up
IPs, and the webhook Service would send some admission calls there."""


def set_flags(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`--set-json` flags for nested values (exact types: ints stay ints)."""
    flags: list[str] = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        # A map whose keys hold dots (labels) goes whole: `--set` paths split on dots.
        if isinstance(value, Mapping) and value and not any("." in k for k in value):
            flags += set_flags(value, path + ".")
        else:
            flags += ["--set-json", f"{path}={json.dumps(value)}"]
    return flags


def render(
    cluster: LocalCluster, release: str, values: Mapping[str, Any] = {}, *extra: str
) -> list[dict[str, Any]]:
    """`helm template` of the chart as `helm install` renders it on `cluster`: for its
    Kubernetes version and the API versions that pick the admission mode (`helm template`
    alone assumes an old cluster and knows none of them)."""
    out = cluster.helm(
        "template", release, str(CHART_DIR), f"--kube-version={kube_version(cluster)}",
        *(f"--api-versions={v}" for v in served_policy_apis(cluster)),
        *set_flags(values), *extra,
    ).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


MUTATING_POLICY_API = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"
"""What the chart's `metaroce.admissionMode` looks for (auto: policy mode where served)."""


def served_policy_apis(cluster: LocalCluster) -> list[str]:
    """`[MUTATING_POLICY_API]` where the cluster serves it (discovery, as helm install)."""
    out = cluster.kubectl(
        "api-resources", "--api-group=admissionregistration.k8s.io", "-o", "name", check=False
    ).stdout
    served = "mutatingadmissionpolicies.admissionregistration.k8s.io" in out.split()
    version = cluster.kubectl("api-versions").stdout.split()
    return [MUTATING_POLICY_API] if served and "admissionregistration.k8s.io/v1" in version else []


def kube_version(cluster: LocalCluster) -> str:
    """The apiserver's version (`helm template` assumes an old one otherwise)."""
    out = cluster.kubectl("version", "-o", "json").stdout
    return str(json.loads(out)["serverVersion"]["gitVersion"])


def find(docs: Sequence[Mapping[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    for doc in docs:
        if doc.get("kind") == kind and (name is None or doc["metadata"]["name"] == name):
            return dict(doc)
    raise HarnessError(f"the chart rendered no {kind} {name or ''}")


def operator_args(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The operator container's arguments in the rendered Deployment."""
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    return [str(a) for a in pod["containers"][0]["args"]]


def token_kubeconfig(
    cluster: LocalCluster,
    namespace: str,
    service_account: str,
    path: Path,
    *,
    server: str | None = None,
    duration: str = "2h",
) -> Path:
    """A kubeconfig with a token of `service_account` (what the pod would mount)."""
    token = cluster.kubectl(
        "create", "token", service_account, "-n", namespace, f"--duration={duration}"
    ).stdout.strip()
    ca = base64.b64encode(cluster.ca.pair.cert_pem()).decode()
    user = f"system:serviceaccount:{namespace}:{service_account}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {"server": server or cluster.server, "certificate-authority-data": ca},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": user}}],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def route_service_to_pod_network(
    cluster: LocalCluster, namespace: str, service: str, port_name: str, port: int
) -> None:
    """An EndpointSlice that sends `service` to the pod network at `port` (no real pods)."""
    if cluster.pod_network is None:
        raise HarnessError("the cluster is not started")
    body = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-podnet",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "harness.metaroce.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [cluster.pod_network.pod_ip], "conditions": {"ready": True}}],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))


def replace_arg(args: Sequence[str], flag: str, value: str) -> list[str]:
    """`args` with `flag=...` set to `value` (added when absent)."""
    out = [a for a in args if not a.startswith(flag + "=")]
    return [*out, f"{flag}={value}"]


def install(cluster: LocalCluster, release: str, namespace: str) -> None:
    """`helm install` of the chart for an operator that runs on the host (CRDs included);
    returns once the CRDs are Established."""
    cluster.helm(
        "install", release, str(CHART_DIR), "-n", "default",
        *set_flags({"namespace": {"name": namespace}, **HOST_OPERATOR_VALUES}),
    )  # fmt: skip
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/metarocenetworks.metaroce.io", "crd/metarocenodestates.metaroce.io",
    )  # fmt: skip


def start_host_operator(
    cluster: LocalCluster,
    release: str,
    namespace: str,
    workdir: Path,
    *,
    timeout: float = 120.0,
    values: Mapping[str, Any] = {},
) -> Component:
    """Run the installed release's operator as its pod would, in the pod network, and
    return once it leads and has published its webhook CA (the webhooks are served).

    Exactly the chart's arguments, the chart ServiceAccount's token, and the chart's
    webhook Service routed to the process (EndpointSlice to the pod network). `values`:
    those the release was installed with that change its objects' names
    (fullnameOverride)."""
    net = cluster.pod_network
    if net is None:
        raise HarnessError("the cluster is not started")
    docs = render(cluster, release, {"namespace": {"name": namespace}, **values})
    # The chart's fullname (the ServiceAccount's and the webhook Service's name): the
    # release name when it says metaroce, else <release>-metaroce or fullnameOverride.
    fullname = find(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    args = operator_args(docs)
    configs = [
        (d["kind"].lower(), d["metadata"]["name"])
        for d in docs
        if d.get("kind") in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    ]
    kubeconfig = token_kubeconfig(
        cluster, namespace, fullname, workdir / "operator.kubeconfig",
        server=f"https://{net.host_ip}:{cluster.api_port}",
    )  # fmt: skip
    port = int(next(a for a in args if a.startswith("--webhook-port=")).split("=")[1])
    route_service_to_pod_network(cluster, namespace, f"{fullname}-webhook", "https", port)
    env = [
        f"KUBECONFIG={kubeconfig}",
        f"POD_NAME={fullname}-host-0",
        f"POD_NAMESPACE={namespace}",
        "PYTHONUNBUFFERED=1",
    ]
    operator = net.popen(
        ["env", *env, sys.executable, "-m", "metaroce_operator", *args], "operator"
    )

    def get(*what: str) -> Any:
        proc = cluster.kubectl("get", *what, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def leading_with_ca() -> bool:
        operator.check_alive()
        lease = get("lease", "metaroce-operator", "-n", namespace)
        # The pod webhook's configuration only in the webhook admission mode.
        hooks = [get(kind, name) for kind, name in configs]
        return bool(
            lease
            and lease["spec"].get("holderIdentity")
            and all(h and h["webhooks"][0]["clientConfig"].get("caBundle") for h in hooks)
        )

    try:
        wait_for("the operator to lead and publish its webhook CA", leading_with_ca, timeout, 1)
    except AssertionError as exc:
        raise HarnessError(f"{exc}; read {operator.log_path}") from None
    return operator
