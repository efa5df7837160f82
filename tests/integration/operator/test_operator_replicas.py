"""Two replicas with exactly the chart's arguments: only the leader acts; kill it and the
other takes over. One runs on the host, the other in the harness's pod network namespace
(same ports, as in two pods), reaching the apiserver through the veth pair."""

from __future__ import annotations

import time

from conftest import OperatorEnv
from operator_env import network_manifest, wait_for

from metaroce_api import constants as c

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}


def test_only_the_leader_acts_and_the_other_takes_over(env: OperatorEnv) -> None:
    podnet = env.cluster.pod_network
    assert podnet is not None
    args = env.chart_args()
    a = env.start_operator(args=args, identity="operator-a")
    kubeconfig_b = env.cluster.pod_network_kubeconfig()
    b = env.start_operator(
        args=args,
        identity="operator-b",
        netns=podnet.netns,
        host=podnet.pod_ip,
        kubeconfig=kubeconfig_b,
        wait_leader=False,
    )
    wait_for("b to serve its endpoints", lambda: b.probe("/readyz") == 200, timeout=60)
    assert env.lease_holder() == "operator-a"
    assert a.metric("metaroce_operator_leader") == 1
    assert b.metric("metaroce_operator_leader") == 0

    gen = env.loadgen("duo")
    env.apply(network_manifest("duo", nodeSelector=POOL_A))
    env.wait_condition("duo", c.CONDITION_READY, "True", generation=1)
    assert a.metric("metaroce_operator_reconciles_total", result="success") >= 1
    assert b.metric("metaroce_operator_reconciles_total") == 0
    assert b.metric("metaroce_operator_status_writes_total") == 0
    assert "following: operator-a holds the lease" in b.log()

    # Kill the leader hard (no lease release): b waits for the lease to expire, then leads.
    killed = time.monotonic()
    a.kill()
    wait_for("b to take the lease", lambda: env.lease_holder() == "operator-b", timeout=40)
    takeover = time.monotonic() - killed
    assert takeover < 30, takeover
    wait_for("b to report leading", lambda: b.metric("metaroce_operator_leader") == 1)

    # b acts: a spec change is reconciled and reported.
    env.apply(network_manifest("duo", nodeSelector=POOL_A, agent={"logLevel": "debug"}))
    env.wait_condition("duo", c.CONDITION_READY, "True", generation=2, timeout=120)
    assert b.metric("metaroce_operator_reconciles_total", result="success") >= 1
    assert gen.reported(2) == {"kwok-a1", "kwok-a2"}

    # A clean stop releases the lease at once.
    b.stop()
    lease = env.lease_holder()
    assert lease == "", f"the lease is still held by {lease!r} after a clean stop"


def test_a_replica_that_loses_the_lease_stops_acting(env: OperatorEnv) -> None:
    op = env.start_operator("--lease-duration=6s", "--renew-deadline=4s", "--retry-period=1s")
    env.loadgen("steal")
    env.apply(network_manifest("steal", nodeSelector=POOL_A))
    env.wait_condition("steal", c.CONDITION_READY, "True")
    # Someone else takes the lease (as a new leader would): the operator stops at once...
    env.cluster.kubectl(
        "patch",
        "lease",
        "metaroce-operator",
        "-n",
        env.namespace,
        "--type=merge",
        "-p",
        '{"spec":{"holderIdentity":"intruder","leaseDurationSeconds":20}}',
    )
    wait_for(
        "the operator to step down", lambda: op.metric("metaroce_operator_leader") == 0, timeout=10
    )
    assert "lost the lease" in op.log()
    writes = op.metric("metaroce_operator_status_writes_total")
    env.apply(network_manifest("steal", nodeSelector=POOL_A, agent={"logLevel": "debug"}))
    time.sleep(4)
    net = env.network("steal")
    assert net is not None and net["status"]["observedGeneration"] == 1, "a follower acted"
    assert op.metric("metaroce_operator_status_writes_total") == writes
    # ...and takes over again once the intruder's lease expires.
    try:
        wait_for("it to lead again", lambda: env.lease_holder() == "operator-0", timeout=45)
    except AssertionError as err:
        # Failed once in CI under load (passes alone): the log says where the time went.
        holder = env.lease_holder()
        raise AssertionError(f"{err}; lease holder {holder!r}; log:\n{op.log()[-6000:]}") from err
    env.wait_condition("steal", c.CONDITION_READY, "True", generation=2, timeout=120)
