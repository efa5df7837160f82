"""Chart hardening of the issue-16 review (#14-#16), rendered with helm and checked by
the real apiserver (server-side dry run: no tier here enforces NetworkPolicy, so the
policy is checked for what it says and that the apiserver accepts it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
