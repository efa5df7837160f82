"""Apply with verify and rollback; drift repair; revert. Side effects live here.

The engine keeps a journal (`/run/metaroce/agent/<network>/journal.json`, through `Host`) of
every step it applied with the snapshot taken before the agent first touched the knob,
and the step as the last pass that verified left it (the configuration running jobs use).
The journal outlives the agent process (a rollout restarts the agent but leaves the node
configured), so a later process can verify, repair and, when the network is deleted
with cleanupOnDelete, undo exactly what was done, restoring what was there before.

- `apply(plan)`: steps in order; each is snapshotted (unless the journal already holds
  its original snapshot), applied and read back. The first step that fails (apply raises
  or the read-back differs) stops the pass and restores the last verified state: the
  steps this pass changed, the failed one included, go back in reverse order to their
  last verified value (a step that was never verified goes back to its original
  snapshot and leaves the journal); steps this pass did not change are not touched, nor
  is a knob that still reads as its target (the failed apply changed nothing: on a
  read-only configfs, removing a directory that is not there would fail); the result
  names the failed step and why. Only knobs that really read off their last verified
  (or original) value count as left off (`ApplyResult.left_off`: Degraded,
  RollbackIncomplete) and are retried by the next pass. Journal entries whose step is no
  longer planned (a knob the new config drops) are undone only once the whole pass
  verified.
- `drift(plan)`: reads every journaled step back; re-applies what differs and counts it.
- `revert()`: undoes the whole journal in reverse; a knob already at its original is only
  dropped from the journal (a revert never retries undoing what is already undone);
  entries that fail stay journaled.

The journal is written atomically (temporary file, fsync, rename, fsync of the
directory). One that cannot be read is moved aside (`journal.json.corrupt-<time>`, for
a human) and never silently replaced by snapshots of the agent's own values: every step
the agent journals afresh while a journal was lost is marked `originalKnown: false`, and
a revert leaves such knobs as applied and says so, knob by knob.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from metaroce_agent.host import Host, HostError
from metaroce_agent.plan import Plan
from metaroce_agent.steps import Json, Step, StepError, step_from_record
from metaroce_agent.transport.library import MetaRoceLibraryStep
from metaroce_api.failpoints import failpoint

log = logging.getLogger("metaroce.agent.engine")

STATE_DIR = "/run/metaroce/agent"


@dataclass
class JournalEntry:
    step: Step
    """The step as last applied (by a pass that may not have finished)."""
    snapshot: Json
    """The knob before the agent first touched it."""
    verified: Step | None
    """The step as the last pass that verified left it; None when no pass that planned it
    has verified yet."""
    original_known: bool = True
    """False when the snapshot was taken after a journal was lost: it may be the agent's
    own earlier value, so a revert must not put it back as the node's original."""

    def to_json(self) -> dict[str, Json]:
        verified = None if self.verified is None else self.verified.record()
        return {
            **self.step.record(),
            "id": self.step.id,
            "snapshot": self.snapshot,
            "verified": verified,
            "originalKnown": self.original_known,
        }


class Journal:
    """What the agent applied on this node for one network, with original snapshots."""

    def __init__(self, host: Host, network: str, state_dir: str = STATE_DIR) -> None:
        self.host = host
        self.path = f"{state_dir}/{network}/journal.json"
        self.entries: dict[str, JournalEntry] = {}
        self.problem = ""
        """Why the journal on disk could not be read (it was moved aside), or empty."""
        self.load()

    @property
    def originals_lost(self) -> bool:
        return bool(self.problem)

    def load(self) -> None:
        self._remove_temporaries()
        text = self.host.read_opt(self.path)
        self.entries = {}
        if text is None:
            return
        try:
            data = json.loads(text)
            for raw in data.get("entries", []):
                step = step_from_record(raw)
                # journals before "verified" hold only what verified passes left
                record = raw.get("verified", raw)
                verified = None if record is None else step_from_record(record)
                was = {v.id: v for v, _ in verified.split(None)} if verified is not None else {}
                known = bool(raw.get("originalKnown", True))
                for part, snapshot in step.split(raw.get("snapshot")):
                    entry = JournalEntry(part, snapshot, was.get(part.id), known)
                    self.entries[part.id] = entry
        except (ValueError, TypeError, KeyError, AttributeError, StepError) as e:
            aside = f"{self.path}.corrupt-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
            self.problem = (
                f"journal {self.path} is unreadable ({e}); moved to {aside}: the node's "
                "original values of the knobs it listed are lost, so knobs journaled from now "
                "on are marked originalKnown: false and a revert leaves them as applied"
            )
            log.error("%s", self.problem)
            self.entries = {}
            try:
                self.host.rename(self.path, aside)
            except Exception as move_error:
                log.error("cannot move the unreadable journal aside: %s", move_error)

    def _remove_temporaries(self) -> None:
        """Remove temporary journals a killed agent left before their rename: the journal
        in place is the valid one, and each crash would otherwise leave another. The agent
        is the journal's only writer, so none of them is being written now."""
        directory, name = self.path.rsplit("/", 1)
        for leftover in self.host.listdir(directory):
            if leftover.startswith(f".{name}.") and leftover.endswith(".tmp"):
                log.warning("removing %s/%s, left by a killed agent", directory, leftover)
                try:
                    self.host.remove(f"{directory}/{leftover}")
                except HostError as e:  # litter, not a reason to stop
                    log.warning("%s", e)

    def save(self) -> None:
        body = {"version": 1, "entries": [e.to_json() for e in self.entries.values()]}
        self.host.write_atomic(self.path, json.dumps(body, indent=1, sort_keys=True))

    def put(
        self, step: Step, snapshot: Json, verified: Step | None, original_known: bool = True
    ) -> None:
        self.entries[step.id] = JournalEntry(step, snapshot, verified, original_known)
        self.save()

    def commit(self, steps: list[Step]) -> None:
        """Mark `steps` (a pass that verified) as the last verified state."""
        for step in steps:
            entry = self.entries.get(step.id)
            if entry is not None:
                entry.verified = entry.step
        self.save()

    def drop(self, step_id: str) -> None:
        if self.entries.pop(step_id, None) is not None:
            self.save()

    def __contains__(self, step_id: object) -> bool:
        return step_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class ApplyResult:
    ok: bool
    applied: list[Step] = field(default_factory=list)
    failed_step: Step | None = None
    error: str = ""
    rolled_back: list[str] = field(default_factory=list)
    undo_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    changed: int = 0
    """Steps that were actually applied (not already in the desired state)."""
    in_force: list[Step] = field(default_factory=list)
    """After a failed pass: the journaled steps at their last verified value (what the
    node runs on now); empty after a pass that verified (then `applied` says it)."""
    left_off: list[Step] = field(default_factory=list)
    """After a failed pass whose rollback failed too: the steps left off their last
    verified value (or, never verified, off their original); retried by the next pass."""

    verified_in_force: bool = False
    """After a failed pass: every journaled knob is back at its last verified value and
    reads back so, and there is one: the node runs on the last verified config (a
    rolled-back re-apply), so running jobs are fine."""

    @property
    def rollback_incomplete(self) -> bool:
        """A failed pass that could not put the node back to its last verified state."""
        return not self.ok and bool(self.left_off)


@dataclass
class DriftResult:
    checked: int = 0
    repaired: list[tuple[Step, str]] = field(default_factory=list)
    errors: list[tuple[Step, str]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class RevertResult:
    undone: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)
    """(step name, why) of knobs left as applied: their original was lost."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors


class Engine:
    def __init__(self, host: Host, journal: Journal) -> None:
        self.host = host
        self.journal = journal

    # --- apply ---------------------------------------------------------------------------
    def apply(self, plan: Plan) -> ApplyResult:
        start = time.monotonic()
        if not plan.ok:
            # nothing is applied, but what an earlier failed rollback left is retried
            rolled, undo_errors = self._restore(self._unsettled(set()))
            return ApplyResult(
                ok=False,
                error="; ".join(f"{e.where}: {e.message}" for e in plan.errors),
                rolled_back=rolled,
                undo_errors=undo_errors,
                seconds=time.monotonic() - start,
                **self._after_failure(),
            )
        done: list[Step] = []
        changes: list[tuple[Step, Step | None]] = []
        """(step, its last verified version) for each step this pass changed"""
        total = len(plan.steps)
        for i, step in enumerate(plan.steps, 1):
            try:
                prior = self.journal.entries.get(step.id)
                previous = prior.verified if prior is not None else None
                if prior is not None and prior.step == step and step.verify(self.host) is None:
                    if previous != step:  # applied by a pass that did not finish
                        changes.append((step, previous))
                    done.append(step)
                    continue
                if prior is not None:
                    snapshot, known = prior.snapshot, prior.original_known
                else:  # first touch; after a lost journal the "original" may be ours
                    snapshot, known = step.snapshot(self.host), not self.journal.originals_lost
                self.journal.put(step, snapshot, previous, known)
                changes.append((step, previous))
                failpoint("apply.before_step")  # journaled, not applied
                log.info("[%d/%d] apply %s = %s", i, total, step.name, step.value())
                failpoint(f"apply.step.{step.kind}")  # the fault tier's failing step
                step.apply(self.host)
                failpoint("apply.after_step")  # applied, not read back
                problem = step.verify(self.host)
                if problem is not None:
                    raise StepError(f"read back after apply: {problem}")
                done.append(step)
            except Exception as e:
                error = str(e) or type(e).__name__
                log.error(
                    "apply %s failed: %s; restoring the last verified state of %d step(s)",
                    step.name,
                    error,
                    len(changes),
                )
                # and what an earlier failed rollback left off its verified value
                earlier = self._unsettled({s.id for s, _ in changes})
                rolled, undo_errors = self._restore(earlier + changes)
                return ApplyResult(
                    ok=False,
                    applied=[],
                    failed_step=step,
                    error=error,
                    rolled_back=rolled,
                    undo_errors=undo_errors,
                    seconds=time.monotonic() - start,
                    changed=len(changes),
                    **self._after_failure(),
                )
        failpoint("apply.before_commit")  # every step verified, not yet journaled as such
        self.journal.commit(done)
        undo_errors = self._undo_stale({s.id for s in plan.steps})
        seconds = time.monotonic() - start
        log.info("apply: %d steps in %.2f s (%d changed)", total, seconds, len(changes))
        return ApplyResult(
            ok=True, applied=done, seconds=seconds, changed=len(changes), undo_errors=undo_errors
        )

    def _undo_stale(self, planned: set[str]) -> list[str]:
        """Undo journaled steps the verified plan no longer has (a knob the config drops)."""
        errors = []
        stale = [e for sid, e in self.journal.entries.items() if sid not in planned]
        for entry in reversed(stale):
            log.info("undo %s: no longer planned", entry.step.name)
            try:
                if not self._reads_as(entry, None):
                    entry.step.undo(self.host, entry.snapshot)
                failpoint("apply.stale.after_undo")  # undone, still journaled
                self.journal.drop(entry.step.id)
            except Exception as e:
                errors.append(f"undo {entry.step.name} (no longer planned): {e}")
                log.error("undo %s failed: %s", entry.step.name, e)
        return errors

    def _reads_as(self, entry: JournalEntry, target: Step | None) -> bool:
        """Whether `entry`'s knob reads back as `target` (a step), or with None, as the
        original snapshot the journal holds. A knob that cannot be read does not."""
        try:
            if target is None:
                return entry.step.at_snapshot(self.host, entry.snapshot)
            return target.verify(self.host) is None
        except Exception as e:
            log.warning("reading back %s: %s", entry.step.name, e)
            return False

    def _unverified(self) -> list[JournalEntry]:
        """Journal entries whose knob really is off its last verified value (never
        verified: off its original): a pass failed and its rollback failed too, or a kill
        cut a pass short. An entry journaled by a pass that failed before it changed the
        knob (its apply raised, its knob reads as before) is not left off."""
        return [
            e
            for e in self.journal.entries.values()
            if e.step != e.verified and not self._reads_as(e, e.verified)
        ]

    def _unsettled(self, exclude: set[str]) -> list[tuple[Step, Step | None]]:
        """(step, its last verified version) of the entries journaled off their verified
        step and not in `exclude`, for `_restore`: an earlier rollback that failed is
        retried with this one, and one whose knob reads right has its journal settled."""
        return [
            (e.step, e.verified)
            for e in self.journal.entries.values()
            if e.step != e.verified and e.step.id not in exclude
        ]

    def _after_failure(self) -> dict[str, Any]:
        """What a failed pass left (ApplyResult fields): the knobs in force, those left
        off, and whether the last verified state is whole."""
        in_force, left_off = self._in_force(), [e.step for e in self._unverified()]
        whole = bool(in_force) and not left_off and len(in_force) == len(self.journal)
        return {"in_force": in_force, "left_off": left_off, "verified_in_force": whole}

    def _in_force(self) -> list[Step]:
        """The journaled steps at their last verified value that read back so: the state
        the node runs on after a failed pass."""
        out = []
        for e in self.journal.entries.values():
            if e.verified is None or e.step != e.verified:
                continue
            try:
                if e.verified.verify(self.host) is None:
                    out.append(e.verified)
            except Exception as err:  # a knob that cannot be read is not reported in force
                log.warning("reading back %s: %s", e.verified.name, err)
        return out

    def _restore(self, changes: list[tuple[Step, Step | None]]) -> tuple[list[str], list[str]]:
        """Put each changed step back to its last verified version, newest first; a step
        never verified goes back to its original snapshot. A knob that already reads so
        (the failed apply had no effect) is not touched: only its journal entry is
        settled, so nothing that never changed can fail to roll back."""
        rolled: list[str] = []
        errors: list[str] = []
        for step, previous in reversed(changes):
            entry = self.journal.entries.get(step.id)
            if entry is None:
                continue
            try:
                if self._reads_as(entry, previous):
                    log.info("%s still reads as before this pass: nothing to restore", step.name)
                elif previous is None:
                    failpoint(f"restore.step.{step.kind}")  # the fault tier's failing rollback
                    step.undo(self.host, entry.snapshot)
                    failpoint("restore.after_step")  # undone, still journaled
                else:
                    failpoint(f"restore.step.{step.kind}")
                    previous.apply(self.host)
                    problem = previous.verify(self.host)
                    if problem is not None:
                        raise StepError(f"read back after restoring: {problem}")
                    failpoint("restore.after_step")  # restored, journal still says the new step
                if previous is None:
                    self.journal.drop(step.id)
                else:
                    self.journal.put(previous, entry.snapshot, previous, entry.original_known)
                rolled.append(step.name)
            except Exception as e:
                errors.append(f"restore {step.name}: {e}")
                log.error("restoring %s failed: %s", step.name, e)
        return rolled, errors

    # --- drift ---------------------------------------------------------------------------
    def drift(self, plan: Plan) -> DriftResult:
        """Read back every step of `plan` the journal holds; re-apply what changed."""
        start = time.monotonic()
        result = DriftResult()
        for step in plan.steps:
            if step.id not in self.journal:
                continue
            result.checked += 1
            try:
                problem = step.check_drift(self.host)
            except Exception as e:
                problem = f"cannot read back: {e}"
            if problem is None:
                continue
            log.warning("drift on %s: %s; re-applying", step.name, problem)
            try:
                step.apply(self.host)
                after = step.verify(self.host)
                if after is not None:
                    raise StepError(after)
                result.repaired.append((step, problem))
            except Exception as e:
                result.errors.append((step, f"{problem}; repair failed: {e}"))
                log.error("repair of %s failed: %s", step.name, e)
        result.seconds = time.monotonic() - start
        return result

    # --- revert --------------------------------------------------------------------------
    def revert(self) -> RevertResult:
        start = time.monotonic()
        result = RevertResult()
        entries = list(self.journal.entries.values())
        log.info("revert: undoing %d step(s)", len(entries))
        for entry in reversed(entries):
            if not entry.original_known:
                why = (
                    "its original value was lost with an unreadable journal: left as applied "
                    "(set it by hand if the node needs its old value)"
                )
                log.warning("revert %s: %s", entry.step.name, why)
                result.left.append((entry.step.name, why))
                self.journal.drop(entry.step.id)
                continue
            try:
                if self._reads_as(entry, None):  # never applied, or already put back
                    log.info("revert %s: already as before the agent", entry.step.name)
                else:
                    failpoint(f"revert.step.{entry.step.kind}")  # the fault tier's failing undo
                    entry.step.undo(self.host, entry.snapshot)
                    failpoint("revert.after_step")  # undone, still journaled
                result.undone.append(entry.step.name)
                self.journal.drop(entry.step.id)
            except Exception as e:
                result.errors.append((entry.step.name, str(e)))
                log.error("revert %s failed: %s", entry.step.name, e)
        result.seconds = time.monotonic() - start
        return result

    def verify_all(self, plan: Plan) -> dict[str, str | None]:
        """`{step name: problem or None}` for every planned step (doctor, tests)."""
        out: dict[str, str | None] = {}
        for step in plan.steps:
            try:
                out[step.name] = step.verify(self.host)
            except Exception as e:
                out[step.name] = f"cannot read back: {e}"
        return out


def journal_summary(journal: Journal) -> list[dict[str, Any]]:
    return [e.to_json() for e in journal.entries.values()]


def verified_state_serving(result: ApplyResult | None, plan: Plan | None) -> list[Step]:
    """After a failed pass that left the last verified state whole: its steps, when that
    state serves the plan's devices as they are (a metaroce plan: its library is the one
    in force, or pods would get a version the node does not verify); else empty. A
    planned device with one of these steps keeps serving running and new jobs: its
    device plugin units stay healthy and the transport ready, while the NodeState still
    reports the failed attempt."""
    if result is None or plan is None or result.ok or not result.verified_in_force:
        return []
    if not plan.ok:
        return []
    if plan.library is not None:
        libraries = [s for s in result.in_force if isinstance(s, MetaRoceLibraryStep)]
        if all(s.directory != plan.library.directory for s in libraries):
            return []
    return list(result.in_force)
