"""Network status: a pure function of what is observed, plus the loop that batches writes.

`compute_status` turns (network, DaemonSet rollout, NodeState reports, conflicts, cleanup)
into `MetaRoceNetworkStatus` with Ready / Progressing / Degraded conditions whose reasons
say what to do. Transition times are carried over from the previous status, so the same
observations give an equal status and the operator writes nothing (an idle operator makes
no writes). `BatchLoop` writes each network's status at most once per interval, however
many NodeState events arrive in between (a 1,000-node rollout is ~1,000 events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from metaroce_api import (
    Condition,
    FailingNode,
    MetaRoceNetwork,
    MetaRoceNetworkStatus,
    NodeCounts,
    TransportSummary,
)
from metaroce_api import constants as c
from metaroce_api.network import AgentUpdateStatus
from metaroce_operator.observed import DaemonSetView, NodeReport
from metaroce_operator.probes import Verdict

log = logging.getLogger("metaroce.operator.status")

MAX_FAILING_NODES = 10
GO_BACK_N = frozenset({"rocev2", "softroce"})
CONFIGURED_PHASES = frozenset({"Ready", "Degraded"})
REASON_AGENT_FAILED = "AgentFailed"
REASON_AGENT_DEGRADED = "AgentDegraded"
REASON_PROBE_FAILING = "ProbeFailing"
INCOMPLETE_REASONS = {
    c.NODESTATE_REASON_ROLLBACK_INCOMPLETE: "AgentRollbackIncomplete",
    c.NODESTATE_REASON_REVERT_INCOMPLETE: "AgentRevertIncomplete",
}
"""FailingNode reasons of nodes whose agent has not finished a rollback or a revert."""
FAILED_REASONS = frozenset({REASON_AGENT_FAILED, *INCOMPLETE_REASONS.values()})


def failed_reason(report: NodeReport) -> str | None:
    """Why `report` counts as a failed node (a FailingNode reason), None when it does not.

    Phase Failed, or a rollback or revert the agent has not finished (phase Degraded,
    reason `NODESTATE_INCOMPLETE_REASONS`): that node runs neither its last verified
    config nor the new one, so it is never counted as configured, whatever generation
    it reports."""
    if report.phase == "Failed":
        return REASON_AGENT_FAILED
    return INCOMPLETE_REASONS.get(report.ready_reason)


def now_utc() -> datetime:
    """Now, to the second (condition times are compared for equality)."""
    return datetime.now(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class CleanupView:
    """A network being deleted with cleanupOnDelete: who has not reverted yet."""

    pending: tuple[str, ...] = ()
    timed_out: bool = False
    timeout_seconds: float = 0.0


@dataclass(frozen=True)
class Observed:
    """Everything the status of one network is computed from."""

    network: MetaRoceNetwork
    applied_generation: int | None
    """Generation whose children were applied (None: not reconciled yet)."""
    config_generation: int | None
    """Generation the agents' config dates from (NodeStates report this one)."""
    daemonset: DaemonSetView | None = None
    reports: Mapping[str, NodeReport] = field(default_factory=dict)
    """Reports of this network, by node."""
    verdicts: Mapping[str, Verdict] = field(default_factory=dict)
    eligible: frozenset[str] | None = None
    """Nodes the selector matches (None: unknown yet); reports from others are ignored."""
    conflicts: Sequence[str] = ()
    """NIC conflicts with networks whose agents may configure the same NICs: not Ready."""
    held: Sequence[str] = ()
    """Conflicts with older networks: this network's rollout is held until they are gone."""
    yielded: Sequence[str] = ()
    """Conflicts with newer networks whose rollout is held: Degraded, still Ready."""
    taint_note: str = ""
    agent_update: AgentUpdateStatus | None = None
    """The upgrade policy's state (upgrade.py); shown only when paused or a node holds."""
    holding: frozenset[str] = frozenset()
    """Nodes that hold off agent updates now (upgrade.py): one still configured and healthy
    on an older config serves the network, so it keeps Ready as a current one would. While
    the network is paused (spec.agent.updateStrategy.paused) every node counts so."""
    cleanup: CleanupView | None = None
    error: tuple[str, str] | None = None
    """(reason, message) when the spec is invalid or rendering failed."""
    pod_network: tuple[str, str] | None = None
    """(reason, message) when some nodes got no block of podNetwork.subnet: Degraded."""


@dataclass
class _Tally:
    configured: int = 0
    healthy: int = 0
    failed: int = 0
    unhealthy: int = 0
    held_serving: int = 0
    """Holding nodes configured and healthy on an older config (not in `configured`)."""
    reported: int = 0
    failing: list[FailingNode] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)


def _short(text: str, limit: int = 1000) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tally(obs: Observed) -> _Tally:
    t = _Tally()
    failing_unhealthy: list[FailingNode] = []
    # A pause holds every node: none is replaced, each serves the config its agent runs.
    paused = obs.network.spec.agent.update_strategy.paused
    for node in sorted(obs.reports):
        if obs.eligible is not None and node not in obs.eligible:
            continue
        report = obs.reports[node]
        current = (
            obs.config_generation is not None and report.config_generation == obs.config_generation
        )
        failed = failed_reason(report)
        if failed is not None:
            t.failed += 1
            t.failing.append(
                FailingNode(
                    node=node,
                    reason=failed,
                    message=_short(report.error or f"the agent reports phase {report.phase}"),
                )
            )
            continue
        if not current and (node in obs.holding or paused) and report.phase == "Ready":
            verdict = obs.verdicts.get(node)
            if verdict is None or verdict.healthy:
                t.held_serving += 1
            continue
        if not (current and report.phase in CONFIGURED_PHASES):
            continue
        t.configured += 1
        t.modes[report.transport] = t.modes.get(report.transport, 0) + 1
        verdict = obs.verdicts.get(node)
        if report.phase == "Degraded":
            t.unhealthy += 1
            failing_unhealthy.append(
                FailingNode(
                    node=node,
                    reason=REASON_AGENT_DEGRADED,
                    message=_short(report.error or "the agent reports phase Degraded"),
                )
            )
        elif verdict is not None and not verdict.healthy:
            t.unhealthy += 1
            failing_unhealthy.append(
                FailingNode(node=node, reason=REASON_PROBE_FAILING, message=_short(verdict.reason))
            )
        else:
            t.healthy += 1
    t.failing = (t.failing + failing_unhealthy)[:MAX_FAILING_NODES]
    return t


def rollout_settled(
    reports: Mapping[str, NodeReport],
    config_generation: int | None,
    desired: int,
    eligible: frozenset[str] | None,
) -> bool:
    """Whether every one of `desired` nodes has a final answer for the current config
    (configured, or failed): counted as `_tally` does, in one cheap pass."""
    if desired <= 0 or len(reports) < desired or config_generation is None:
        return False
    settled = 0
    for node, report in reports.items():
        if eligible is not None and node not in eligible:
            continue
        if failed_reason(report) is not None or (
            report.config_generation == config_generation and report.phase in CONFIGURED_PHASES
        ):
            settled += 1
    return settled >= desired


def _transport(modes: Mapping[str, int]) -> TransportSummary:
    real = {m: n for m, n in modes.items() if m != "none"}
    if not real:
        return TransportSummary(active="none")
    active = next(iter(real)) if len(real) == 1 else "mixed"
    return TransportSummary.model_validate(
        {"active": active, "nodesByMode": dict(sorted(real.items()))}
    )


def lossy_on_go_back_n(network: MetaRoceNetwork, modes: Mapping[str, int]) -> str | None:
    """The warning for a lossy profile over a go-back-N transport, or None.

    Measured here: SoftRoCE (rxe) keeps 0.21 of its throughput at 1% loss, because every
    lost packet resends the whole window. `auto` resolves to rocev2 or softroce per node.
    """
    spec = network.spec
    if spec.qos.profile != "lossy":
        return None
    mode = spec.transport.mode
    running = sorted(m for m in modes if m in GO_BACK_N)
    which: str
    if mode in GO_BACK_N:
        which = str(mode)
    elif mode == "auto" and running:
        which = f"auto (resolved to {', '.join(running)})"
    else:
        return None
    return (
        f"qos.profile lossy runs without PFC, but transport {which} retransmits go-back-N: "
        "on SoftRoCE 1% packet loss left 0.21 of the throughput. Set qos.profile: lossless "
        "(PFC on the data priority), or transport.mode: metaroce for a lossy fabric"
    )


def _condition(
    previous: Sequence[Condition],
    ctype: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> Condition:
    value: Literal["True", "False"] = "True" if status else "False"
    old = next((cond for cond in previous if cond.type == ctype), None)
    since = old.last_transition_time if old is not None and old.status == value else now
    return Condition(
        type=ctype,
        status=value,
        reason=reason,
        message=_short(message, 32000),
        observed_generation=generation,
        last_transition_time=since,
    )


def compute_status(
    obs: Observed, previous: MetaRoceNetworkStatus | None, now: datetime
) -> MetaRoceNetworkStatus:
    """The status that `obs` implies (pure; equal inputs give an equal status)."""
    network = obs.network
    name = network.name
    generation = network.metadata.generation or 0
    observed_gen = obs.applied_generation
    if obs.held and obs.error is None:
        observed_gen = generation  # seen, and deliberately not rolled out
    if observed_gen is None and previous is not None:
        observed_gen = previous.observed_generation
    ds = obs.daemonset
    t = _tally(obs)
    if ds is not None and ds.observed_current:
        desired = ds.desired
    elif obs.eligible is not None:
        # The DaemonSet controller reports only after creating a batch of pods: until
        # then, the nodes the selector matches are the best estimate.
        desired = len(obs.eligible)
    else:
        desired = previous.nodes.desired if previous and previous.nodes else 0
    counts = NodeCounts(
        desired=desired, configured=t.configured, healthy=t.healthy, failed=t.failed
    )
    lossy = lossy_on_go_back_n(network, t.modes)
    rolling = (
        obs.applied_generation is None
        or obs.applied_generation < generation
        or ds is None
        or not ds.rolled_out
    )
    waiting = t.configured + t.failed < desired
    # For Ready, a node that holds off the update and still serves its older config counts
    # (a hold is a job asking for its node to stay as it is, not a failure).
    serving = t.healthy + t.held_serving
    ready_waiting = t.configured + t.held_serving + t.failed < desired
    if not t.held_serving:
        held_note = ""
    elif network.spec.agent.update_strategy.paused:
        held_note = (
            f"; {t.held_serving} of them on an older config while agent updates are paused "
            "(spec.agent.updateStrategy.paused)"
        )
    else:
        held_note = (
            f"; {t.held_serving} of them hold off the agent update on an older config until "
            "their deadline (status.agentUpdate)"
        )
    fraction = network.spec.health.ready_fraction
    needed = math.ceil(fraction * desired - 1e-9)  # 0.9 x 10 is 9.000000000000002
    members = f"kubectl get mrns -l {c.NETWORK_LABEL}={name}"

    # --- Degraded: every problem, the most severe first ---------------------------------
    problems: list[tuple[str, str]] = []
    if obs.error is not None:
        problems.append(obs.error)
    if obs.cleanup is not None and obs.cleanup.timed_out:
        pending = obs.cleanup.pending
        problems.append(
            (
                c.REASON_CLEANUP_TIMED_OUT,
                f"{len(pending)} node(s) did not report reverted within "
                f"{obs.cleanup.timeout_seconds:g}s: {', '.join(pending[:10])}"
                f"{' ...' if len(pending) > 10 else ''}; their RDMA settings may remain: "
                "check those nodes (metaroce doctor) before reusing them",
            )
        )
    for conflict in (*obs.held, *obs.conflicts, *obs.yielded):
        problems.append((c.REASON_NIC_CONFLICT, conflict))
    failed_message = ""
    if t.failed:
        first = next(f for f in t.failing if f.reason in FAILED_REASONS)
        failed_message = (
            f"{t.failed} of {max(desired, t.failed)} node(s) failed, e.g. {first.node}: "
            f"{first.message}. See status.failingNodes and `{members}`"
        )
        problems.append((c.REASON_NODES_FAILED, failed_message))
    if t.unhealthy:
        note = f" {obs.taint_note}" if obs.taint_note else ""
        problems.append(
            (
                c.REASON_NODES_UNHEALTHY,
                f"{t.unhealthy} configured node(s) fail their RDMA probe or report Degraded; "
                f"see status.failingNodes.{note}",
            )
        )
    if lossy:
        problems.append((c.REASON_LOSSY_ON_GO_BACK_N, lossy))
    if obs.pod_network is not None:
        problems.append(obs.pod_network)

    # --- Ready ---------------------------------------------------------------------------
    if obs.error is not None:
        ready = (False, *obs.error)
    elif obs.cleanup is not None:
        ready = (
            False,
            c.REASON_CLEANING_UP,
            f"the network is being deleted; waiting for {len(obs.cleanup.pending)} node(s) "
            "to report their settings reverted",
        )
    elif obs.held:
        ready = (False, c.REASON_NIC_CONFLICT, obs.held[0])
    elif obs.conflicts:
        ready = (False, c.REASON_NIC_CONFLICT, obs.conflicts[0])
    elif (
        ds is None
        or obs.applied_generation is None
        or (not ds.observed_current and obs.eligible is None)
    ):
        # A DaemonSet the controller has not observed yet with known eligible nodes is
        # judged by the reports below: an edit that leaves the agents' config as it is
        # (the switch to OnDelete when a node starts holding, an image) must not flap
        # Ready to False for the moment until the DaemonSet controller catches up.
        ready = (False, c.REASON_ROLLING_OUT, "the agent DaemonSet is being created or updated")
    elif desired == 0:
        ready = (
            False,
            c.REASON_NO_MATCHING_NODES,
            "no node matches spec.nodeSelector (or the nodes have taints the agents do not "
            "tolerate): label nodes, or change spec.nodeSelector / spec.tolerations",
        )
    elif serving == desired and not ready_waiting:
        ready = (
            True,
            c.REASON_RECONCILED,
            f"all {desired} node(s) configured and healthy{held_note}",
        )
    elif not ready_waiting and serving >= needed and needed < desired:
        ready = (
            True,
            c.REASON_RECONCILED,
            f"{serving} of {desired} node(s) configured and healthy (spec.health."
            f"readyFraction {fraction:g} needs {needed}){held_note}; see Degraded for the "
            "others",
        )
    elif t.failed:
        ready = (False, c.REASON_NODES_FAILED, failed_message)
    elif t.unhealthy and t.configured >= desired:
        ready = (
            False,
            c.REASON_NODES_UNHEALTHY,
            f"{t.healthy} of {desired} node(s) healthy; see status.failingNodes",
        )
    elif ds.updated < desired or ds.available < desired:
        ready = (
            False,
            c.REASON_ROLLING_OUT,
            f"{ds.updated}/{desired} agents run the current template, {ds.available} available",
        )
    else:
        ready = (
            False,
            c.REASON_WAITING_FOR_NODES,
            f"{t.configured}/{desired} node(s) report config generation "
            f"{obs.config_generation}; waiting for the agents' reports (`{members}`)",
        )

    # --- Progressing ---------------------------------------------------------------------
    if obs.cleanup is not None:
        progressing = (True, c.REASON_CLEANING_UP, "reverting node settings before deletion")
    elif obs.error is not None:
        progressing = (False, obs.error[0], "fix the spec; nothing is rolled out until then")
    elif obs.held:
        progressing = (False, c.REASON_NIC_CONFLICT, obs.held[0])
    elif rolling:
        if ds is not None and ds.observed_current:
            message = f"{ds.updated}/{desired} agents updated, {ds.available} available"
        else:
            message = "applying the agent DaemonSet"
        update = obs.agent_update
        if update is not None and update.paused:
            message += "; paused (spec.agent.updateStrategy.paused): no agent is replaced"
        elif update is not None and update.holding:
            message += (
                f"; {update.holding} node(s) hold off agent updates until their deadline "
                "(status.agentUpdate)"
            )
        progressing = (True, c.REASON_ROLLING_OUT, message)
    elif waiting:
        progressing = (
            True,
            c.REASON_WAITING_FOR_NODES,
            f"{desired - t.configured - t.failed} node(s) have not reported config generation "
            f"{obs.config_generation} yet",
        )
    else:
        progressing = (False, c.REASON_RECONCILED, "every agent runs the current config")

    # --- Degraded ------------------------------------------------------------------------
    if problems:
        if len(problems) == 1:
            degraded = (True, problems[0][0], problems[0][1])
        else:
            degraded = (True, problems[0][0], "; ".join(f"{r}: {m}" for r, m in problems))
    else:
        degraded = (False, c.REASON_AS_EXPECTED, "no problems observed")

    prev_conditions = (previous.conditions if previous else None) or []
    conditions = [
        _condition(prev_conditions, ctype, *value, observed_gen, now)
        for ctype, value in (
            (c.CONDITION_READY, ready),
            (c.CONDITION_PROGRESSING, progressing),
            (c.CONDITION_DEGRADED, degraded),
        )
    ]
    return MetaRoceNetworkStatus(
        observed_generation=observed_gen,
        conditions=conditions,
        nodes=counts,
        failing_nodes=t.failing or None,
        transport=_transport(t.modes),
        agent_update=(
            obs.agent_update
            if obs.agent_update is not None
            and (obs.agent_update.paused or obs.agent_update.held_nodes)
            else None
        ),
    )


def invalid_status(
    previous: MetaRoceNetworkStatus | None,
    generation: int,
    reason: str,
    message: str,
    now: datetime,
) -> MetaRoceNetworkStatus:
    """The status of a network whose spec cannot be used at all (no model to compute from)."""
    prev_conditions = (previous.conditions if previous else None) or []
    fix = "fix the spec; the last applied children stay as they are until then"
    conditions = [
        _condition(prev_conditions, ctype, value, reason, msg, generation, now)
        for ctype, value, msg in (
            (c.CONDITION_READY, False, message),
            (c.CONDITION_PROGRESSING, False, fix),
            (c.CONDITION_DEGRADED, True, message),
        )
    ]
    return MetaRoceNetworkStatus(
        observed_generation=generation,
        conditions=conditions,
        nodes=previous.nodes if previous else None,
        failing_nodes=previous.failing_nodes if previous else None,
        transport=previous.transport if previous else None,
    )


def same_status(a: MetaRoceNetworkStatus | None, b: MetaRoceNetworkStatus | None) -> bool:
    """Equal as the API would store them."""
    if a is None or b is None:
        return a is b
    return a.to_api() == b.to_api()


def parse_status(raw: Mapping[str, object] | None) -> MetaRoceNetworkStatus | None:
    """The status of a network body (None when absent or unreadable)."""
    if not raw:
        return None
    try:
        return MetaRoceNetworkStatus.model_validate(raw)
    except ValueError:
        return None


# --- events on transitions ------------------------------------------------------------------


@dataclass(frozen=True)
class EventSpec:
    type: str
    """Normal or Warning."""
    reason: str
    message: str


def _get(status: MetaRoceNetworkStatus | None, ctype: str) -> Condition | None:
    if status is None:
        return None
    return next((cond for cond in status.conditions or [] if cond.type == ctype), None)


def transition_events(
    old: MetaRoceNetworkStatus | None, new: MetaRoceNetworkStatus
) -> list[EventSpec]:
    """Kubernetes Events for real transitions between two statuses (none when equal)."""
    events: list[EventSpec] = []
    old_ready, new_ready = _get(old, c.CONDITION_READY), _get(new, c.CONDITION_READY)
    if new_ready is not None:
        if new_ready.status == "True" and (old_ready is None or old_ready.status != "True"):
            events.append(EventSpec("Normal", new_ready.reason, new_ready.message))
        elif new_ready.status != "True" and old_ready is not None and old_ready.status == "True":
            events.append(EventSpec("Warning", new_ready.reason, new_ready.message))
    old_deg, new_deg = _get(old, c.CONDITION_DEGRADED), _get(new, c.CONDITION_DEGRADED)
    if new_deg is not None:
        was = old_deg is not None and old_deg.status == "True"
        changed = old_deg is None or old_deg.reason != new_deg.reason
        if new_deg.status == "True" and (not was or changed):
            events.append(EventSpec("Warning", new_deg.reason, new_deg.message))
        elif new_deg.status != "True" and was:
            events.append(EventSpec("Normal", "Recovered", "no problems observed any more"))
    # Ready and Degraded often turn for the same reason: one Event says it.
    unique: dict[tuple[str, str], EventSpec] = {}
    for event in events:
        unique.setdefault((event.type, event.reason), event)
    events = list(unique.values())
    lossy = c.REASON_LOSSY_ON_GO_BACK_N
    if new_deg is not None and new_deg.status == "True" and _mentions(new_deg, lossy):
        already = any(e.reason == lossy for e in events)
        seen_before = (
            old is not None
            and old.observed_generation == new.observed_generation
            and old_deg is not None
            and old_deg.status == "True"
            and _mentions(old_deg, lossy)
        )
        if not already and not seen_before:
            events.append(EventSpec("Warning", lossy, _lossy_message(new_deg.message)))
    return events


def _mentions(cond: Condition, reason: str) -> bool:
    return cond.reason == reason or f"{reason}: " in cond.message


def _lossy_message(message: str) -> str:
    marker = f"{c.REASON_LOSSY_ON_GO_BACK_N}: "
    if marker in message:
        return message.split(marker, 1)[1].split("; ", 1)[0]
    return message


# --- the batching loop -------------------------------------------------------------------------


class BatchLoop:
    """Flush each dirty key at most once per `interval`, however often it is marked.

    `mark(key)` is cheap and synchronous (event handlers call it); the loop wakes, waits
    until the key's interval since its last flush has passed, then calls `flush(key)`.
    Keys marked while being flushed are flushed again in the next round.

    `mark(key, urgent=True)` flushes without waiting out the interval: for the one event
    a person waits for (the last node of a rollout reported), so that Ready is written at
    once instead of up to an interval later. Callers make it rare (once per rollout).
    """

    def __init__(
        self,
        flush: Callable[[str], Awaitable[None]],
        interval: float,
        *,
        clock: Callable[[], float] | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self.flush = flush
        self.interval = interval
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.on_error = on_error
        self.dirty: set[str] = set()
        self.urgent: set[str] = set()
        self.last_flush: dict[str, float] = {}
        self._wake = asyncio.Event()
        self.flushes = 0

    def mark(self, key: str, *, urgent: bool = False) -> None:
        self.dirty.add(key)
        if urgent:
            self.urgent.add(key)
        self._wake.set()

    def forget(self, key: str) -> None:
        self.dirty.discard(key)
        self.urgent.discard(key)
        self.last_flush.pop(key, None)

    async def run(self) -> None:
        while True:
            if not self.dirty:
                self._wake.clear()
                await self._wake.wait()
                continue  # what woke it may be forgotten already: look again
            now = self.clock()
            due = {k for k in self.dirty if now - self.last_flush.get(k, -1e18) >= self.interval}
            due |= self.urgent & self.dirty
            if not due:
                wait = min(self.last_flush[k] + self.interval for k in self.dirty) - now
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(wait, 0.01))
                continue
            for key in sorted(due):
                self.dirty.discard(key)
                self.urgent.discard(key)
                self.last_flush[key] = self.clock()
                try:
                    await self.flush(key)
                    self.flushes += 1
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # one network's failure must not stop the others
                    self.dirty.add(key)  # retry after the interval
                    if self.on_error is not None:
                        self.on_error(key, exc)
                    else:
                        log.exception("status of %s: flush failed", key)
