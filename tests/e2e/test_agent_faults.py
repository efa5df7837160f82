"""Seeded kill -9 of the node agent in the middle of an apply, a re-apply and a revert, on
a real SoftRoCE guest: whatever moment the seed picks, the next run converges, and nothing
is half-applied or duplicated (issue 15, "Faults on the real guests").

Each run starts `metaroce agent --once` (or `--revert`) and SIGKILLs it after a delay the
seed draws from the span of a calibration run (start-up included, so some kills land
before the pass, most inside it: the log's last line says where). Then the same command
runs to the end, and the node must hold exactly:

- one rxe link on eth0, one clsact qdisc and one tc filter (pref 4791) on its egress,
  rdma_cm's `default_roce_tos` of the configured DSCP;
- a journal that parses, lists every step as verified, never lost its originals
  (`originalKnown` stays true, no `.corrupt-` file);
- after a revert: none of it (no rxe link, no filter, no clsact, no journal).

`METAROCE_FAULT_SEED` (default 15) and `METAROCE_FAULT_RUNS` (kills per scenario, default
3) make a run repeatable; the seed and each kill's delay and landing point are printed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

NETWORK = "faults"
CONFIG = "/tmp/faults-agent.yaml"
LOG = "/tmp/faults-agent.log"
STATE = f"/run/metaroce/agent/{NETWORK}"
CM = "/sys/kernel/config/rdma_cm/rxe_eth0/ports/1"
AGENT = (
    f"python3 -m metaroce_agent agent --config {CONFIG} --no-report --no-probe "
    "--no-device-plugin --require-pyverbs --log-level info"
)
SEED = int(os.environ.get("METAROCE_FAULT_SEED", "15"))
RUNS = int(os.environ.get("METAROCE_FAULT_RUNS", "3"))


def config(dscp: int) -> str:
    return (
        f"network: {NETWORK}\ngeneration: {dscp}\nresourceName: metaroce.io/{NETWORK}\n"
        "nics: {interfaceNames: [eth0]}\ntransport: {mode: softroce}\n"
        f"qos: {{profile: lossless, data: {{dscp: {dscp}, priority: 3}}}}\n"
        "driftInterval: 1h\n"
    )


def sh(g: Any, cmd: str, timeout: float = 120) -> str:
    r = g.run(cmd, timeout=timeout)
    assert r.returncode == 0, f"`{cmd}` failed: {r.stdout}{r.stderr}"
    return str(r.stdout)


def clean(g: Any) -> None:
    sh(g, f"bash /share/bench/agent_apply_script.sh undo eth0 26 3 {NETWORK}")


def node_state(g: Any) -> dict[str, Any]:
    """What is on the node, counted."""

    def count(cmd: str) -> int:
        return int(sh(g, f"{cmd} | grep -c {pattern(cmd)} || true").split()[0])

    def pattern(cmd: str) -> str:
        return {"rdma": "'netdev eth0 *$'", "tc q": "clsact", "tc f": "'handle 0x4d52'"}[cmd[:4]]

    journal = sh(g, f"cat {STATE}/journal.json 2>/dev/null || true").strip()
    return {
        "links": count("rdma link show"),
        "clsact": count("tc qdisc show dev eth0"),
        "filters": count("tc filter show dev eth0 egress"),
        "tos": sh(g, f"cat {CM}/default_roce_tos 2>/dev/null || echo none").strip(),
        "journal": json.loads(journal) if journal else None,
        "corrupt": int(sh(g, f"ls {STATE} 2>/dev/null | grep -c corrupt || true").split()[0]),
    }


def assert_applied(st: dict[str, Any], dscp: int, what: str) -> None:
    assert (st["links"], st["clsact"], st["filters"]) == (1, 1, 1), f"{what}: {st}"
    assert st["tos"] == str(dscp << 2), f"{what}: {st}"
    assert st["corrupt"] == 0, f"{what}: a journal was lost: {st}"
    entries = (st["journal"] or {}).get("entries") or []
    assert entries, f"{what}: no journal: {st}"
    for e in entries:
        assert e.get("originalKnown", True), f"{what}: originals lost: {e}"
        assert e.get("verified") is not None, f"{what}: not verified: {e}"


def assert_reverted(st: dict[str, Any], what: str) -> None:
    assert (st["links"], st["clsact"], st["filters"]) == (0, 0, 0), f"{what}: {st}"
    assert st["journal"] is None or not st["journal"].get("entries"), f"{what}: {st}"


def run_to_end(g: Any, args: str) -> str:
    r = g.run(f"{AGENT} {args} >>{LOG} 2>&1; echo rc=$?", timeout=300)
    assert "rc=0" in r.stdout, f"{args}: {r.stdout}\n{sh(g, f'tail -n 30 {LOG}')}"
    return str(r.stdout)


def calibrate(g: Any, args: str) -> float:
    """Wall seconds of one uninterrupted run of `args`."""
    t0 = time.monotonic()
    run_to_end(g, args)
    return time.monotonic() - t0


def kill_at(g: Any, args: str, delay: float) -> str:
    """Start `args`, SIGKILL it after `delay` s; the log line it was at."""
    sh(g, f": >{LOG}")
    job = g.start(f"exec {AGENT} {args} >>{LOG} 2>&1")
    time.sleep(delay)
    result = job.kill(signal.SIGKILL, timeout=5)
    lines = [ln for ln in sh(g, f"cat {LOG}").splitlines() if ln.strip()]
    ended = f"exited {result.returncode} first" if result.returncode != -9 else "killed"
    return f"{ended} after {delay:.2f} s at: {(lines or ['(nothing logged)'])[-1][-140:]}"


def test_kill_9_anywhere_in_apply_reapply_and_revert_converges(node1: Any) -> None:
    g = node1
    rng = random.Random(SEED)
    print(f"\nfault runs: seed {SEED}, {RUNS} kill(s) per scenario")
    clean(g)
    try:
        # 1. first apply, killed anywhere; the next run converges
        g.write_file(CONFIG, config(26))
        span = calibrate(g, "--once")
        assert_applied(node_state(g), 26, "calibration")
        for i in range(RUNS):
            clean(g)
            where = kill_at(g, "--once", rng.uniform(0.3, span))
            run_to_end(g, "--once")
            print(f"  apply {i + 1}: {where}")
            assert_applied(node_state(g), 26, f"apply, kill {i + 1} ({where})")
        # 2. re-apply 26 -> 34 and back, killed anywhere: converges to the configured DSCP
        for i in range(RUNS):
            dscp = (34, 26)[i % 2]
            g.write_file(CONFIG, config(dscp))
            where = kill_at(g, "--once", rng.uniform(0.3, span))
            run_to_end(g, "--once")
            print(f"  re-apply to {dscp} {i + 1}: {where}")
            assert_applied(node_state(g), dscp, f"re-apply, kill {i + 1} ({where})")
        # 3. revert, killed anywhere: the next revert leaves nothing of the agent's
        revert_span = calibrate(g, "--revert")
        assert_reverted(node_state(g), "revert calibration")
        for i in range(RUNS):
            run_to_end(g, "--once")
            where = kill_at(g, "--revert", rng.uniform(0.3, revert_span))
            run_to_end(g, "--revert")
            print(f"  revert {i + 1}: {where}")
            assert_reverted(node_state(g), f"revert, kill {i + 1} ({where})")
    finally:
        clean(g)
