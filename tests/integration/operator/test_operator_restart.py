"""Restart safety: kill the operator at named points, start it again, and it converges to
the same objects with no extra DaemonSet rollout (same template hash and generation)."""

from __future__ import annotations

import signal

import pytest
from conftest import OperatorEnv
from operator_env import network_manifest, wait_for

from metaroce_api import constants as c
from metaroce_api import failpoints, validate_network
from metaroce_operator.render import render_network
from metaroce_operator.render.common import child_name
from metaroce_operator.settings import RenderSettings

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}


KILL_POINTS = ("rollout.after_configmap", "rollout.after_daemonset", "status.before_write")
"""Failpoints (metaroce_api.failpoints) where the first operator is killed -9, first hit."""


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_and_restart_converges_without_a_rollout(env: OperatorEnv, point: str) -> None:
    name = f"crash-{point.rpartition('.')[2].replace('_', '')}"[:40]
    args = env.operator_args()
    first = env.start_operator(args=args, env={failpoints.ENV: f"{point}=1"})
    gen = env.loadgen(name)
    manifest = network_manifest(name, nodeSelector=POOL_A)
    env.apply(manifest)
    assert first.wait(60) == -signal.SIGKILL, first.log()[-3000:]
    assert f"failpoint {point} (hit 1, {failpoints.ENV}): SIGKILL" in first.log()

    cm_name = child_name(name)
    cm_exists = (
        env.cluster.kubectl(
            "get", "configmap", cm_name, "-n", env.namespace, check=False
        ).returncode
        == 0
    )
    assert cm_exists, "the ConfigMap is applied before every kill point"
    ds_before = env.daemonset(name)
    if point == "rollout.after_configmap":
        assert ds_before is None
    else:
        assert ds_before is not None
        wait_for("agents Running", lambda: len(gen.reported()) == 2)
    pods_before = {p["metadata"]["uid"] for p in env.agent_pods(name)}

    # The same pod restarted: same identity, so it takes its own lease back at once.
    env.start_operator(args=args)
    net = env.wait_condition(name, c.CONDITION_READY, "True", generation=1)

    ds = env.daemonset(name)
    assert ds is not None
    assert ds["metadata"]["generation"] == 1, "the restart rolled the DaemonSet"
    network = validate_network(net)
    (expected,) = [
        o
        for o in render_network(
            network, RenderSettings(env.namespace, "example.com/metaroce-agent:v0.1.0")
        )
        if o["kind"] == "DaemonSet"
    ]
    want = expected["spec"]["template"]["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION]
    assert ds["spec"]["template"]["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION] == want
    if ds_before is not None:
        assert ds_before["metadata"]["generation"] == 1
        assert {p["metadata"]["uid"] for p in env.agent_pods(name)} == pods_before
    revisions = env.cluster.kubectl(
        "get",
        "controllerrevisions",
        "-n",
        env.namespace,
        "-l",
        f"{c.NETWORK_LABEL}={name}",
        "-o",
        "name",
    ).stdout.split()
    assert len(revisions) == 1, revisions
