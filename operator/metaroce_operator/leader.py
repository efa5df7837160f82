"""Leader election with a coordination.k8s.io/v1 Lease (client-go's algorithm).

kopf's peering is not leader election (replicas of equal priority all pause), so replicas
compete for one Lease; only the holder runs the reconcilers. As in client-go:

- a candidate takes the lease when it has no holder, or when the record it observed has
  not changed for `leaseDurationSeconds` measured on the candidate's own clock (so clock
  skew between machines does not matter);
- every write is a PUT with the observed resourceVersion, so two candidates cannot both win;
- the leader renews every `retry_period`; if it could not renew for `renew_deadline`
  (shorter than the lease duration, counted from when the last successful write was
  sent, not answered), `is_leader()` turns false at once and the write gate closes,
  before any follower may take over;
- on a clean shutdown the leader releases the lease, so a follower takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from metaroce_api.failpoints import failpoint
from metaroce_operator import metrics
from metaroce_operator.kube import KINDS, ApiError, Kube

log = logging.getLogger("metaroce.operator.leader")
LEASE = KINDS[("coordination.k8s.io/v1", "Lease")]


def micro_time(moment: datetime) -> str:
    """metav1.MicroTime text."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Record:
    """The parts of a Lease spec that identify one renewal."""

    holder: str
    renew_time: str
    duration: int
    transitions: int
    acquire_time: str

    @classmethod
    def from_lease(cls, lease: Mapping[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            renew_time=str(spec.get("renewTime") or ""),
            duration=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
            acquire_time=str(spec.get("acquireTime") or ""),
        )


def may_take(
    record: Record, identity: str, observed_since: float, now: float, default_duration: float
) -> bool:
    """Whether `identity` may write the lease now (pure).

    `observed_since`: local monotonic time at which this exact record was first seen.
    """
    if not record.holder or record.holder == identity:
        return True
    duration = record.duration or default_duration
    return now - observed_since >= duration


def next_spec(record: Record | None, identity: str, duration: int, now: datetime) -> dict[str, Any]:
    """The Lease spec that takes or renews the lease for `identity` (pure)."""
    stamp = micro_time(now)
    renewing = record is not None and record.holder == identity
    transitions = 0 if record is None else record.transitions + (0 if renewing else 1)
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": duration,
        "acquireTime": record.acquire_time
        if renewing and record and record.acquire_time
        else stamp,
        "renewTime": stamp,
        "leaseTransitions": transitions,
    }


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float,
        renew_deadline: float,
        retry_period: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.clock = clock
        self._observed: Record | None = None
        self._observed_since = 0.0
        self._leading = False
        self._last_renew = -1e18
        self._held: dict[str, Any] | None = None
        """Our last written Lease (renewals write on top of it)."""
        self.last_contact = -1e18
        """Last successful API round trip (readiness)."""
        self.heartbeat = clock()
        """Last loop iteration (liveness)."""

    # -- state ----------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """True only while the lease is held and was renewed within the renew deadline."""
        return self._leading and self.clock() - self._last_renew < self.renew_deadline

    @property
    def lease_ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def holder(self) -> str:
        return self._observed.holder if self._observed else ""

    def _lose(self, why: str) -> None:
        self._held = None
        if self._leading:
            log.warning(
                "lost the lease %s/%s: %s; stopping at once", self.namespace, self.name, why
            )
        self._leading = False
        metrics.LEADER.set(0)

    # -- one attempt ----------------------------------------------------------------------

    async def try_acquire_or_renew(self) -> bool:
        now_wall = datetime.now(UTC)
        duration = max(round(self.lease_duration), 1)
        if self._leading and self._held is not None:
            # Renewal: one write on top of our own last write (a quorum GET first doubles
            # the round trips when etcd is slow); a conflict means someone else wrote.
            held = dict(self._held)
            held["spec"] = next_spec(Record.from_lease(held), self.identity, duration, now_wall)
            try:
                updated = await self.kube.replace(held)
            except ApiError as err:
                if err.status != 409:
                    raise
            else:
                self.last_contact = self.clock()
                self._held = updated
                self._observe(Record.from_lease(updated))
                return True
        self._held = None
        lease = await self.kube.get_or_none(LEASE, self.name, self.namespace)
        self.last_contact = self.clock()
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": next_spec(None, self.identity, duration, now_wall),
            }
            try:
                created = await self.kube.create(body)
            except ApiError as err:
                if err.status == 409:
                    return False
                raise
            self._observe(Record.from_lease(created))
            self._held = created
            return True
        record = Record.from_lease(lease)
        self._observe(record)
        if not may_take(record, self.identity, self._observed_since, self.clock(), duration):
            return False
        lease["spec"] = next_spec(record, self.identity, duration, now_wall)
        try:
            updated = await self.kube.replace(lease)
        except ApiError as err:
            if err.status == 409:
                return False  # someone else wrote first
            raise
        self._observe(Record.from_lease(updated))
        self._held = updated
        return True

    def _observe(self, record: Record) -> None:
        if record != self._observed:
            self._observed = record
            self._observed_since = self.clock()

    # -- loops ------------------------------------------------------------------------------

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this replica holds the lease (True) or `stop` is set (False)."""
        announced = ""
        while not stop.is_set():
            failpoint("lease.candidate")  # each try to lead (a follower's kill point)
            self.heartbeat = self.clock()
            sent = self.clock()
            try:
                if await self.try_acquire_or_renew():
                    self._leading = True
                    self._last_renew = sent
                    metrics.LEADER.set(1)
                    log.info(
                        "acquired the lease %s/%s as %s", self.namespace, self.name, self.identity
                    )
                    return True
                if self.holder != announced:
                    announced = self.holder
                    log.info(
                        "following: %s holds the lease %s/%s", announced, self.namespace, self.name
                    )
            except Exception as err:  # the apiserver may be unreachable for a while
                metrics.ERRORS.labels(where="lease").inc()
                log.warning("lease %s/%s: %s", self.namespace, self.name, err)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.retry_period)
        return False

    async def hold(self) -> None:
        """Renew until the lease is lost; returns at the moment it is."""
        while True:
            self.heartbeat = self.clock()
            left = self.renew_deadline - (self.clock() - self._last_renew)
            await asyncio.sleep(min(self.retry_period, max(left, 0.0)))
            self.heartbeat = self.clock()
            if not self.is_leader():
                self._lose(f"not renewed for {self.renew_deadline:g}s")
                return
            sent = self.clock()
            try:
                ok = await asyncio.wait_for(
                    self.try_acquire_or_renew(),
                    timeout=max(self.renew_deadline - (self.clock() - self._last_renew), 0.01),
                )
            except Exception as err:
                metrics.ERRORS.labels(where="lease").inc()
                log.warning("renewing the lease failed: %r", err)
                continue
            if not ok:
                self._lose(f"{self.holder or 'another replica'} holds it now")
                return
            # From when the write was sent, not when its answer came: a follower may time
            # the lease from as early as that, so a slow answer must not stretch our term.
            self._last_renew = sent

    async def release(self) -> None:
        """Give the lease up (clean shutdown), so a follower need not wait for it to expire."""
        if not self._leading:
            return
        self._leading = False
        metrics.LEADER.set(0)
        try:
            lease = await self.kube.get_or_none(LEASE, self.name, self.namespace)
            if lease is None or Record.from_lease(lease).holder != self.identity:
                return
            stamp = micro_time(datetime.now(UTC))
            lease["spec"] = {
                **(lease.get("spec") or {}),
                "holderIdentity": None,
                "leaseDurationSeconds": 1,
                "renewTime": stamp,
                "acquireTime": stamp,
            }
            await self.kube.replace(lease)
            log.info("released the lease %s/%s", self.namespace, self.name)
        except Exception as err:
            log.warning("could not release the lease (followers wait for it to expire): %s", err)
