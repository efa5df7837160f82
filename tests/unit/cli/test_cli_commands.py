"""The user-facing CLI (issue 17): `metaroce version` (offline-safe), `metaroce dev`
alone, and `metaroce inject --dry-run`, which must print exactly the webhook's patch."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_cli import inject
from metaroce_cli.main import main as metaroce
from metaroce_cli.version import operator_versions, package_version
from metaroce_operator.webhooks.mutate import Namespace, mutate_pod

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "samples" / "softroce-dev.yaml"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No kubeconfig anywhere and not in a pod."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def pod(**annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "jobs", "annotations": annotations},
        "spec": {"containers": [{"name": "nccl", "image": "example.com/nccl:1"}]},
    }


# --- dispatch ------------------------------------------------------------------------------


def test_dev_alone_lists_its_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert metaroce(["dev"]) == 0
    out = capsys.readouterr().out
    assert "usage: metaroce dev COMMAND" in out and "cluster" in out and "guests" in out
    assert metaroce(["dev", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'dev bogus'" in err and "guests" in err


def test_usage_puts_developer_commands_under_their_own_heading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert metaroce([]) == 0
    out = capsys.readouterr().out
    user, dev = out.split("developer commands")
    assert "version" in user and "inject" in user and "crds" not in user
    assert "crds" in dev and "dev cluster" in dev


# --- version -------------------------------------------------------------------------------


def test_version_offline_says_why_it_did_not_ask(
    offline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert metaroce(["version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"metaroce {package_version()}" and out[0].startswith("metaroce 0.")
    assert out[1].startswith("operator: not checked (no kubeconfig")
    assert metaroce(["version", "--offline"]) == 0
    assert capsys.readouterr().out.splitlines() == out[:1]


def test_version_with_an_unreachable_cluster_still_succeeds(
    offline: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "current-context": "x",
            }
        )
    )
    assert metaroce(["version", "--kubeconfig", str(cfg)]) == 0
    assert "operator: cluster not reachable" in capsys.readouterr().out
    (tmp_path / "broken").write_text("clusters: 3\n")
    assert metaroce(["version", "--kubeconfig", str(tmp_path / "broken")]) == 0
    assert "operator: not checked (cannot use the kubeconfig" in capsys.readouterr().out


def test_operator_versions_reads_the_deployments() -> None:
    listed = {
        "items": [
            {
                "metadata": {
                    "namespace": "rdma",
                    "name": "metaroce-operator",
                    "labels": {"app.kubernetes.io/version": "0.1.0"},
                },
                "spec": {"template": {"spec": {"containers": [{"image": "r.io/op:0.1.0"}]}}},
            }
        ]
    }
    assert operator_versions(listed) == [
        "operator: rdma/metaroce-operator image r.io/op:0.1.0 (app version 0.1.0)"
    ]
    assert operator_versions({"items": []}) == []


# --- inject --------------------------------------------------------------------------------


def test_dry_run_output_is_exactly_the_webhooks_patch() -> None:
    views = inject.views_from_documents(list(yaml.safe_load_all(SAMPLE.read_text())))
    p = inject.with_networks(pod(), ["dev-softroce"])
    rc, out, notes = inject.dry_run(p, views, Namespace("jobs", None))
    webhook = mutate_pod(p, views, Namespace("jobs", None))
    assert rc == 0 and notes == []
    assert json.loads(out) == webhook.patch  # type: ignore[union-attr]
    paths = {op["path"] for op in json.loads(out)}
    assert "/spec/containers/0/resources" in paths


def test_inject_command_offline_with_a_networks_file(
    offline: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod()))
    argv = ["inject", "--dry-run", "-f", str(f), "--networks-file", str(SAMPLE)]
    assert metaroce([*argv, "--network", "dev-softroce"]) == 0
    captured = capsys.readouterr()
    patch = json.loads(captured.out)
    assert any(op["path"].endswith("metaroce.io~1injected") for op in patch)
    assert "labels unknown offline" in captured.err

    # no annotation and no --network: the webhook changes nothing, and says why
    assert metaroce(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == [] and "has no metaroce.io/networks" in captured.err

    # a network that does not exist: the webhook's refusal, exit 1
    assert metaroce([*argv, "--network", "nope"]) == 1
    assert "would refuse the pod: " in capsys.readouterr().err


def test_inject_input_errors_name_the_fix(
    offline: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod()))
    assert metaroce(["inject", "-f", str(f)]) == 2
    assert "Add --dry-run" in capsys.readouterr().err
    assert metaroce(["inject", "--dry-run", "-f", str(f)]) == 2
    assert "pass --networks-file" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("kind: Deployment\n"))
    assert metaroce(["inject", "--dry-run", "-f", "-", "--networks-file", str(SAMPLE)]) == 2
    assert "kind is 'Deployment', not 'Pod'" in capsys.readouterr().err
    assert metaroce(["inject", "--dry-run", "-f", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


# --- the README's training job ---------------------------------------------------------------


def _readme_training_pod() -> dict[str, Any]:
    """The Worker pod template of the README's PyTorchJob (step 4), as a Pod."""
    text = (REPO / "README.md").read_text()
    block = text.split("### 4. A training job", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    job = yaml.safe_load(block)
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    meta = {"name": "allreduce-worker-0", **template["metadata"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


@pytest.mark.parametrize("nics", [8, None], ids=["asks-for-8", "one-by-default"])
def test_the_readme_training_job_gets_what_the_readme_says(nics: int | None) -> None:
    """Issue 17: the README's PyTorchJob (not run: no GPUs here) through the admission's
    mutation with the README's own network (samples/rocev2-lossless-mellanox.yaml):
    the NICs it asks for are kept, one unit when it asks for none, IPC_LOCK, and exactly
    the NCCL variables the README says the admission sets (the device plugin sets the rest)."""
    import jsonpatch  # type: ignore[import-untyped]

    from metaroce_agent.deviceplugin.devices import DEVICE_ENV

    pod_in = _readme_training_pod()
    (container,) = pod_in["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert limits["metaroce.io/backend"] == 8 and pod_in["metadata"]["annotations"] == {
        "metaroce.io/networks": "backend"
    }
    if nics is None:
        del limits["metaroce.io/backend"]
    network = REPO / "samples" / "rocev2-lossless-mellanox.yaml"
    views = inject.views_from_documents(list(yaml.safe_load_all(network.read_text())))
    rc, out, notes = inject.dry_run(pod_in, views, Namespace("jobs", None))
    assert rc == 0 and notes == [], notes
    (got,) = jsonpatch.apply_patch(pod_in, json.loads(out))["spec"]["containers"]
    assert got["resources"]["limits"]["metaroce.io/backend"] == (nics or "1")
    assert got["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "IPC_LOCK" in got["securityContext"]["capabilities"]["add"]
    env = [e["name"] for e in got["env"]]
    readme = " ".join((REPO / "README.md").read_text().split())
    said = (
        "and `NCCL_IB_TC`, `NCCL_IB_QPS_PER_CONNECTION`, `NCCL_IB_TIMEOUT` and `NCCL_IB_RETRY_CNT`"
    )
    assert said in readme
    assert env == [
        "NCCL_IB_TC",
        "NCCL_IB_QPS_PER_CONNECTION",
        "NCCL_IB_TIMEOUT",
        "NCCL_IB_RETRY_CNT",
    ]
    assert sorted(DEVICE_ENV) == ["NCCL_IB_GID_INDEX", "NCCL_IB_HCA"]
    assert "the agent's device plugin sets them when the containers start" in readme


def test_inject_names_the_attachment_in_the_agents_namespace_it_is_given(
    offline: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A release outside metaroce-system: the dry run's Multus entry names the NAD where
    the operator renders it (`--agents-namespace`, the webhook's own setting)."""
    net = {
        "apiVersion": "metaroce.io/v1alpha1",
        "kind": "MetaRoceNetwork",
        "metadata": {"name": "mr"},
        "spec": {
            "nics": {"interfaceNames": ["eth1"]},
            "transport": {"mode": "metaroce"},
            "qos": {"profile": "lossy"},
            "attachment": {"podNetwork": {"subnet": "10.56.0.0/16"}},
        },
    }
    nets = tmp_path / "net.yaml"
    nets.write_text(yaml.safe_dump(net))
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod()))
    argv = ["inject", "--dry-run", "-f", str(f), "--networks-file", str(nets), "--network", "mr"]
    for extra, ref in (
        ([], "metaroce-system/metaroce-mr@mr0"),
        (["--agents-namespace", "rdma"], "rdma/metaroce-mr@mr0"),
    ):
        assert metaroce([*argv, *extra]) == 0
        out = capsys.readouterr().out
        assert ref in out, out
