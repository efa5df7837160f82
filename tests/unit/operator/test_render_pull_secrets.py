"""Agents get the chart's imagePullSecrets (issue 16 #15): an agent image from a private
registry pulls with the same Secrets as the operator's."""

from __future__ import annotations

from operator_testlib import network

from metaroce_operator.cli import chart_arguments, settings_from_args
from metaroce_operator.render import render_network
from metaroce_operator.settings import RenderSettings


def _pod(settings: RenderSettings) -> dict:  # type: ignore[type-arg]
    (ds,) = [o for o in render_network(network("net"), settings) if o["kind"] == "DaemonSet"]
    return ds["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_agents_pull_with_the_chart_s_image_pull_secrets() -> None:
    args = chart_arguments("ns", "registry.example.com/agent:v1", image_pull_secrets=["regcred"])
    assert "--agent-image-pull-secret=regcred" in args
    settings = settings_from_args(args).render
    assert _pod(settings)["imagePullSecrets"] == [{"name": "regcred"}]


def test_no_pull_secrets_no_field() -> None:
    assert "imagePullSecrets" not in _pod(RenderSettings())
