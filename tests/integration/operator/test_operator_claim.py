"""One operator per network (issue 16 #16), against the real apiserver: two releases in
two namespaces (each with its own Lease, each leading) and one network. The first to
reconcile it claims it; the other renders no agents for it and says why; once the
claimant's release is gone (its Lease deleted with its namespace), the other takes the
network over.

On b6733c0 (and until this fix) both operators render a DaemonSet for the network: two
agents per node fight over the same NIC."""

from __future__ import annotations

import json
import secrets

from conftest import OperatorEnv
from operator_env import get_json, network_manifest, wait_for

from metaroce_api import constants as c
from metaroce_operator.claim import CLAIM_ANNOTATION
from metaroce_operator.render.common import child_name

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}


def _other_release_args(env: OperatorEnv, namespace: str) -> list[str]:
    """The operator's arguments for a release in `namespace` (its agents, its Lease and
    its webhook certificate there)."""
    out = []
    for arg in env.operator_args():
        if arg.startswith("--namespace="):
            arg = f"--namespace={namespace}"
        elif arg.startswith("--webhook-cert-secret="):
            arg = f"--webhook-cert-secret={namespace}/{arg.split('/', 1)[1]}"
        out.append(arg)
    return out


def test_a_second_release_leaves_a_claimed_network_alone_issue_16_16(env: OperatorEnv) -> None:
    other_ns = f"t-{secrets.token_hex(4)}"
    env.cluster.kubectl("create", "namespace", other_ns)
    env.cluster.kubectl(
        "label", "namespace", other_ns, "pod-security.kubernetes.io/enforce=privileged"
    )
    try:
        first = env.start_operator(identity="first")
        env.loadgen("claimed")
        env.apply(network_manifest("claimed", nodeSelector=POOL_A))
        env.wait_condition("claimed", c.CONDITION_READY, "True")
        claim = (env.network("claimed") or {})["metadata"]["annotations"][CLAIM_ANNOTATION]
        assert claim == f"{env.namespace}/metaroce-operator"

        second = env.start_operator(
            identity="second", args=_other_release_args(env, other_ns), wait_leader=False
        )
        wait_for(
            "the second operator to lead in its namespace",
            lambda: "acquired the lease" in second.log(),
            timeout=60,
        )
        # A spec change wakes both; only the claimant acts on it.
        env.cluster.kubectl("patch", c.NETWORK_PLURAL, "claimed", "--type=merge", "-p",
                            json.dumps({"spec": {"agent": {"logLevel": "debug"}}}))  # fmt: skip
        wait_for(
            "the second operator to say the network is another's",
            lambda: "is managed by the operator of lease" in second.log(),
            timeout=60,
        )
        env.wait_condition("claimed", c.CONDITION_READY, "True", generation=2)
        ds = get_json(env.cluster, "daemonset", child_name("claimed"), "-n", other_ns)
        assert ds is None, "the second operator rendered agents for a network it does not own"
        events = [e["reason"] for e in env.events("claimed")]
        assert "ClaimedByAnotherOperator" in events, events
        assert first.alive()

        # The first release is uninstalled: its operator stops, its Lease goes with its
        # namespace. The second takes the network over and renders its agents.
        first.stop()
        env.cluster.kubectl("delete", "lease", "metaroce-operator", "-n", env.namespace)
        wait_for(
            "the second operator to take the network over",
            lambda: get_json(env.cluster, "daemonset", child_name("claimed"), "-n", other_ns),
            timeout=60,
        )
        claim = (env.network("claimed") or {})["metadata"]["annotations"][CLAIM_ANNOTATION]
        assert claim == f"{other_ns}/metaroce-operator"
    finally:
        env.cluster.kubectl("delete", "namespace", other_ns, "--wait=false", check=False)
