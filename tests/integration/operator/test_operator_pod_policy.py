"""The real operator in the policy admission mode: it renders each network's
MutatingAdmissionPolicy + binding, keeps them in step with the spec, and they go with the
network; back in webhook mode it deletes a leftover one (never both mutate a pod).
What the policies do to pods: tests/integration/test_pod_admission_modes.py."""

from __future__ import annotations

import json
from typing import Any

from conftest import OperatorEnv
from operator_env import network_manifest, wait_for

from metaroce_api import constants as c
from metaroce_operator.render.podpolicy import policy_name

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}
KINDS = ("mutatingadmissionpolicy", "mutatingadmissionpolicybinding")


def policy(env: OperatorEnv, network: str, kind: str = KINDS[0]) -> dict[str, Any] | None:
    proc = env.cluster.kubectl(
        "get", kind, policy_name(network), "-o", "json", "--show-managed-fields", check=False
    )
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def env_literal(obj: dict[str, Any]) -> str:
    """The network's NCCL variables as the policy's mutation writes them (a literal)."""
    return str(obj["spec"]["mutations"][0]["jsonPatch"]["expression"])


def test_policy_mode_renders_updates_and_collects_the_pod_policy(env: OperatorEnv) -> None:
    env.start_operator("--admission-mode=policy")
    env.apply(network_manifest("polnet", nodeSelector=POOL_A, qos={"data": {"dscp": 26}}))
    got = wait_for("the network's pod policy", lambda: policy(env, "polnet"))
    net = env.network("polnet")
    assert net is not None
    for kind in KINDS:
        obj = wait_for(f"the {kind}", lambda kind=kind: policy(env, "polnet", kind))
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"]) == (c.NETWORK_KIND, net["metadata"]["uid"])
        managers = {m["manager"] for m in obj["metadata"]["managedFields"]}
        assert managers == {c.FIELD_MANAGER}
    assert "{'name': 'NCCL_IB_TC', 'value': '104'}" in env_literal(got)

    # A spec change the policy depends on is applied to it.
    env.cluster.kubectl(
        "patch",
        c.NETWORK_PLURAL,
        "polnet",
        "--type=merge",
        "-p",
        '{"spec":{"qos":{"data":{"dscp":46}}}}',
    )
    wait_for(
        "the policy to inject the new DSCP",
        lambda: (
            "{'name': 'NCCL_IB_TC', 'value': '184'}" in env_literal(policy(env, "polnet") or got)
        ),
    )

    # Deleted with the network (the garbage collector: owner references).
    env.cluster.kubectl("delete", c.NETWORK_PLURAL, "polnet", "--wait=true", "--timeout=60s")
    wait_for(
        "the policy and binding to go with the network",
        lambda: all(policy(env, "polnet", kind) is None for kind in KINDS),
        timeout=60,
    )


def test_webhook_mode_deletes_a_leftover_policy(env: OperatorEnv) -> None:
    op = env.start_operator("--admission-mode=policy")
    env.apply(network_manifest("leftover", nodeSelector=POOL_A))
    wait_for("the network's pod policy", lambda: policy(env, "leftover"))
    op.stop()
    env.operators.remove(op)
    env.start_operator(identity="operator-1")  # the chart's default: webhook mode
    wait_for(
        "the webhook-mode operator to delete the leftover policy and binding",
        lambda: all(policy(env, "leftover", kind) is None for kind in KINDS),
        timeout=60,
    )
    assert env.network("leftover") is not None  # the network itself stays
