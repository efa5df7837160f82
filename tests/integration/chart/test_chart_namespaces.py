"""The chart in a namespace and under a release name the user picks (issue 17).

`helm install <any name> -n <ns> --create-namespace` on the real apiserver: the chart
follows the release namespace (no Namespace object of its own to clash with Helm's),
`fullnameOverride` names the cluster-scoped objects, `crds.install=false` installs over
CRDs applied with kubectl, CRDs no release owns stop an install until `--take-ownership`
adopts them, a namespace whose Pod Security level refuses the agents is refused
with the command that fixes it, and the chart's agent values (tolerations, priority
class, kubelet root, pod labels and annotations, a registry mirror and a digest, pull
secrets) reach the DaemonSet the real operator renders with the chart's arguments."""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_api import constants as c
from metaroce_harness import chart
from metaroce_harness.cluster import LocalCluster, free_port
from metaroce_harness.polling import wait_for
from metaroce_operator.cli import AgentPodDefaults, chart_arguments
from metaroce_operator.render.common import child_name

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
from operator_env import OperatorProcess  # the operator tests' own helpers

VERSION = str(yaml.safe_load((chart.CHART_DIR / "Chart.yaml").read_text())["appVersion"])
DIGEST = "sha256:" + "ab" * 32
GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
AGENT_VALUES: dict[str, Any] = {
    "global": {"imageRegistry": "mirror.example.com:5000/rdma"},
    "agent": {
        "image": {"digest": DIGEST, "pullPolicy": "Always"},
        "tolerations": [GPU],
        "priorityClassName": "",
        "kubeletRootDir": "/var/lib/k0s/kubelet",
        "podLabels": {"team": "ml"},
        "podAnnotations": {"example.com/owner": "rdma-team"},
    },
    "imagePullSecrets": [{"name": "regcred"}],
}
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"
MIRRORED_AGENT = f"mirror.example.com:5000/rdma/metaroce/metaroce-agent@{DIGEST}"


def _helm_install(
    cluster: LocalCluster, release: str, namespace: str, values: dict[str, Any], *extra: str
) -> Any:
    merged = {**values, "operator": {**chart.HOST_OPERATOR_VALUES["operator"]}}
    return cluster.helm(
        "install", release, str(chart.CHART_DIR), "-n", namespace, "--wait=false",
        *chart.set_flags(merged), *extra, check=False,
    )  # fmt: skip


# --------------------------------------------------------------------------- offline


def test_release_namespace_and_name_are_followed(cluster: LocalCluster) -> None:
    docs = chart.render(cluster, "rdma", {"fullnameOverride": "fabric"}, "-n", "team-x")
    assert not [d for d in docs if d["kind"] == "Namespace"], "Helm made the release namespace"
    for doc in docs:
        assert doc["metadata"].get("namespace") in (None, "team-x"), doc["metadata"]
    deploy = chart.find(docs, "Deployment")
    assert deploy["metadata"]["name"] == "fabric"
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "fabric"
    assert chart.operator_args(docs) == chart_arguments(
        "team-x", f"ghcr.io/metaroce/metaroce-agent:{VERSION}", "fabric", admission_mode="policy"
    )
    chart.find(docs, "ClusterRole", "fabric-agent")
    chart.find(docs, "ValidatingWebhookConfiguration", "fabric-networks")


def test_a_release_in_default_keeps_the_agents_out_of_default(cluster: LocalCluster) -> None:
    docs = chart.render(cluster, "rdma", {})
    (ns,) = [d for d in docs if d["kind"] == "Namespace"]
    assert ns["metadata"]["name"] == "metaroce-system"
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    proc = cluster.helm(
        "template",
        "rdma",
        str(chart.CHART_DIR),
        "-n",
        "kube-system",
        f"--kube-version={chart.kube_version(cluster)}",
        check=False,
    )
    assert proc.returncode != 0
    assert "a namespace of their own" in proc.stderr and "--create-namespace" in proc.stderr


def test_agent_values_become_exactly_the_operator_flags(cluster: LocalCluster) -> None:
    docs = chart.render(cluster, "rdma", AGENT_VALUES, "-n", "team-x")
    defaults = AgentPodDefaults(
        pull_policy="Always", tolerations=[GPU], priority_class="",
        kubelet_root_dir="/var/lib/k0s/kubelet", pod_labels={"team": "ml"},
        pod_annotations={"example.com/owner": "rdma-team"},
    )  # fmt: skip
    assert chart.operator_args(docs) == chart_arguments(
        "team-x", MIRRORED_AGENT, "rdma-metaroce", admission_mode="policy",
        image_pull_secrets=["regcred"], agent_pod_defaults=defaults,
    )  # fmt: skip
    pod = chart.find(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == (
        f"mirror.example.com:5000/rdma/metaroce/metaroce-operator:{VERSION}"
    )


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"agent": {"kubeletRootDir": "var/lib/kubelet"}}, ["/agent/kubeletRootDir"]),
        ({"agent": {"image": {"digest": "sha256:nope"}}}, ["/agent/image/digest"]),
        ({"agent": {"tolerations": [{"operator": "Sometimes"}]}}, ["/agent/tolerations/0"]),
        ({"fullnameOverride": "Fabric"}, ["/fullnameOverride"]),
    ],
)
def test_bad_values_name_the_key(
    cluster: LocalCluster, values: dict[str, Any], words: list[str]
) -> None:
    proc = cluster.helm(
        "template",
        "rdma",
        str(chart.CHART_DIR),
        *chart.set_flags(values),
        f"--kube-version={chart.kube_version(cluster)}",
        check=False,
    )
    assert proc.returncode != 0
    for word in words:
        assert word in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- installed


def test_a_namespace_that_refuses_privileged_pods_is_refused(cluster: LocalCluster) -> None:
    ns = f"strict-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=baseline")
    try:
        proc = _helm_install(cluster, "rdma-strict", ns, {"crds": {"install": False}})
        assert proc.returncode != 0
        fix = f"kubectl label --overwrite namespace {ns} {PSA_ENFORCE}=privileged"
        assert fix in proc.stderr, proc.stderr
        assert "rdma-strict" not in cluster.helm("list", "-n", ns, "-q").stdout
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


HELM_OWNER = ("meta.helm.sh/release-name", "meta.helm.sh/release-namespace")
CRDS = (c.NETWORK_CRD_NAME, c.NODESTATE_CRD_NAME)


def _disown_crds(cluster: LocalCluster) -> None:
    """The CRDs as `kubectl apply` (or an earlier chart's crds/ folder) leaves them on a
    cluster: no release's annotations or label on them."""
    for crd in CRDS:
        cluster.kubectl("annotate", "crd", crd, *(f"{k}-" for k in HELM_OWNER), check=False)
        cluster.kubectl("label", "crd", crd, "app.kubernetes.io/managed-by-", check=False)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(chart.CRD_DIR))


def _owner(cluster: LocalCluster, crd: str) -> tuple[str | None, ...]:
    meta = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json").stdout)["metadata"]
    annotations = meta.get("annotations") or {}
    return tuple(annotations.get(k) for k in HELM_OWNER)


def test_crds_no_release_owns_stop_the_install_until_taken_over(cluster: LocalCluster) -> None:
    """The README's migration path: over CRDs no release owns, the default install stops
    with Helm's `invalid ownership metadata` before it creates anything; `--take-ownership`
    adopts them (and marks them keep); a second release beside it sets crds.install=false."""
    tag = secrets.token_hex(3)
    release, namespace = f"crds-{tag}", f"crds-{tag}"
    other, other_ns = f"beside-{tag}", f"beside-{tag}"
    _disown_crds(cluster)
    assert all(_owner(cluster, crd) == (None, None) for crd in CRDS)
    try:
        proc = _helm_install(cluster, release, namespace, {}, "--create-namespace")
        assert proc.returncode != 0
        assert "invalid ownership metadata" in proc.stderr, proc.stderr
        assert release not in cluster.helm("list", "-A", "-q").stdout
        proc = _helm_install(
            cluster, release, namespace, {}, "--create-namespace", "--take-ownership"
        )
        assert proc.returncode == 0, proc.stderr
        for crd in CRDS:
            assert _owner(cluster, crd) == (release, namespace)
            meta = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json").stdout)["metadata"]
            assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
        # Only one release may own them: another one installs without.
        proc = _helm_install(cluster, other, other_ns, {}, "--create-namespace")
        assert proc.returncode != 0 and "invalid ownership metadata" in proc.stderr
        proc = _helm_install(
            cluster, other, other_ns, {"crds": {"install": False}}, "--create-namespace"
        )
        assert proc.returncode == 0, proc.stderr
        assert all(_owner(cluster, crd) == (release, namespace) for crd in CRDS)
    finally:
        for name, ns in ((other, other_ns), (release, namespace)):
            cluster.helm("uninstall", name, "-n", ns, "--wait=false", check=False)
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    for crd in CRDS:  # uninstalled, and kept
        cluster.kubectl("get", "crd", crd)


@pytest.fixture(scope="module")
def team_release(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str]]:
    """`helm install fabric-<tag> -n team-<tag> --create-namespace --set crds.install=false`
    over CRDs applied with kubectl (the documented GitOps path)."""
    tag = secrets.token_hex(3)
    release, namespace = f"fabric-{tag}", f"team-{tag}"
    cluster.kubectl("apply", "--server-side", "-f", str(chart.CRD_DIR))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        f"crd/{c.NETWORK_CRD_NAME}", f"crd/{c.NODESTATE_CRD_NAME}",
    )  # fmt: skip
    values = {**AGENT_VALUES, "crds": {"install": False}}
    proc = _helm_install(cluster, release, namespace, values, "--create-namespace")
    assert proc.returncode == 0, proc.stderr
    assert f"namespace {namespace}" in proc.stdout  # NOTES name where things run
    assert "kubectl apply --server-side -f crds/" in proc.stdout  # and how to upgrade
    try:
        yield release, namespace, f"{release}-metaroce"
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_install_with_create_namespace_and_a_release_name(
    cluster: LocalCluster, team_release: tuple[str, str, str]
) -> None:
    _release, namespace, fullname = team_release
    deploy = json.loads(cluster.kubectl(
        "get", "deployment", fullname, "-n", namespace, "-o", "json").stdout)  # fmt: skip
    assert deploy["metadata"]["annotations"]["meta.helm.sh/release-namespace"] == namespace
    cluster.kubectl("get", "clusterrole", f"{fullname}-agent")
    cluster.kubectl("get", "validatingwebhookconfiguration", f"{fullname}-networks")
    ns = json.loads(cluster.kubectl("get", "namespace", namespace, "-o", "json").stdout)
    # Helm made it, so the chart did not: no clash, and no label of the chart's.
    assert "meta.helm.sh/release-name" not in (ns["metadata"].get("annotations") or {})


def test_the_operator_renders_agents_with_the_chart_values(
    cluster: LocalCluster, team_release: tuple[str, str, str], tmp_path: Path
) -> None:
    release, namespace, fullname = team_release
    net = cluster.pod_network
    assert net is not None
    docs = chart.render(cluster, release, AGENT_VALUES, "-n", namespace)
    webhook_port = free_port()
    args = chart.replace_arg(chart.operator_args(docs), "--webhook-port", str(webhook_port))
    args = chart.replace_arg(args, "--metrics-port", str(free_port()))
    args = chart.replace_arg(args, "--health-port", str(free_port()))
    kubeconfig = chart.token_kubeconfig(
        cluster, namespace, fullname, tmp_path / "operator.kubeconfig",
        server=f"https://{net.host_ip}:{cluster.api_port}",
    )  # fmt: skip
    chart.route_service_to_pod_network(
        cluster, namespace, f"{fullname}-webhook", "https", webhook_port
    )
    op = OperatorProcess(
        args, kubeconfig=kubeconfig, log_path=tmp_path / "operator.log",
        identity=f"{fullname}-0", netns=net.netns, host=net.pod_ip,
        env={"POD_NAMESPACE": namespace},
    ).start()  # fmt: skip
    name = f"team-{secrets.token_hex(3)}"
    try:

        def served() -> bool:
            assert op.alive(), op.log()[-3000:]
            hook = json.loads(cluster.kubectl(
                "get", "validatingwebhookconfiguration", f"{fullname}-networks", "-o", "json",
            ).stdout)  # fmt: skip
            return all(w["clientConfig"].get("caBundle") for w in hook["webhooks"])

        wait_for(f"the caBundle ({op.log_path})", served, timeout=90)
        network = {
            "apiVersion": c.API_VERSION, "kind": c.NETWORK_KIND, "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {"harness.metaroce.io/pool": "a"}},
                     "nics": {"interfaceNames": ["eth1"]},
                     "transport": {"mode": "softroce"}, "qos": {"profile": "custom"}},
        }  # fmt: skip
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(network))

        def daemonset() -> dict[str, Any] | None:
            proc = cluster.kubectl(
                "get", "daemonset", child_name(name), "-n", namespace, "-o", "json", check=False
            )
            return json.loads(proc.stdout) if proc.returncode == 0 else None

        ds = wait_for("the agent DaemonSet in the release namespace", daemonset, timeout=90)
        template = ds["spec"]["template"]
        pod = template["spec"]
        (container,) = pod["containers"]
        assert container["image"] == MIRRORED_AGENT
        assert container["imagePullPolicy"] == "Always"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert GPU in pod["tolerations"]
        assert "priorityClassName" not in pod
        paths = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
        assert paths["device-plugins"] == "/var/lib/k0s/kubelet/device-plugins"
        assert paths["pod-resources"] == "/var/lib/k0s/kubelet/pod-resources"
        assert template["metadata"]["labels"]["team"] == "ml"
        assert template["metadata"]["annotations"]["example.com/owner"] == "rdma-team"
        log = op.log()
        assert "Forbidden" not in log and "forbidden" not in log, log[-4000:]
    finally:
        cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--ignore-not-found", "--wait=false",
                        check=False)  # fmt: skip
        op.stop()
