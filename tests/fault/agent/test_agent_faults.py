"""Fault tier (agent): kill -9 the real agent at seeded failpoints, fail a step on its
second and later passes, restart, and check the node converges as the spec says.

Each seed chooses a node (softroce: rxe, tc marking, rdma_cm; mellanox: DCB, PFC, ECN),
an operation (re-apply a changed config B over a verified config A and restart on B; the
same restarted on A, a rollout undone; or revert B with cleanupOnDelete), and a fault: a
kill -9 on the Nth hit of one of the agent's failpoints or of the fake node's
`node.after_change`, a step kind whose apply (or undo) fails from this pass on
(`:error`), maybe with the rollback of another failing too, or a kill and a failing step.
The agent runs in its own process (fault_driver.py) over a fake node whose state lives
in files (fault_node.py), so what it did before the kill survives it.

For every seed, against a reference run of the same operation with the same failing steps
but no kill:
- right after the kill, no effect is duplicated (one DCB entry per DSCP, one agent filter
  per match, one rxe link per netdev, one uverbs node per device) and the journal parses;
- a restarted agent (the failing steps still failing) ends on exactly the reference's
  node, journal and report (phase, applied knobs, transport, where the errors are); no
  temporary or corrupt journal is left, and a re-apply never deleted the rxe link or the
  clsact qdisc under running jobs;
- the reference itself is what the spec says: a re-apply is Ready on B with every
  journaled knob verifying; a failed one is Failed naming the step, retried, and back on
  the last verified state (A's node and journal, A's knobs reported as applied), or, when
  a rollback failed too, is Degraded with reason RollbackIncomplete, retried, and keeps
  A's verified steps and originals journaled; a revert is Reverted with an
  empty journal and the node as before the agent, a failed one reports exactly the knobs
  it left as applied;
- once the steps stop failing, the next pass converges (B applied, or reverted).

CI runs SEEDS; `METAROCE_FAULT_SEEDS="41-300"` (or "7,9,30-40") runs others by hand.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fault_node
import pytest
from fault_driver import KILL_POINTS

from metaroce_agent.engine import Journal
from metaroce_agent.qos.tcmark import FILTER_HANDLE
from metaroce_agent.steps import step_from_record

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "fault_driver.py"
NETWORK = "rdma-a"
JOURNAL_DIR = Path("run/metaroce/agent") / NETWORK
SEEDS = list(range(1, 41))
"""The seeds CI runs: together they kill at every failpoint, in apply and revert, on both
nodes, and fail steps of most kinds (see `test_ci_seeds_cover_every_failpoint`)."""
RERUN = "METAROCE_FAULT_SEEDS={seed} .venv/bin/pytest tests/fault/agent -q -m fault"


def seeds_from_env() -> list[int]:
    text = os.environ.get("METAROCE_FAULT_SEEDS", "").strip()
    if not text:
        return SEEDS
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(
                f"METAROCE_FAULT_SEEDS: {part!r} is not a seed or a range (e.g. 7 or 1-200)"
            )
        out += list(range(int(first), int(last or first) + 1))
    return out


# --- scenarios -------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    seed: int
    profile: str
    operation: str
    """apply: re-apply B over A (restarted on B); back: the same, restarted on A (the
    rollout undone); revert: revert B (cleanupOnDelete)."""
    errors: tuple[str, ...]
    """Failpoints that fail from their first hit on: a step's apply or undo
    (apply.step.mtu, revert.step.ecn), and maybe the rollback of another
    (restore.step.tc-mark)."""
    kill: tuple[str, int] | None  # (failpoint, hit) where the agent is killed

    @property
    def phase(self) -> str:
        """The driver's phase: what the agent is doing."""
        return "revert" if self.operation == "revert" else "apply"

    @property
    def restart_config(self) -> str:
        return "a" if self.operation == "back" else "b"

    def describe(self) -> str:
        kill = f"kill -9 at {self.kill[0]} hit {self.kill[1]}" if self.kill else "no kill"
        failing = " and ".join(self.errors) or "nothing"
        restart = " restarted on config A" if self.operation == "back" else ""
        return (
            f"seed {self.seed}: {self.profile} node, {self.phase} config B{restart}, {kill}, "
            f"{failing} failing on every pass from now on; rerun: {RERUN.format(seed=self.seed)}"
        )


def hit(hits: dict[str, int], prefix: str) -> list[str]:
    """Failpoints of `prefix` the run reached."""
    return sorted(k for k, n in hits.items() if k.startswith(prefix) and n > 0)


Count = Callable[[str, str, tuple[str, ...]], dict[str, int]]


def choose(seed: int, count: Count) -> Scenario:
    """The seed's scenario; `count(profile, phase, errors)` gives the failpoint hits of
    that run without a kill, so a kill lands on a hit that happens."""
    rng = random.Random(seed)
    profile = rng.choice(["softroce", "mellanox"])
    operation = rng.choice(["apply", "apply", "revert", "back"])
    phase = "revert" if operation == "revert" else "apply"
    fault = "kill" if operation == "back" else rng.choice(["kill", "kill", "error", "error+kill"])
    errors: tuple[str, ...] = ()
    if "error" in fault:
        kinds = hit(count(profile, phase, ()), f"{phase}.step.")
        # modules are never undone: a failing module undo is no fault of the revert
        kinds = [k for k in kinds if k != "revert.step.kernel-module"]
        errors = (rng.choice(kinds),)
        if phase == "apply" and rng.random() < 0.4:  # and the rollback of a step fails
            restores = hit(count(profile, phase, errors), "restore.step.")
            errors += (rng.choice(restores),) if restores else ()
    kill = None
    if "kill" in fault:
        hits = count(profile, phase, errors)
        # where the operation itself runs (in a revert, the restarted agent's start-up
        # apply pass is not what is tested); with a failing step, in its rollback
        if phase == "revert":
            mine: tuple[str, ...] = ("revert.", "write_atomic.", "node.")
        elif errors:
            mine = ("restore.", "write_atomic.", "node.")
        else:
            mine = ("apply.", "write_atomic.", "node.")
        points = [p for p in KILL_POINTS if hits.get(p, 0) > 0 and p.startswith(mine)]
        point = rng.choice(points)
        kill = (point, rng.randint(1, hits[point]))
    return Scenario(seed, profile, operation, errors, kill)


# --- running the agent -----------------------------------------------------------------


@dataclass
class Run:
    rc: int
    out: dict[str, Any]
    log: str


class Nodes:
    """Fake nodes under one directory: a base per (profile, operation), copied per run."""

    def __init__(self, top: Path) -> None:
        self.top = top
        self._n = 0
        self._bases: dict[tuple[str, str], Path] = {}
        self._refs: dict[tuple[str, str, tuple[str, ...]], tuple[Path, Run]] = {}

    def new_dir(self, name: str) -> Path:
        self._n += 1
        d = self.top / f"{self._n:03d}-{name}"
        d.mkdir(parents=True)
        return d

    def agent(
        self, node: Path, which: str, phase: str, failpoints: str = "", count: bool = False
    ) -> Run:
        """One agent process on `node` with config `which`."""
        cfg = node / f"{which}.yaml"
        out = node / "out.json"
        out.unlink(missing_ok=True)
        env = {**os.environ, "METAROCE_FAILPOINTS": failpoints}
        argv = [sys.executable, str(DRIVER), str(node / "root"), str(cfg), str(out), phase]
        proc = subprocess.run(
            [*argv, *(["--count"] if count else [])],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        log = f"$ METAROCE_FAILPOINTS={failpoints!r} {' '.join(argv)}\n{proc.stderr[-6000:]}"
        with open(node / "agent.log", "a", encoding="utf-8") as f:
            f.write(log + "\n")
        data = json.loads(out.read_text()) if out.exists() else {}
        return Run(proc.returncode, data, log)

    def base(self, profile: str, operation: str) -> Path:
        """The node before the faulted operation: A verified (apply), or A then B
        verified (revert). Its `pre` copy is the node before the agent."""
        key = (profile, operation)
        if key not in self._bases:
            d = self.new_dir(f"base-{profile}-{operation}")
            fault_node.build_node(profile, d / "root")
            for which in ("a", "b"):
                (d / f"{which}.yaml").write_text(fault_node.config(profile, which).to_yaml())
            shutil.copytree(d, d.parent / f"{d.name}-pre", symlinks=True)
            for which in ("a", "b") if operation == "revert" else ("a",):
                run = self.agent(d, which, "apply")
                phase = (run.out.get("status") or {}).get("phase")
                assert run.rc == 0 and phase == "Ready", f"clean apply {which}: {run.log}"
            self._bases[key] = d
        return self._bases[key]

    def copy(self, base: Path, name: str) -> Path:
        self._n += 1
        d = self.top / f"{self._n:03d}-{name}"
        shutil.copytree(base, d, symlinks=True)
        (d / "agent.log").write_text("")
        (d / fault_node.COMMANDS_FILE).write_text("")  # what this run does
        return d

    def reference(
        self, profile: str, phase: str, errors: tuple[str, ...], config: str = "b"
    ) -> tuple[Path, Run]:
        """`phase` with config `config`, its failing steps and no kill, every failpoint
        counted."""
        key = (profile, f"{phase}-{config}", errors)
        if key not in self._refs:
            d = self.copy(self.base(profile, phase), f"ref-{profile}-{phase}-{config}")
            run = self.agent(d, config, phase, spec(errors, None), count=True)
            assert run.rc == 0, f"reference run: {run.log}"
            self._refs[key] = (d, run)
        return self._refs[key]

    def count(self, profile: str, phase: str, errors: tuple[str, ...]) -> dict[str, int]:
        return dict(self.reference(profile, phase, errors)[1].out["hits"])


def spec(errors: tuple[str, ...], kill: tuple[str, int] | None) -> str:
    parts = [f"{e}=1:error" for e in errors]
    if kill is not None:
        parts.append(f"{kill[0]}={kill[1]}")
    return ",".join(parts)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    return Nodes(tmp_path_factory.mktemp("fault-agent"))


# --- what is checked -------------------------------------------------------------------


def duplicated_effects(node: Path) -> list[str]:
    """Effects the node holds more than once (empty when none)."""
    state = fault_node.host_state(node / "root")
    files, kernel = state["files"], state["kernel"]
    problems = []
    for dev, pairs in kernel["dscp_prio"].items():
        for dscp, n in Counter(d for d, _ in pairs).items():
            if n > 1:
                problems.append(f"{dev}: {n} DCB APP entries for dscp {dscp}: {pairs}")
    for key, table in kernel["tc_filters"].items():
        ours = Counter(
            json.dumps(f["options"]["keys"], sort_keys=True)
            for f in table.values()
            if f["options"]["handle"] == FILTER_HANDLE
        )
        problems += [f"{key}: {n} agent filters match {m}" for m, n in ours.items() if n > 1]
    parents = Counter(
        v
        for k, v in files.items()
        if k.startswith("sys/class/infiniband/") and k.endswith("/parent")
    )
    problems += [f"{n} rxe links on {p.strip()}" for p, n in parents.items() if n > 1]
    ibdevs = Counter(
        v
        for k, v in files.items()
        if k.startswith("sys/class/infiniband_verbs/") and k.endswith("/ibdev")
    )
    problems += [f"{n} uverbs nodes for {d.strip()}" for d, n in ibdevs.items() if n > 1]
    return problems


TRAFFIC_CUTS = ("rdma link delete", "tc qdisc del")
"""Commands that cut running jobs' traffic (the rxe link, the marking filters with their
qdisc): a re-apply (or a restart) never runs them."""


def commands(node: Path) -> list[str]:
    """The state-changing commands the agent ran on `node` since it was copied."""
    return (node / fault_node.COMMANDS_FILE).read_text().splitlines()


def journal_of(node: Path) -> dict[str, Any]:
    """{step id: entry} of the journal on disk ({} when there is none)."""
    path = node / "root" / JOURNAL_DIR / "journal.json"
    if not path.exists():
        return {}
    return {e["id"]: e for e in json.loads(path.read_text())["entries"]}


def journal_litter(node: Path) -> list[str]:
    """Files beside the journal other than the journal: temporaries, corrupt copies."""
    d = node / "root" / JOURNAL_DIR
    return sorted(p.name for p in d.iterdir() if p.name != "journal.json") if d.exists() else []


def unverified(node: Path) -> list[str]:
    """Journaled steps whose knob does not read back as journaled."""
    host = fault_node.host_for(node / "root")
    journal = Journal(host, NETWORK)
    assert not journal.problem, journal.problem
    out = []
    for entry in journal.entries.values():
        problem = entry.step.verify(host)
        if problem is not None or entry.verified != entry.step:
            out.append(f"{entry.step.name}: {problem or 'journaled as not verified'}")
    return out


def status_of(run: Run) -> dict[str, Any]:
    """The NodeState status the agent would have written last."""
    return dict(run.out.get("status") or {})


def phase(run: Run) -> str:
    return str((run.out.get("status") or {}).get("phase"))


def messages(run: Run) -> str:
    status = run.out.get("status") or {}
    errors = " | ".join(f"{e['step']}: {e['message']}" for e in status.get("errors") or [])
    ready = [c.get("message", "") for c in status.get("conditions") or []]
    return f"{errors} | {' '.join(ready)}"


def ready_reason(run: Run) -> str:
    """The reason of the Ready condition the agent reported."""
    status = run.out.get("status") or {}
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return str(ready[0].get("reason")) if ready else ""


def applied_knobs(run: Run) -> set[tuple[str, str, str]]:
    """(name, device, value) of the knobs the report lists as applied."""
    qos = (run.out.get("status") or {}).get("qos") or {}
    return {(k["name"], k.get("device", ""), k.get("value", "")) for k in qos.get("applied") or []}


def applied_in(journal: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(name, device, value) of the reported knobs of a journal's verified steps."""
    steps = [step_from_record(e["verified"]) for e in journal.values() if e.get("verified")]
    return {(s.knob, s.device, s.value()[:256]) for s in steps if s.report}


def diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The keys whose values differ, for a readable failure."""
    lines = []
    for part in ("files", "kernel"):
        x, y = a[part], b[part]
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                lines.append(f"  {part} {key}: {x.get(key)!r} != {y.get(key)!r}")
    return "\n".join(lines[:30])


def kept_by_design(state: dict[str, Any]) -> dict[str, Any]:
    """A node without what a revert keeps on purpose: loaded kernel modules (never
    unloaded: others may use them) and what loading them made (device nodes, rdma_cm's
    configfs directory; what the agent made inside it still counts)."""
    kept = ("sys/module", "dev", "sys/kernel/config/rdma_cm")
    files = {
        k: v
        for k, v in state["files"].items()
        if k not in kept and not k.startswith(("sys/module/", "dev/"))
    }
    return {"files": files, "kernel": state["kernel"]}


# --- the tier --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", seeds_from_env(), ids=lambda s: f"seed{s}")
def test_agent_converges_after_fault(seed: int, nodes: Nodes) -> None:
    try:
        sc = choose(seed, nodes.count)
        base = nodes.base(sc.profile, sc.phase)
        ref_dir, ref = nodes.reference(sc.profile, sc.phase, sc.errors, sc.restart_config)
    except AssertionError as e:  # a run without a kill failed: still name the seed
        raise AssertionError(
            f"seed {seed}, setting up: {e}; rerun: {RERUN.format(seed=seed)}"
        ) from e
    why = sc.describe()
    check_reference(sc, base, ref_dir, ref)

    node = nodes.copy(base, f"seed{seed}")
    first = nodes.agent(node, "b", sc.phase, spec(sc.errors, sc.kill))
    if sc.kill is not None:
        assert first.rc == -signal.SIGKILL, f"{why}: the agent was not killed\n{first.log}"
        dups = duplicated_effects(node)
        assert not dups, f"{why}: right after the kill the node holds duplicates: {dups}"
        journal_of(node)  # parses: written atomically
        # the restarted agent; a failing step still fails
        again = nodes.agent(node, sc.restart_config, sc.phase, spec(sc.errors, None))
    else:
        again = first
    assert again.rc == 0, f"{why}: the agent exited {again.rc}\n{again.log}"
    logs = (node / "agent.log").read_text()[-8000:]

    assert not duplicated_effects(node), f"{why}: duplicates {duplicated_effects(node)}"
    have, want = fault_node.host_state(node / "root"), fault_node.host_state(ref_dir / "root")
    assert have == want, (
        f"{why}: the node differs from the run without the kill:\n{diff(have, want)}\n{logs}"
    )
    assert journal_of(node) == journal_of(ref_dir), (
        f"{why}: the journal differs from the run without the kill:\n"
        f"{json.dumps(journal_of(node), indent=1)}\n!=\n{json.dumps(journal_of(ref_dir), indent=1)}"
    )
    assert not journal_litter(node), f"{why}: left beside the journal: {journal_litter(node)}"
    assert phase(again) == phase(ref), (
        f"{why}: reported {phase(again)} ({messages(again)}), the run without the kill "
        f"reported {phase(ref)} ({messages(ref)})"
    )

    if sc.phase == "apply":  # a restart never cuts a running job's traffic
        cut = [c for c in commands(node) if c.startswith(TRAFFIC_CUTS)]
        assert not cut, f"{why}: a re-apply ran {cut}"
    for part in ("qos", "transport", "configGeneration", "reverted"):
        got, expected = status_of(again).get(part), status_of(ref).get(part)
        assert got == expected, f"{why}: reported {part} {got}, without the kill {expected}"
    steps = {e["step"] for e in status_of(again).get("errors") or []}
    want_steps = {e["step"] for e in status_of(ref).get("errors") or []}
    assert steps == want_steps, f"{why}: reported errors at {steps}, without the kill {want_steps}"

    if sc.errors:  # the fault clears: the next pass converges
        cleared = nodes.agent(node, "b", sc.phase)
        want_phase = "Ready" if sc.phase == "apply" else "Reverted"
        assert cleared.rc == 0 and phase(cleared) == want_phase, (
            f"{why}: once the step works again the agent reported {phase(cleared)} "
            f"({messages(cleared)})\n{cleared.log}"
        )
        assert not unverified(node) and not duplicated_effects(node), f"{why}: {unverified(node)}"
        if sc.phase == "revert":
            assert journal_of(node) == {}, f"{why}: journal left {list(journal_of(node))}"


def check_reference(sc: Scenario, base: Path, ref_dir: Path, ref: Run) -> None:
    """What the spec says of the run without the kill."""
    why = f"{sc.describe()} (the run without the kill)"
    status = status_of(ref)
    node, a_node = fault_node.host_state(ref_dir / "root"), fault_node.host_state(base / "root")
    journal, a_journal = journal_of(ref_dir), journal_of(base)
    if sc.operation == "back":  # config A again: its verified state, untouched
        assert phase(ref) == "Ready" and status.get("configGeneration") == 3, messages(ref)
        assert node == a_node, f"{why}: not A's verified state:\n{diff(node, a_node)}"
        # the same entries, but for a module step the plan drops once the module is loaded
        gone = {a_journal[sid]["kind"] for sid in set(a_journal) - set(journal)}
        same = all(a_journal.get(sid) == entry for sid, entry in journal.items())
        assert same and gone <= {"kernel-module"}, f"{why}: the journal is not A's"
    elif sc.phase == "apply" and not sc.errors:
        ready = phase(ref) == "Ready" and status.get("configGeneration") == 4
        assert ready, f"{why}: {messages(ref)}"
        assert not unverified(ref_dir), f"{why}: {unverified(ref_dir)}"
    elif sc.phase == "apply":
        kind = sc.errors[0].removeprefix("apply.step.")
        # a failed rollback leaves the node on neither config: Degraded, never Failed
        # (which would say the verified state is in force)
        want = "Failed" if len(sc.errors) == 1 else "Degraded"
        assert phase(ref) == want, f"{why}: reported {phase(ref)}: {messages(ref)}"
        passes = ref.out["passes"]
        assert {p["failed"] for p in passes} == {kind}, f"{why}: the passes failed: {passes}"
        assert len(passes) == 2, f"{why}: not retried: {passes}"
        assert "retry" in messages(ref) and "failpoint" in messages(ref), f"{why}: {messages(ref)}"
        if len(sc.errors) == 1:
            # the last verified state: config A's node and journal, nothing of B left
            assert node == a_node, f"{why}: not A's verified state:\n{diff(node, a_node)}"
            assert journal == a_journal, f"{why}: the journal is not A's"
            assert ready_reason(ref) == "ApplyFailed", f"{why}: {messages(ref)}"
            # and reported as such: A's knobs are the ones applied
            assert applied_knobs(ref) == applied_in(a_journal), f"{why}: {status.get('qos')}"
        else:  # a rollback failed: reported, retried, and A's state still journaled
            assert all(p["undo_errors"] for p in passes), f"{why}: rollback errors: {passes}"
            assert "rollback" in {e["step"] for e in status.get("errors") or []}, messages(ref)
            assert ready_reason(ref) == "RollbackIncomplete", f"{why}: {messages(ref)}"
            assert "rollback incomplete (retrying" in messages(ref), f"{why}: {messages(ref)}"
            for sid, entry in a_journal.items():
                kept = journal.get(sid, {})
                same = [kept.get(k) for k in ("snapshot", "verified", "originalKnown")] == [
                    entry[k] for k in ("snapshot", "verified", "originalKnown")
                ]
                assert same, f"{why}: the journal lost A's {sid}: {kept} (A: {entry})"
    elif not sc.errors:
        assert phase(ref) == "Reverted", f"{why}: reported {phase(ref)}: {messages(ref)}"
        assert journal == {}, f"{why}: journal left {list(journal)}"
        pre = base.parent / f"{base.name}-pre"
        have = kept_by_design(node)
        want = kept_by_design(fault_node.host_state(pre / "root"))
        assert have == want, f"{why}: not the node before the agent:\n{diff(have, want)}"
        # and says so: nothing applied, no transport, no complaint about what it removed
        assert not status.get("qos") or not status["qos"].get("applied"), f"{why}: {status}"
        assert not (status.get("transport") or {}).get("ready"), f"{why}: transport ready"
        assert not status.get("errors"), f"{why}: a clean revert reports {messages(ref)}"
    else:
        kind = sc.errors[0].removeprefix("revert.step.")
        assert phase(ref) != "Reverted", f"{why}: reported Reverted though {kind} failed"
        left = [e for e in journal.values() if e["kind"] == kind]
        assert left and len(left) == len(journal), (
            f"{why}: the journal should hold exactly the {kind} steps: {list(journal)}"
        )
        assert "failpoint" in messages(ref), f"{why}: the failure is not reported: {messages(ref)}"
        # reported as it is: applied are exactly the knobs the failed undo left
        reported = {
            (k["name"], k["device"]) for k in (status.get("qos") or {}).get("applied") or []
        }
        steps = [step_from_record(e) for e in journal.values()]
        left = {(s.knob, s.device) for s in steps if s.report}
        assert reported == left, f"{why}: reports {sorted(reported)} applied, {sorted(left)} are"
        assert not (status.get("transport") or {}).get("ready"), f"{why}: transport ready"


def test_ci_seeds_cover_every_failpoint(nodes: Nodes) -> None:
    """The fixed seeds kill at every failpoint, in both operations, on both nodes."""
    scenarios = [choose(s, nodes.count) for s in SEEDS]
    killed = {s.kill[0] for s in scenarios if s.kill}
    assert killed == set(KILL_POINTS), f"no CI seed kills at {set(KILL_POINTS) - killed}"
    assert {(s.profile, s.operation) for s in scenarios} == {
        (p, o) for p in ("softroce", "mellanox") for o in ("apply", "back", "revert")
    }
    assert {s.phase for s in scenarios if s.errors} == {"apply", "revert"}
    assert any(len(s.errors) == 2 for s in scenarios), "no CI seed fails a rollback"
