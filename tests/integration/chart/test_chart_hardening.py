"""Chart hardening of the issue-16 review (#14-#16), rendered with helm and checked by
the real apiserver (server-side dry run: no tier here enforces NetworkPolicy, so the
policy is checked for what it says and that the apiserver accepts it)."""

from __future__ import annotations

import base64
import json
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_harness import chart
from metaroce_harness.cluster import LocalCluster

APISERVER = ["10.0.0.10/32", "fd00::10/128"]


def _dry_run(cluster: LocalCluster, docs: list[dict[str, Any]]) -> list[str]:
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-o", "name", "-f", "-", input=yaml.safe_dump_all(docs)
    )
    return proc.stdout.split()


def test_network_policy_admits_only_the_apiserver_to_the_webhook_issue_16_14(
    cluster: LocalCluster, namespace: str
) -> None:
    values = {
        "namespace": {"name": namespace, "create": False},
        "networkPolicy": {
            "enabled": True,
            "apiserverCIDRs": APISERVER,
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
        },
    }
    docs = chart.render(cluster, "np", values)
    policy = chart.find(docs, "NetworkPolicy")
    deployment = chart.find(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert by_port["webhook"]["from"] == [{"ipBlock": {"cidr": cidr}} for cidr in APISERVER]
    assert "from" not in by_port["health"]  # the kubelet's probes
    assert by_port["metrics"]["from"] == values["networkPolicy"]["metricsFrom"]
    container_ports = {
        p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert set(by_port) <= container_ports  # named ports resolve
    assert f"networkpolicy.networking.k8s.io/{policy['metadata']['name']}" in _dry_run(
        cluster, [policy]
    )
    # Off by default.
    assert not [d for d in chart.render(cluster, "np", {}) if d["kind"] == "NetworkPolicy"]


def test_network_policy_needs_the_apiserver_addresses_issue_16_14(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump({"networkPolicy": {"enabled": True}}))
    proc = cluster.helm(
        "template", "np", str(chart.CHART_DIR), "-f", str(values_file),
        f"--kube-version={chart.kube_version(cluster)}", check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "networkPolicy.apiserverCIDRs is empty" in proc.stderr, proc.stderr


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_disruption_budget_never_blocks_a_drain_issue_16_16(
    cluster: LocalCluster, replicas: int
) -> None:
    """`minAvailable: 1` with one replica forbids every eviction; one at a time at most."""
    docs = chart.render(cluster, "pdb", {"operator": {"replicas": replicas}})
    spec = chart.find(docs, "PodDisruptionBudget")["spec"]
    assert "minAvailable" not in spec
    assert spec["maxUnavailable"] == 1


def test_the_ca_bundle_is_never_rendered_issue_16_16(cluster: LocalCluster, namespace: str) -> None:
    """The leader (or cert-manager) owns caBundle: a rendered one (looked up from the live
    object) is empty under `helm template` and fights Argo CD's self-heal."""
    release = f"metaroce-ca-{secrets.token_hex(3)}"
    live = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": f"{release}-pods"},
        "webhooks": [
            {
                "name": "pods.metaroce.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "objectSelector": {"matchLabels": {"never": secrets.token_hex(4)}},
                "clientConfig": {
                    "service": {"namespace": namespace, "name": "none", "path": "/x"},
                    "caBundle": base64.b64encode(b"not a CA").decode(),
                },
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ],
            }
        ],
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(live))
    try:
        values = {"namespace": {"name": namespace, "create": False}}
        docs = chart.render(cluster, release, values, "--dry-run=server")
        hooks = [
            hook
            for d in docs
            if d["kind"].endswith("WebhookConfiguration")
            for hook in d.get("webhooks") or []
        ]
        assert hooks
        assert not [h["name"] for h in hooks if "caBundle" in h["clientConfig"]]
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", f"{release}-pods", check=False)


def test_agents_get_the_chart_s_image_pull_secrets_issue_16_15(cluster: LocalCluster) -> None:
    docs = chart.render(cluster, "pull", {"imagePullSecrets": [{"name": "regcred"}]})
    assert "--agent-image-pull-secret=regcred" in chart.operator_args(docs)
    pod = chart.find(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
