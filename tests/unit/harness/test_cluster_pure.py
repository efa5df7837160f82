"""Pure parts of the cluster harness: node manifests, kubeconfigs, the CLI."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from metaroce_harness.cluster import FakeNode, kubeconfig_yaml, main
from metaroce_harness.pki import CertificateAuthority


def test_fake_node_sets_extended_resources_in_capacity_and_allocatable() -> None:
    taint = {"key": "k", "value": "v", "effect": "NoSchedule"}
    node = FakeNode(
        "n1", labels={"pool": "a"}, capacity={"metaroce.io/backend": "8"}, taints=[taint]
    )
    doc = node.manifest()
    assert doc["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert doc["metadata"]["labels"]["pool"] == "a"
    assert doc["metadata"]["labels"]["kubernetes.io/hostname"] == "n1"
    assert doc["status"]["capacity"]["metaroce.io/backend"] == "8"
    assert doc["status"]["allocatable"] == doc["status"]["capacity"]
    assert doc["spec"]["taints"] == [taint]


def test_kubeconfig_embeds_credentials(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    admin = ca.issue("admin", "admin", client=True)
    doc = yaml.safe_load(kubeconfig_yaml("https://10.0.2.2:6443", ca.pair, admin))
    cluster = doc["clusters"][0]["cluster"]
    assert cluster["server"] == "https://10.0.2.2:6443"
    assert base64.b64decode(cluster["certificate-authority-data"]) == ca.pair.cert_pem()
    assert base64.b64decode(doc["users"][0]["user"]["client-key-data"]) == admin.key_pem()


def test_cli_rejects_a_negative_node_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--nodes", "-1"])
    assert "--nodes: -1 is negative" in capsys.readouterr().err
