"""`metaroce render` and the operator's flags: good input works, bad input names the fix."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from metaroce_cli.main import main as metaroce
from metaroce_operator.cli import chart_arguments, render_main, settings_from_args
from metaroce_operator.settings import (
    DEFAULT_AGENT_IMAGE,
    RenderSettings,
    SettingsError,
    WebhookSettings,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "networks"


def test_render_prints_the_children(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        metaroce(
            [
                "render",
                "-f",
                str(FIXTURES / "rocev2-lossless.yaml"),
                "--agent-image",
                "example.com/a:v9",
            ]
        )
        == 0
    )
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == [
        "ClusterRole",
        "ServiceAccount",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
    ]
    pod = docs[-1]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "example.com/a:v9"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    selected = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in selected


def test_render_json_and_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO((FIXTURES / "softroce-lossy.yaml").read_text()))
    out = io.StringIO()
    assert render_main(["-f", "-", "-o", "json", "--namespace", "rdma"], out=out) == 0
    items = json.loads(out.getvalue())["items"]
    assert {i["metadata"].get("namespace") for i in items} == {"rdma", None}


def test_render_rejects_invalid_networks_naming_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert render_main(["-f", str(FIXTURES / "invalid.yaml")]) == 1
    err = capsys.readouterr().err
    assert "spec.qos.pfcPriorities" in err and "spec.colour" in err


def test_render_rejects_other_kinds_and_missing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "cm.yaml"
    other.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert render_main(["-f", str(other)]) == 1
    assert "not a MetaRoceNetwork" in capsys.readouterr().err
    assert render_main(["-f", str(tmp_path / "nope.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert (
        render_main(["-f", str(FIXTURES / "softroce-lossy.yaml"), "--agent-image", "x:latest"]) == 1
    )
    assert "never latest" in capsys.readouterr().err


def test_operator_flags_and_chart_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "metaroce-operator-abc")
    monkeypatch.setenv("POD_NAMESPACE", "rdma-system")
    s = settings_from_args(chart_arguments("rdma-system", "example.com/agent:v1"))
    assert s.identity == "metaroce-operator-abc"
    assert s.render == RenderSettings(
        "rdma-system", "example.com/agent:v1", agent_cluster_role="metaroce-agent"
    )
    assert s.lease_namespace == "rdma-system"
    assert (s.metrics_port, s.health_port) == (8080, 8081)
    assert s.webhook == WebhookSettings(
        port=8443,
        cert_secret="rdma-system/metaroce-webhook-tls",
        service="metaroce-webhook",
        mutating_config="metaroce-pods",
        validating_config="metaroce-networks",
    )
    assert s.webhook.secret_ref == ("rdma-system", "metaroce-webhook-tls")
    s = settings_from_args(
        ["--lease-duration=30s", "--renew-deadline=20", "--status-interval=500ms"]
    )
    assert (s.lease_duration, s.renew_deadline, s.status_interval) == (30, 20, 0.5)
    assert s.render.namespace == "rdma-system"  # from POD_NAMESPACE
    assert not s.webhook.enabled  # the bare operator serves no webhooks


def test_chart_arguments_contract() -> None:
    """The chart's Deployment passes exactly these (charts/metaroce/templates/_helpers.tpl)."""
    assert chart_arguments(
        "ns", "example.com/a:v1", fullname="rel-metaroce", webhook_port=9443
    ) == [
        "--namespace=ns",
        "--agent-image=example.com/a:v1",
        "--agent-cluster-role=rel-metaroce-agent",
        "--metrics-port=8080",
        "--health-port=8081",
        "--log-level=info",
        "--webhook-port=9443",
        "--webhook-cert-secret=ns/rel-metaroce-webhook-tls",
        "--webhook-service=rel-metaroce-webhook",
        "--webhook-mutating-config=rel-metaroce-pods",
        "--webhook-validating-config=rel-metaroce-networks",
    ]
    args = chart_arguments("ns", "example.com/a:v1", cert_manager=True)
    assert args[-1] == "--webhook-cert-manager"
    s = settings_from_args(args)
    assert s.webhook.cert_manager and s.webhook.enabled
    # cert-manager owns the Secret and the caBundles: only the Secret name is needed.
    s = settings_from_args(
        ["--webhook-port=8443", "--webhook-cert-secret=ns/tls", "--webhook-cert-manager"]
    )
    assert s.webhook.service is None


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--namespace=Bad_NS"], "--namespace"),
        (["--agent-image=nope"], "--agent-image"),
        (["--renew-deadline=20s"], "--renew-deadline"),
        (["--retry-period=12s"], "--retry-period"),
        (["--status-interval=soon"], "--status-interval"),
        (["--metrics-port=8081"], "--health-port"),
        (["--kubeconfig=/nonexistent"], "--kubeconfig"),
        (
            [
                "--webhook-port=8081",
                "--webhook-cert-secret=ns/tls",
                "--webhook-cert-manager",
            ],
            "--webhook-port",
        ),
        (["--webhook-port=8443"], "--webhook-cert-secret"),
        (["--webhook-port=8443", "--webhook-cert-secret=no-slash"], "--webhook-cert-secret"),
        (["--webhook-port=8443", "--webhook-cert-secret=Bad_NS/x"], "--webhook-cert-secret"),
        (["--webhook-port=8443", "--webhook-cert-secret=ns/tls"], "--webhook-service"),
        (
            ["--webhook-port=8443", "--webhook-cert-secret=ns/tls", "--webhook-service=svc"],
            "--webhook-mutating-config",
        ),
        (["--webhook-service=Bad_Svc"], "--webhook-service"),
        (["--webhook-cert-check-interval=500ms"], "--webhook-cert-check-interval"),
        (["--webhook-mutating-config=UPPER"], "--webhook-mutating-config"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(SettingsError) as err:
        settings_from_args(argv)
    assert err.value.flag == flag
    assert ":" in str(err.value)


def test_run_main_reports_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert metaroce(["operator", "--lease-name=UPPER"]) == 2
    assert "--lease-name" in capsys.readouterr().err
    assert metaroce(["operator", "--webhook-port=8443"]) == 2
    assert "--webhook-cert-secret" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        settings_from_args(["--webhook-port=70000"])
    assert "--webhook-port: '70000' is not a port number" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("METAROCE_TEST_CRASH_AT", "after-configmap", "rollout.after_configmap"),
        ("METAROCE_FAILPOINTS", "informer.before_list=1:eror", "is not kill, error or error=K"),
    ],
)
def test_run_main_refuses_a_kill_switch_that_would_never_fire(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, variable: str,
    value: str, said: str,
) -> None:  # fmt: skip
    """The old METAROCE_TEST_CRASH_AT is merged into the failpoints: a test still setting
    it (or a misspelt failpoint action) fails loudly rather than never killing."""
    monkeypatch.setenv(variable, value)
    assert metaroce(["operator"]) == 2
    err = capsys.readouterr().err
    assert variable in err and said in err


def test_default_agent_image_is_tagged_with_the_charts_app_version() -> None:
    # One tag source: the operator's default must name the image the chart and
    # hack/build-images.sh produce.
    chart = Path(__file__).resolve().parents[3] / "charts" / "metaroce" / "Chart.yaml"
    app_version = yaml.safe_load(chart.read_text())["appVersion"]
    assert f"ghcr.io/metaroce/metaroce-agent:{app_version}" == DEFAULT_AGENT_IMAGE


def test_agent_image_allowlist_holds_the_default_image_and_the_flags_issue_16_11() -> None:
    digest = "registry.example.com/agent@sha256:" + "b" * 64
    settings = settings_from_args(
        ["--agent-image=example.com/a:v1", f"--allowed-agent-image={digest}"]
    )
    assert settings.render.allowed_agent_images == ("example.com/a:v1", digest)
    with pytest.raises(SettingsError, match="--allowed-agent-image"):
        settings_from_args(["--allowed-agent-image=example.com/a:latest"])
