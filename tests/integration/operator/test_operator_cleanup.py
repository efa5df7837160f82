"""cleanupOnDelete: deletion waits for every node's reverted report, or for the timeout."""

from __future__ import annotations

import time

from conftest import OperatorEnv
from operator_env import condition, network_manifest, wait_for

from metaroce_api import constants as c

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}


def test_deletion_waits_for_reverted_reports(env: OperatorEnv) -> None:
    env.start_operator("--cleanup-timeout=120s")
    gen = env.loadgen("tidy")
    env.apply(network_manifest("tidy", nodeSelector=POOL_A, cleanupOnDelete=True))
    net = env.wait_condition("tidy", c.CONDITION_READY, "True")
    assert c.CLEANUP_FINALIZER in net["metadata"]["finalizers"]

    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "tidy", "--wait=false")
    net = env.wait_condition("tidy", c.CONDITION_READY, "False", reason=c.REASON_CLEANING_UP)
    assert "2 node(s)" in condition(net, c.CONDITION_READY)["message"]
    # The agents keep running while they revert (the children are not collected yet).
    assert env.daemonset("tidy") is not None

    gen.revert(["kwok-a1"])
    net = wait_for(
        "1 node left to revert",
        lambda: "1 node(s)" in condition(env.network("tidy"), c.CONDITION_READY).get("message", ""),
    )
    time.sleep(3)
    assert env.network("tidy") is not None, "released before every node reverted"

    gen.revert(["kwok-a2"])
    wait_for("the network to be gone", lambda: env.network("tidy") is None, timeout=30)
    wait_for("its DaemonSet to be collected", lambda: env.daemonset("tidy") is None, timeout=60)
    wait_for("its NodeStates to be deleted", lambda: not env.nodestates("tidy"), timeout=30)
    env.networks.discard("tidy")


def test_cleanup_timeout_names_the_silent_nodes(env: OperatorEnv) -> None:
    env.start_operator("--cleanup-timeout=8s")
    gen = env.loadgen("slow")
    env.apply(network_manifest("slow", nodeSelector=POOL_A, cleanupOnDelete=True))
    env.wait_condition("slow", c.CONDITION_READY, "True")
    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "slow", "--wait=false")
    gen.revert(["kwok-a1"])
    wait_for(
        "the network to be released after the timeout",
        lambda: env.network("slow") is None,
        timeout=40,
    )
    env.networks.discard("slow")
    timed_out = [e for e in env.events("slow") if e["reason"] == c.REASON_CLEANUP_TIMED_OUT]
    assert len(timed_out) == 1, [e["reason"] for e in env.events("slow")]
    assert timed_out[0]["type"] == "Warning"
    assert "kwok-a2" in timed_out[0]["message"] and "kwok-a1" not in timed_out[0]["message"]
