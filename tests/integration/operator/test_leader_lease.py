"""Leader election against the real apiserver: acquire, renew, hold, a 409 from a write
behind the leader's back, release and take-over (the unit tests cover only the pure
decisions; these replace the old test that set private fields and read them back).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

from operator_env import get_json

from metaroce_harness.cluster import LocalCluster
from metaroce_operator.kube import Kube, load_credentials
from metaroce_operator.leader import LeaderElector, micro_time

LEASE = "test-leader"


def elector(kube: Kube, namespace: str, identity: str, **kw: Any) -> LeaderElector:
    options: dict[str, Any] = {"lease_duration": 15, "renew_deadline": 10, "retry_period": 0.3}
    options.update(kw)
    return LeaderElector(kube, namespace=namespace, name=LEASE, identity=identity, **options)


def lease_spec(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    return dict((get_json(cluster, "lease", LEASE, "-n", namespace) or {}).get("spec") or {})


def test_acquire_renew_lose_on_409_release_and_take_over(
    cluster: LocalCluster, namespace: str
) -> None:
    async def scenario() -> None:
        kube = Kube(load_credentials(str(cluster.kubeconfig)))
        try:
            a, b = elector(kube, namespace, "a"), elector(kube, namespace, "b")
            stop = asyncio.Event()
            assert await asyncio.wait_for(a.acquire(stop), 10)  # creates the Lease
            first = lease_spec(cluster, namespace)
            assert first["holderIdentity"] == "a" and first["leaseTransitions"] == 0
            assert a.is_leader()
            assert not await b.try_acquire_or_renew()  # held and fresh: b follows
            assert b.holder == "a"

            holding = asyncio.create_task(a.hold())
            await asyncio.sleep(1.5)
            renewed = lease_spec(cluster, namespace)
            assert renewed["renewTime"] > first["renewTime"], "no renewal was written"
            assert renewed["acquireTime"] == first["acquireTime"] and a.is_leader()

            # Someone writes the Lease behind a's back: a's next renewal gets 409, reads the
            # new holder, and a stops leading at once.
            intruder = get_json(cluster, "lease", LEASE, "-n", namespace)
            intruder["spec"].update(
                holderIdentity="intruder",
                leaseDurationSeconds=1,
                renewTime=micro_time(datetime.now(UTC)),
            )
            cluster.kubectl("replace", "-f", "-", input=json.dumps(intruder))
            await asyncio.wait_for(holding, 5)
            assert not a.is_leader() and a.holder == "intruder"

            # The intruder's lease (1 s) expires on b's clock; b takes over, then releases.
            assert await asyncio.wait_for(b.acquire(stop), 10)
            taken = lease_spec(cluster, namespace)
            assert taken["holderIdentity"] == "b" and taken["leaseTransitions"] >= 1
            await b.release()
            assert not lease_spec(cluster, namespace).get("holderIdentity")
            assert await a.try_acquire_or_renew(), "a released lease is free at once"
        finally:
            await kube.close()

    asyncio.run(scenario())


class SlowKube(Kube):
    """The real client, with every round trip taking `delay` on the elector's clock."""

    def __init__(self, *args: Any, clock: list[float], delay: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.clock = clock
        self.delay = delay

    async def request(self, *args: Any, **kw: Any) -> Any:
        self.clock[0] += self.delay
        return await super().request(*args, **kw)


def test_leadership_is_counted_from_when_the_write_was_sent(
    cluster: LocalCluster, namespace: str
) -> None:
    """#10: a follower times the lease from its own observation, which can be as early as
    the moment the leader's write was sent; a leader that counts its renew deadline from
    when the slow answer arrived believes it leads after a follower may have taken over."""
    now = [1000.0]

    async def scenario() -> None:
        kube = SlowKube(load_credentials(str(cluster.kubeconfig)), clock=now, delay=4.0)
        try:
            a = elector(kube, namespace, "a", clock=lambda: now[0])
            sent = now[0]
            assert await a.acquire(asyncio.Event())
            assert now[0] >= sent + 8.0  # a GET and a create, 4 s each
            now[0] = sent + 10.1  # past the renew deadline counted from the first send
            assert not a.is_leader(), "leadership counted from the answer, not the request"
        finally:
            await kube.close()

    asyncio.run(scenario())
