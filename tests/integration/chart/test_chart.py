"""The Helm chart on the local control plane (issue 7).

Offline checks first (lint, the operator's arguments, the schema's refusals, the
monitoring objects' metric names), then `helm template | kubectl apply --dry-run=server`,
then one release installed for the module: CRDs, webhook configurations, RBAC as the
chart's service accounts see it, the real operator run with the chart's arguments and
ServiceAccount token reconciling samples/softroce-dev.yaml, the documented upgrade path,
and `helm uninstall` leaving only the CRDs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_api import constants as c
from metaroce_api import crdgen
from metaroce_harness import chart
from metaroce_harness.cluster import LocalCluster, free_port
from metaroce_harness.polling import wait_for
from metaroce_operator.cli import chart_arguments
from metaroce_operator.render.common import child_name

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
from operator_env import OperatorProcess, get_json  # the operator tests' own helpers

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "samples" / "softroce-dev.yaml"
VERSION = str(yaml.safe_load((chart.CHART_DIR / "Chart.yaml").read_text())["appVersion"])
OPTIONAL_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    }
}


def agent_image(tag: str = VERSION) -> str:
    return f"ghcr.io/metaroce/metaroce-agent:{tag}"


# --------------------------------------------------------------------------- offline


@pytest.mark.parametrize(
    "values", [{}, OPTIONAL_ON, {"webhook": {"certManager": {"enabled": True}}}]
)
def test_helm_lint_is_clean(cluster: LocalCluster, values: dict[str, Any]) -> None:
    out = cluster.helm("lint", "--strict", str(chart.CHART_DIR), *chart.set_flags(values))
    assert "0 chart(s) failed" in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        # This cluster serves MutatingAdmissionPolicy v1: auto picks the policy mode.
        (
            {},
            chart_arguments(
                "metaroce-system", agent_image(), "metaroce", 8443, False, admission_mode="policy"
            ),
        ),
        (
            {
                "namespace": {"name": "rdma-ops"},
                "agent": {"image": {"tag": "1.2.3"}},
                "webhook": {"port": 9443, "certManager": {"enabled": True}},
                "operator": {"logLevel": "debug"},
                "admission": {"mode": "webhook"},
            },
            [
                "--log-level=debug" if a == "--log-level=info" else a
                for a in chart_arguments("rdma-ops", agent_image("1.2.3"), "metaroce", 9443, True)
            ],
        ),
    ],
    ids=["defaults", "changed"],
)
def test_deployment_passes_exactly_chart_arguments(
    cluster: LocalCluster, values: dict[str, Any], expected: list[str]
) -> None:
    docs = chart.render(cluster, "metaroce", values)
    assert chart.operator_args(docs) == expected
    deploy = chart.find(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deploy["spec"]["replicas"] == 2
    assert container["image"] == f"ghcr.io/metaroce/metaroce-operator:{VERSION}"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "metrics": 8080,
        "health": 8081,
        "webhook": values.get("webhook", {}).get("port", 8443),
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert chart.find(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def test_default_roles_get_read_access_only_issue_16_11(cluster: LocalCluster) -> None:
    """`create` on networks is node root (a privileged hostNetwork agent on every selected
    node, NICs of the creator's choosing): the chart aggregates only reading into the
    default view/edit/admin roles, never writing into edit or admin."""
    docs = chart.render(cluster, "metaroce", {})
    aggregated = [
        d
        for d in docs
        if d["kind"] == "ClusterRole"
        and any(k.startswith(AGGREGATE) for k in (d["metadata"].get("labels") or {}))
    ]
    assert aggregated, "no ClusterRole is aggregated into the default roles"
    for role in aggregated:
        verbs = {v for rule in role["rules"] for v in rule["verbs"]}
        assert verbs <= {"get", "list", "watch"}, (role["metadata"]["name"], verbs)
    view = [r for r in aggregated if r["metadata"]["labels"].get(AGGREGATE + "view") == "true"]
    (role,) = view
    resources = {res for rule in role["rules"] for res in rule["resources"]}
    assert {c.NETWORK_PLURAL, c.NODESTATE_PLURAL} <= resources


def test_agent_image_allowlist_value_issue_16_11(cluster: LocalCluster) -> None:
    digest = "registry.example.com/metaroce-agent@sha256:" + "c" * 64
    docs = chart.render(cluster, "metaroce", {"agent": {"allowedImages": [digest]}})
    args = chart.operator_args(docs)
    assert f"--allowed-agent-image={digest}" in args
    assert f"--agent-image={agent_image()}" in args  # always allowed: the pinned default
    assert not any(
        a.startswith("--allowed-agent-image")
        for a in chart.operator_args(chart.render(cluster, "metaroce", {}))
    )


def test_one_namespace_is_privileged_and_holds_everything(cluster: LocalCluster) -> None:
    docs = chart.render(cluster, "metaroce", OPTIONAL_ON)
    namespaces = [d for d in docs if d["kind"] == "Namespace"]
    assert [n["metadata"]["name"] for n in namespaces] == ["metaroce-system"]
    assert namespaces[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for doc in docs:
        ns = doc["metadata"].get("namespace")
        assert ns in (None, "metaroce-system"), f"{doc['kind']} {doc['metadata']['name']} in {ns}"


KEEP = {"helm.sh/resource-policy": "keep"}


def _crds(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}


def test_the_chart_renders_exactly_the_generated_crds(cluster: LocalCluster) -> None:
    """The chart's CRDs are the models' (files/crds/ read as data, not templated): nothing
    but the chart's labels and the keep policy is added on the way through the template."""
    rendered = _crds(chart.render(cluster, "metaroce", {}))
    generated = {
        doc["metadata"]["name"]: doc for doc in map(yaml.safe_load, crdgen.generate().values())
    }
    assert rendered.keys() == generated.keys() == {c.NETWORK_CRD_NAME, c.NODESTATE_CRD_NAME}
    for name, crd in rendered.items():
        meta = crd["metadata"]
        assert meta.pop("annotations") == KEEP
        labels = meta.pop("labels")
        assert generated[name]["metadata"].pop("labels").items() <= labels.items()
        assert labels["app.kubernetes.io/instance"] == "metaroce"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert crd == generated[name], name


@pytest.mark.parametrize(
    ("crds", "names", "annotations"),
    [
        ({"install": False}, set(), None),
        ({"install": False, "keep": False}, set(), None),
        ({"keep": False}, {c.NETWORK_CRD_NAME, c.NODESTATE_CRD_NAME}, {}),
    ],
    ids=["install-false", "install-false-keep-false", "keep-false"],
)
def test_the_crd_values(
    cluster: LocalCluster, crds: dict[str, bool], names: set[str], annotations: Any
) -> None:
    docs = chart.render(cluster, "metaroce", {"crds": crds})
    rendered = _crds(docs)
    assert set(rendered) == names
    for crd in rendered.values():
        assert crd["metadata"].get("annotations", {}) == annotations
    chart.find(docs, "Deployment")  # the rest of the chart does not depend on them


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"operator": {"replicas": "two"}}, ["/operator/replicas", "want integer"]),
        ({"operator": {"replica": 2}}, ["/operator", "'replica' not allowed"]),
        (
            {"webhook": {"failurePolicy": "Sometimes"}},
            ["/webhook/failurePolicy", "'Fail', 'Ignore'"],
        ),
        ({"operator": {"image": {"tag": "latest"}}}, ["/operator/image/tag"]),
        ({"nameSpace": {"name": "x"}}, ["'nameSpace' not allowed"]),
    ],
    ids=["wrong-type", "unknown-key", "bad-enum", "latest-tag", "unknown-top-level"],
)
def test_bad_values_are_refused_naming_the_key(
    cluster: LocalCluster, tmp_path: Path, values: dict[str, Any], words: list[str]
) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    proc = cluster.helm(
        "install", "refused", str(chart.CHART_DIR), "-f", str(values_file), "--dry-run=server",
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def _declared_metrics() -> set[str]:
    names: set[str] = set()
    for path in (
        REPO / "operator/metaroce_operator/metrics.py",
        REPO / "node-agent/metaroce_agent/exporter.py",
    ):
        names |= set(re.findall(r'"(metaroce_[a-z_]+)"', path.read_text()))
    return names


def test_alerts_and_dashboard_use_real_metric_names(cluster: LocalCluster) -> None:
    docs = chart.render(cluster, "metaroce", OPTIONAL_ON)
    rules = chart.find(docs, "PrometheusRule")["spec"]["groups"][0]["rules"]
    alerts = {r["alert"] for r in rules}
    assert {
        "MetaRoceNetworkDegraded",
        "MetaRoceNodeQoSDrift",
        "MetaRoceRdmaProbeLoss",
        "MetaRoceDevicePluginNotRegistered",
        "MetaRoceTransportRetransmits",
    } <= alerts
    dashboard = chart.find(docs, "ConfigMap")["data"]["metaroce-fabric.json"]
    json.loads(dashboard)
    exprs = " ".join(r["expr"] for r in rules) + dashboard
    declared = _declared_metrics()
    used = set(re.findall(r"metaroce_[a-z_]+", exprs))
    # RDMA counters are named after the sysfs files (exporter.py metric_name); the rest
    # must be declared (a counter is exposed with `_total`).
    unknown = {
        m
        for m in used
        if not m.startswith(("metaroce_rdma_port_", "metaroce_rdma_hw_"))
        and m not in declared
        and m.removesuffix("_total") not in declared
    }
    assert not unknown, f"metrics used by the chart but never exported: {unknown}"
    monitor = chart.find(docs, "ServiceMonitor")
    metrics_svc = chart.find(docs, "Service", "metaroce-metrics")
    assert monitor["spec"]["endpoints"][0]["port"] == metrics_svc["spec"]["ports"][0]["name"]


# --------------------------------------------------------------------------- server-side dry run

# The Prometheus Operator's and cert-manager's CRDs cannot be downloaded here: minimal
# stand-ins make their kinds known, so the dry run checks that the objects are
# well-formed Kubernetes objects in existing namespaces; their content is checked above.
STAND_INS = [
    ("monitoring.coreos.com", "ServiceMonitor", "servicemonitors"),
    ("monitoring.coreos.com", "PodMonitor", "podmonitors"),
    ("monitoring.coreos.com", "PrometheusRule", "prometheusrules"),
    ("cert-manager.io", "Issuer", "issuers"),
    ("cert-manager.io", "Certificate", "certificates"),
]


def stand_in_crd(group: str, kind: str, plural: str) -> dict[str, Any]:
    schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def stand_ins(cluster: LocalCluster) -> Iterator[None]:
    # Module-scoped: a CRD deleted and re-made at once would still be terminating.
    crds = [stand_in_crd(*s) for s in STAND_INS]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(crds))
    names = [f"crd/{d['metadata']['name']}" for d in crds]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)
    try:
        yield
    finally:
        cluster.kubectl("delete", *names, "--wait=false", check=False)


@pytest.mark.parametrize(
    "values", [OPTIONAL_ON, {"webhook": {"certManager": {"enabled": True}}}], ids=["all", "cm"]
)
def test_rendered_objects_pass_server_side_dry_run(
    cluster: LocalCluster, namespace: str, stand_ins: None, values: dict[str, Any]
) -> None:
    # The chart's namespace must exist for a dry run of what goes in it: use the test's.
    merged = {**values, "namespace": {"name": namespace, "create": False}}
    docs = chart.render(cluster, f"dry-{namespace}", merged)
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-o", "name", "-f", "-", input=yaml.safe_dump_all(docs)
    )
    assert len(proc.stdout.split()) == len(docs), proc.stdout


# --------------------------------------------------------------------------- installed


class Release:
    def __init__(self, cluster: LocalCluster, tmp: Path) -> None:
        tag = secrets.token_hex(3)
        self.cluster = cluster
        self.tmp = tmp
        self.name = f"metaroce-{tag}"
        self.namespace = f"mr-{tag}"
        self.fullname = self.name
        self.operator: OperatorProcess | None = None
        self.webhook_port = free_port()

    def helm(
        self, verb: str, values: dict[str, Any], *extra: str, chart_dir: Path = chart.CHART_DIR
    ) -> str:
        # The operator runs on the host (start_operator): its pods must not be "Ready".
        base = {"namespace": {"name": self.namespace}, **chart.HOST_OPERATOR_VALUES}
        merged = {**base, **values}
        merged["operator"] = {**base["operator"], **values.get("operator", {})}
        return self.cluster.helm(
            verb, self.name, str(chart_dir), "-n", "default", "--wait=false",
            *chart.set_flags(merged), *extra,
        ).stdout  # fmt: skip

    def sa(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.fullname}"

    def can(self, who: str, *args: str) -> bool:
        proc = self.cluster.kubectl("auth", "can-i", f"--as={who}", *args, check=False)
        return proc.stdout.strip() == "yes"

    def start_operator(self) -> OperatorProcess:
        """The real operator, as the chart's pod: its arguments (free ports on this
        host), its ServiceAccount's token, in the pod network behind the chart's Service."""
        assert self.cluster.pod_network is not None
        docs = chart.render(self.cluster, self.name, {"namespace": {"name": self.namespace}})
        args = chart.operator_args(docs)
        args = chart.replace_arg(args, "--webhook-port", str(self.webhook_port))
        args = chart.replace_arg(args, "--metrics-port", str(free_port()))
        args = chart.replace_arg(args, "--health-port", str(free_port()))
        kubeconfig = chart.token_kubeconfig(
            self.cluster, self.namespace, self.fullname, self.tmp / "operator.kubeconfig",
            server=f"https://{self.cluster.pod_network.host_ip}:{self.cluster.api_port}",
        )  # fmt: skip
        chart.route_service_to_pod_network(
            self.cluster, self.namespace, f"{self.fullname}-webhook", "https", self.webhook_port
        )
        self.operator = OperatorProcess(
            args,
            kubeconfig=kubeconfig,
            log_path=self.tmp / "operator.log",
            identity=f"{self.fullname}-0",
            netns=self.cluster.pod_network.netns,
            host=self.cluster.pod_network.pod_ip,
            env={"POD_NAMESPACE": self.namespace},
        ).start()
        return self.operator

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()


@pytest.fixture(scope="module")
def release(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    rel = Release(cluster, tmp_path_factory.mktemp("chart"))
    # The session's CRDs may exist already, applied with kubectl by earlier modules (as an
    # earlier chart's crds/ folder would have left them): adopt them, as the README says.
    out = rel.helm("install", {}, "--take-ownership")
    assert "`helm upgrade` upgrades them too" in out  # NOTES: the next commands
    try:
        yield rel
    finally:
        rel.stop()
        cluster.kubectl("delete", c.NETWORK_PLURAL, "dev-softroce", "--wait=false", check=False)
        cluster.helm("uninstall", rel.name, "-n", "default", check=False)
        cluster.kubectl("delete", "namespace", rel.namespace, "--wait=false", check=False)


def test_install_makes_crds_webhooks_and_rbac(cluster: LocalCluster, release: Release) -> None:
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        f"crd/{c.NETWORK_CRD_NAME}", f"crd/{c.NODESTATE_CRD_NAME}",
    )  # fmt: skip
    for name in (c.NETWORK_CRD_NAME, c.NODESTATE_CRD_NAME):
        meta = get_json(cluster, "crd", name)["metadata"]
        assert meta["annotations"]["meta.helm.sh/release-name"] == release.name
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
    # The cluster serves MutatingAdmissionPolicy: helm install picked the policy mode, so
    # the pods' refusals are the chart's ValidatingAdmissionPolicy and no pod webhook is
    # configured (never both).
    cluster.kubectl("get", "validatingadmissionpolicy", f"{release.fullname}-pods")
    cluster.kubectl("get", "validatingadmissionpolicybinding", f"{release.fullname}-pods")
    proc = cluster.kubectl(
        "get", "mutatingwebhookconfiguration", f"{release.fullname}-pods", check=False
    )
    assert proc.returncode != 0 and "NotFound" in proc.stderr
    cluster.kubectl("get", "validatingwebhookconfiguration", f"{release.fullname}-networks")
    ns = json.loads(cluster.kubectl("get", "namespace", release.namespace, "-o", "json").stdout)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    sa, own = release.sa(), release.namespace
    assert release.can(sa, "watch", "metarocenetworks.metaroce.io")
    assert release.can(sa, "patch", "metarocenetworks.metaroce.io", "--subresource=status")
    assert release.can(sa, "patch", "nodes")
    assert release.can(sa, "create", "daemonsets.apps", "-n", own)
    assert release.can(sa, "update", "leases.coordination.k8s.io/metaroce-operator", "-n", own)
    assert release.can(sa, "get", f"secrets/{release.fullname}-webhook-tls", "-n", own)
    assert release.can(sa, "create", "mutatingadmissionpolicies.admissionregistration.k8s.io")
    assert release.can(sa, "patch", "mutatingadmissionpolicybindings.admissionregistration.k8s.io")
    assert not release.can(sa, "create", "validatingadmissionpolicies.admissionregistration.k8s.io")
    # Least privilege: nothing outside what the code calls.
    assert not release.can(sa, "get", "secrets", "-n", "default")
    assert not release.can(sa, "get", "secrets", "-n", "kube-system")
    assert not release.can(sa, "list", "secrets", "-n", own)
    assert not release.can(sa, "get", "secrets/other", "-n", own)
    assert not release.can(sa, "create", "daemonsets.apps", "-n", "default")
    assert not release.can(sa, "list", "pods", "-A")
    # The upgrade policy (#17) replaces outdated agent pods, in the agents' namespace only.
    assert release.can(sa, "delete", "pods", "-n", own)
    assert release.can(sa, "list", "controllerrevisions.apps", "-n", own)
    assert not release.can(sa, "delete", "pods", "-n", "default")
    assert not release.can(sa, "patch", "mutatingwebhookconfigurations/someone-elses")
    assert not release.can(sa, "escalate", "clusterroles")
    assert not release.can(sa, "bind", "clusterroles")


def test_metaroce_version_finds_the_release_s_operator(
    cluster: LocalCluster, release: Release
) -> None:
    """Issue 17: `metaroce version` as a user runs it, against the apiserver: the CLI's own
    version and the installed operator Deployment's namespace, name, image and version."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    done = subprocess.run(
        [sys.executable, "-m", "metaroce_cli.main", "version"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("metaroce 0."), lines
    image = f"ghcr.io/metaroce/metaroce-operator:{VERSION}"
    mine = f"operator: {release.namespace}/{release.fullname} image {image} (app version {VERSION})"
    assert mine in lines, lines


def test_operator_with_chart_credentials_reconciles_the_sample(
    cluster: LocalCluster, release: Release
) -> None:
    cluster.kubectl("label", "node", "kwok-a1", "kwok-a2", "metaroce.io/rdma=true", "--overwrite")
    try:
        op = release.start_operator()

        # The leader issues the webhook certificate and writes the caBundles.
        def ca_bundles() -> bool:
            # (policy mode: the pod webhook has no configuration, only the networks')
            for kind, name in (("validatingwebhookconfiguration", "networks"),):
                obj = json.loads(cluster.kubectl(
                    "get", kind, f"{release.fullname}-{name}", "-o", "json").stdout)  # fmt: skip
                if not all(w["clientConfig"].get("caBundle") for w in obj["webhooks"]):
                    return False
            return True

        wait_for(
            f"the caBundles ({op.log_path})", lambda: not op.alive() or ca_bundles(), timeout=90
        )
        assert op.alive(), op.log()[-3000:]
        # Through the validating webhook (failurePolicy Fail) into the operator.
        cluster.kubectl("apply", "-f", str(SAMPLE))
        ns = release.namespace
        name = "dev-softroce"
        wait_for("the DaemonSet", lambda: cluster.kubectl(
            "get", "daemonset", child_name(name), "-n", ns, check=False).returncode == 0,
            timeout=90)  # fmt: skip
        cm = json.loads(
            cluster.kubectl("get", "configmap", child_name(name), "-n", ns, "-o", "json").stdout
        )
        assert c.AGENT_CONFIG_KEY in cm["data"]
        _assert_probe_key(cluster, ns, name, op.log())

        def status() -> dict[str, Any] | None:
            net = json.loads(cluster.kubectl("get", c.NETWORK_PLURAL, name, "-o", "json").stdout)
            st = net.get("status") or {}
            return st if st.get("conditions") and st.get("observedGeneration") == 1 else None

        st = wait_for("the network's status", status, timeout=90)
        assert {cond["type"] for cond in st["conditions"]} >= {"Ready", c.CONDITION_DEGRADED}
        # Policy mode: the operator rendered the network's pod admission policy.
        for kind in ("mutatingadmissionpolicy", "mutatingadmissionpolicybinding"):
            policy = json.loads(
                cluster.kubectl("get", kind, f"metaroce-pods-{name}", "-o", "json").stdout
            )
            assert policy["metadata"]["ownerReferences"][0]["name"] == name
        # The agents' RBAC as rendered by the operator: no Pods, no Secrets.
        agent = f"system:serviceaccount:{ns}:{child_name(name)}"
        assert release.can(agent, "create", "metarocenodestates.metaroce.io")
        assert release.can(agent, "get", f"metarocenetworks.metaroce.io/{name}")
        for verb, what in (("get", "pods"), ("create", "pods"), ("delete", "pods"),
                           ("get", "secrets"), ("list", "secrets")):  # fmt: skip
            assert not release.can(agent, verb, what, "-A"), f"the agent may {verb} {what}"
        # Every call the operator made was allowed by the chart's RBAC.
        log = op.log()
        assert " 403" not in log and "Forbidden" not in log and "forbidden" not in log, log[-4000:]
    finally:
        cluster.kubectl("label", "node", "kwok-a1", "kwok-a2", "metaroce.io/rdma-", check=False)


def _assert_probe_key(cluster: LocalCluster, ns: str, network: str, log: str) -> None:
    """Issue 15 finding 7, the operator side: the network's probe-key Secret exists with
    a random key, is owned like the DaemonSet (this cleanupOnDelete network's children by
    their anchor, see render/common.py), is mounted where the agent reads its key, and
    the key is in no log."""
    from metaroce_agent.probe_auth import DEFAULT_KEY_FILE

    name = child_name(network)
    secret = json.loads(cluster.kubectl("get", "secret", name, "-n", ns, "-o", "json").stdout)
    ds = json.loads(cluster.kubectl("get", "daemonset", name, "-n", ns, "-o", "json").stdout)
    assert secret["type"] == "metaroce.io/probe-key"
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) >= 32 and base64.b64decode(secret["data"]["previous"]).decode() == key
    owners = secret["metadata"].get("ownerReferences") or []
    assert owners and owners == ds["metadata"]["ownerReferences"], owners
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {
        f"{m['mountPath']}/{item['path']}": item["key"]
        for m in agent["volumeMounts"]
        for source in (volumes[m["name"]].get("projected") or {}).get("sources", [])
        if (source.get("secret") or {}).get("name") == name
        for item in source["secret"]["items"]
    }
    assert mounted.get(str(DEFAULT_KEY_FILE)) == "key", mounted
    assert key not in log and secret["data"]["key"] not in log


def _with_column(crd_text: str, column: str) -> str:
    crd = yaml.safe_load(crd_text)
    cols = crd["spec"]["versions"][0].setdefault("additionalPrinterColumns", [])
    cols.append({"name": column, "type": "string", "jsonPath": ".spec.node"})
    return yaml.safe_dump(crd)


def _columns(cluster: LocalCluster, crd: str) -> list[str]:
    live = get_json(cluster, "crd", crd)
    return [col["name"] for col in live["spec"]["versions"][0]["additionalPrinterColumns"]]


def test_helm_upgrade_upgrades_the_crds_and_keeps_them_when_switched_off(
    cluster: LocalCluster, release: Release, tmp_path: Path
) -> None:
    """The two documented upgrade paths: with crds.install (the default) `helm upgrade`
    brings a changed CRD itself; an upgrade to crds.install=false leaves the CRDs (keep),
    and then `kubectl apply --server-side -f crds/` before `helm upgrade` brings them."""
    # A chart whose CRD changed (a new printer column), as the next version would be.
    next_chart = tmp_path / "metaroce"
    shutil.copytree(chart.CHART_DIR, next_chart)
    name = crdgen.filename(crdgen.nodestate_crd())
    copy = next_chart / crdgen.CHART_CRD_DIR.relative_to("charts/metaroce") / name
    copy.write_text(_with_column(copy.read_text(), "Upgraded"))
    uid = get_json(cluster, "crd", c.NODESTATE_CRD_NAME)["metadata"]["uid"]
    networks = cluster.kubectl("get", c.NETWORK_PLURAL, "-o", "name").stdout.split()
    try:
        release.helm(
            "upgrade", {"webhook": {"timeoutSeconds": 7}, "operator": {"logLevel": "debug"}},
            chart_dir=next_chart,
        )  # fmt: skip
        assert "Upgraded" in _columns(cluster, c.NODESTATE_CRD_NAME)
        hook = get_json(cluster, "validatingwebhookconfiguration", f"{release.fullname}-networks")
        assert hook["webhooks"][0]["timeoutSeconds"] == 7
        # The caBundle the leader wrote survives the upgrade (the chart never sets it, so
        # Helm's three-way merge leaves it alone).
        assert hook["webhooks"][0]["clientConfig"].get("caBundle")
        deploy = get_json(cluster, "deployment", release.fullname, "-n", release.namespace)
        assert "--log-level=debug" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]

        # Switched off: Helm drops the CRDs from the release but keeps them, and with
        # them every network (the sample the operator reconciled above).
        release.helm("upgrade", {"crds": {"install": False}})
        assert get_json(cluster, "crd", c.NODESTATE_CRD_NAME)["metadata"]["uid"] == uid
        assert cluster.kubectl("get", c.NETWORK_PLURAL, "-o", "name").stdout.split() == networks
        # ... and the kubectl path brings the next change (Helm's field manager still
        # holds the fields it wrote: a takeover, as with any second manager).
        changed = tmp_path / "crds"
        changed.mkdir()
        (changed / name).write_text(
            _with_column((chart.CRD_DIR / name).read_text(), "AppliedByKubectl")
        )
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(changed))
        release.helm("upgrade", {"crds": {"install": False}})
        assert "AppliedByKubectl" in _columns(cluster, c.NODESTATE_CRD_NAME)
    finally:
        # Back to the chart's own CRDs, owned by the release (its annotations are still
        # on them, so no takeover is needed).
        release.helm("upgrade", {})
    assert "Upgraded" not in _columns(cluster, c.NODESTATE_CRD_NAME)
    assert get_json(cluster, "crd", c.NODESTATE_CRD_NAME)["metadata"]["uid"] == uid


KEPT_CRDS = (c.NETWORK_CRD_NAME, c.NODESTATE_CRD_NAME)


def test_uninstall_leaves_only_the_crds(cluster: LocalCluster, release: Release) -> None:
    release.stop()
    # The sample has cleanupOnDelete, and no agent runs here to revert the nodes: drop
    # the finalizer as an admin would, then delete it.
    name = "dev-softroce"
    cluster.kubectl("patch", c.NETWORK_PLURAL, name, "--type=merge", "-p",
                    '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip
    cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--ignore-not-found", "--timeout=60s")
    uids = {crd: get_json(cluster, "crd", crd)["metadata"]["uid"] for crd in KEPT_CRDS}
    out = cluster.helm("uninstall", release.name, "-n", "default", "--wait", "--timeout=120s")
    assert "kept due to the resource policy" in out.stdout, out.stdout
    kinds = (
        "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,"
        "validatingwebhookconfigurations"
    )

    def leftovers() -> list[str]:
        # The chart's own objects carry the release as their instance; the per-network
        # children the operator made carry the network there, so they are found by
        # their manager (selecting by the release alone could never find them).
        found: list[str] = []
        for label in (
            f"app.kubernetes.io/instance={release.name}",
            f"{c.MANAGED_BY_LABEL}={c.MANAGED_BY},{c.NETWORK_LABEL}={name}",
        ):
            out = cluster.kubectl("get", kinds, "-l", label, "-o", "name").stdout.split()
            found += out
        return found

    # The agents' namespace goes with the release, and with it (garbage collection)
    # what the network's agents had outside it.
    wait_for("nothing but the CRDs to be left", lambda: not leftovers(), timeout=120)
    phase = cluster.kubectl(
        "get", "namespace", release.namespace, "-o", "jsonpath={.status.phase}", check=False
    )
    assert phase.returncode != 0 or phase.stdout == "Terminating"
    # The documented leftovers: the release's CRDs, the same objects (keep), not re-made.
    assert {crd: get_json(cluster, "crd", crd)["metadata"]["uid"] for crd in KEPT_CRDS} == uids
