"""Benchmarks of the node agent on real SoftRoCE, side by side in one run of two guests.

1. apply: like with like, whole process against whole process: `metaroce agent --once`
   (start-up, discovery, capability probes, plan, apply, read-back, rediscovery) against
   a plain shell script doing the same kernel operations (bench/agent_apply_script.sh),
   alternating runs from the same clean state in the same guest. Also the agent's pass
   (discovery to rediscovery, forking the same tools) against the script, and the
   Python start-up on its own: on a TCG guest the start-up (imports) dominates.
2. ib_write_bw node-1 -> node-2: untuned (bare rxe links made by hand, no agent) vs the
   agent running (its tc DSCP marking rewrites every RoCE packet), runs interleaved.
   Budget: agent / bare >= 0.95. (There is no lossy arm: on SoftRoCE the lossy and
   lossless profiles leave the same node state, since virtio has no DCB or PFC.)
3. idle agent: CPU over a minute (utime+stime from /proc, two drift passes included) and
   memory (RSS and PSS from smaps_rollup). Budgets: < 1 % of a core, < 100 MB RSS.

The agent runs with --no-report (no apiserver here): apply, drift timer and metrics
server are all live; the RDMA probe needs peers from the API and is measured in the e2e
test instead. TCG guests are 10-20x slower than hardware: ratios are what count.

    .venv/bin/python bench/agent_guest_bench.py [--reps 3] [--bw-seconds 8]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from metaroce_harness.guests import GuestCluster

SCRIPT = "/share/bench/agent_apply_script.sh"
BW_OPTS = "-s 8192 -t 16 -u 20"
"""8 KiB writes, 16 outstanding, long ACK timeout: the TCG guests' emulated L2 drops
bursts of 64 KiB writes and RC then gives up (retry exceeded), with or without agent."""
AGENT = (
    "python3 -m metaroce_agent agent --config /tmp/bench-agent.yaml --no-report --require-pyverbs"
)


def config(profile: str, drift: str = "30s") -> str:
    return (
        "network: bench\ngeneration: 1\nresourceName: metaroce.io/bench\n"
        "nics: {interfaceNames: [eth0]}\ntransport: {mode: softroce}\n"
        f"qos: {{profile: {profile}}}\ndriftInterval: {drift}\n"
    )


def clean(g: Any) -> None:
    g.run(f"bash {SCRIPT} undo eth0 26 3 bench", timeout=120, check=True)


def timed(g: Any, cmd: str, timeout: float = 300) -> tuple[float, Any]:
    r = g.run(
        f"s=$(date +%s.%N); {cmd}; rc=$?; e=$(date +%s.%N); echo WALL $s $e; exit $rc",
        timeout=timeout,
    )
    m = re.search(r"WALL (\S+) (\S+)", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(2)) - float(m.group(1)), r


def bench_apply(g: Any, reps: int) -> dict[str, Any]:
    g.write_file("/tmp/bench-agent.yaml", config("lossless"))
    g.run(f"bash {SCRIPT} apply eth0 26 3 && bash {SCRIPT} undo eth0 26 3 bench", timeout=120)
    script, apply, passes, startup, process = [], [], [], [], []
    for i in range(reps):
        clean(g)
        wall, r = timed(g, f"bash {SCRIPT} apply eth0 26 3")
        assert r.returncode == 0, r.stderr
        script.append(wall)
        clean(g)
        wall, r = timed(g, f"{AGENT} --once --log-level warning 2>&1")
        m = re.search(r"^timings (\{.*\})$", r.stdout, re.M)
        assert r.returncode == 0 and m, r.stdout[-2000:]
        t = json.loads(m.group(1))
        process.append(wall)
        apply.append(t["apply"])
        passes.append(t["total"])
        startup.append(wall - t["total"])
        print(
            f"  rep {i + 1}: script {script[-1]:.2f} s, agent process {process[-1]:.2f} s "
            f"(start-up {startup[-1]:.1f} s, pass {passes[-1]:.2f} s, apply {apply[-1]:.2f} s)",
            flush=True,
        )
    clean(g)
    med = statistics.median
    return {
        "script_s": med(script),
        "agent_process_s": med(process),
        "agent_apply_s": med(apply),
        "agent_pass_s": med(passes),
        "python_startup_s": med(startup),
        "process_ratio": med(process) / med(script),
        "pass_ratio": med(passes) / med(script),
    }


def write_bw(guests: Any, seconds: int) -> float:
    a, b = guests[0], guests[1]
    opts = f"-d rxe_eth0 -x 1 -D {seconds} {BW_OPTS}"
    server = b.start(f"exec timeout {seconds + 60} ib_write_bw {opts}")
    time.sleep(3)
    r = a.run(
        f"timeout {seconds + 50} ib_write_bw {opts} {b.ip}",
        timeout=seconds + 70,
    )
    server.wait(seconds + 70)
    assert r.returncode == 0, r.stdout + r.stderr
    # "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]"
    m = re.search(r"^\s*8192\s+\d+\s+[\d.]+\s+([\d.]+)", r.stdout, re.M)
    assert m, r.stdout
    return float(m.group(1))


def start_agents(guests: Any, profile: str) -> list[Any]:
    jobs = []
    for g in guests:
        g.write_file("/tmp/bench-agent.yaml", config(profile))
        jobs.append(g.start(f"exec {AGENT} --metrics-port 9478 >>/tmp/bench-agent.log 2>&1"))
    for g in guests:
        for _ in range(120):
            r = g.run(
                "cat /sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos "
                "2>/dev/null; tc filter show dev eth0 egress | grep -c 4791",
                timeout=30,
            )
            if r.stdout.split()[:1] == ["104"] and r.stdout.split()[-1] != "0":
                break
            time.sleep(1)
        else:
            raise RuntimeError(
                f"agent on {g.name} did not apply:\n{g.run('tail /tmp/bench-agent.log').stdout}"
            )
    return jobs


def bench_bw(guests: Any, reps: int, seconds: int) -> dict[str, Any]:
    results: dict[str, list[float]] = {"untuned": [], "lossless": []}
    for i in range(reps):
        for mode in results:
            for g in guests:
                clean(g)
            jobs = []
            if mode == "untuned":
                for g in guests:
                    g.run(
                        "modprobe rdma_rxe && rdma link add rxe_eth0 type rxe netdev eth0",
                        timeout=60,
                        check=True,
                    )
            else:
                jobs = start_agents(guests, mode)
            results[mode].append(write_bw(guests, seconds))
            for j in jobs:
                j.kill()
            print(f"  rep {i + 1} {mode}: {results[mode][-1]:.2f} MB/s", flush=True)
    for g in guests:
        clean(g)
    med = {k: statistics.median(v) for k, v in results.items()}
    spread = {k: max(v) / min(v) for k, v in results.items() if min(v) > 0}
    return {
        "samples_MBps": results,
        "spread_max_over_min": spread,
        **{f"{k}_MBps": v for k, v in med.items()},
        "agent_over_bare": med["lossless"] / med["untuned"],
    }


def proc_cpu(g: Any, pid: int) -> float:
    fields = g.run(f"cat /proc/{pid}/stat", timeout=30).stdout.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime (USER_HZ 100)


def bench_idle(g: Any, seconds: int, drift: str = "30s") -> dict[str, Any]:
    clean(g)
    g.write_file("/tmp/bench-agent.yaml", config("lossless", drift=drift))
    job = g.start(f"exec {AGENT} --metrics-port 9478 >/tmp/bench-idle.log 2>&1")
    for _ in range(180):
        if "apply:" in g.run("cat /tmp/bench-idle.log", timeout=30).stdout:
            break
        time.sleep(1)
    time.sleep(5)
    pid = int(g.run("pgrep -f 'metaroce_agent agent'", timeout=30).stdout.split()[0])
    c0, t0 = proc_cpu(g, pid), time.monotonic()
    time.sleep(seconds)
    c1, t1 = proc_cpu(g, pid), time.monotonic()
    mem = g.run(f"cat /proc/{pid}/smaps_rollup", timeout=30).stdout
    rss = int(re.search(r"^Rss:\s+(\d+) kB", mem, re.M).group(1)) / 1024  # type: ignore[union-attr]
    pss = int(re.search(r"^Pss:\s+(\d+) kB", mem, re.M).group(1)) / 1024  # type: ignore[union-attr]
    drift = g.run("grep -c 'drift\\|apply pass' /tmp/bench-idle.log || true", timeout=30).stdout
    job.kill()
    clean(g)
    return {
        "drift_interval": drift,
        "idle_cpu_percent": 100 * (c1 - c0) / (t1 - t0),
        "rss_MB": rss,
        "pss_MB": pss,
        "window_s": t1 - t0,
        "log_lines_with_passes": drift.strip(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bw-seconds", type=int, default=8)
    ap.add_argument("--idle-seconds", type=int, default=60)
    ap.add_argument("--drift", default="30s", help="drift interval of the idle agent")
    ap.add_argument("--only", choices=["apply", "idle", "bw"], action="append")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    with GuestCluster(count=2, memory_mb=1024) as guests:
        sections: tuple[tuple[str, str, Callable[[], dict[str, Any]]], ...] = (
            ("apply", "apply pass (node-1)", partial(bench_apply, guests[0], args.reps)),
            (
                "idle",
                f"idle agent (node-1, {args.idle_seconds} s)",
                partial(bench_idle, guests[0], args.idle_seconds, args.drift),
            ),
            (
                "bw",
                "ib_write_bw node-1 -> node-2",
                partial(bench_bw, guests, args.reps, args.bw_seconds),
            ),
        )
        sections = tuple(x for x in sections if not args.only or x[0] in args.only)
        for key, title, run in sections:
            print(f"{title}:", flush=True)
            try:
                results[key] = run()
            except Exception as e:  # report what was measured, and what broke
                print(f"  FAILED: {type(e).__name__}: {e}", flush=True)
    print("\nresults")
    apply, bw, idle = results.get("apply"), results.get("bw"), results.get("idle")
    if apply:
        print(
            f"  apply: agent process {apply['agent_process_s']:.2f} s vs script process "
            f"{apply['script_s']:.2f} s -> ratio {apply['process_ratio']:.2f}; agent pass "
            f"{apply['agent_pass_s']:.2f} s (apply {apply['agent_apply_s']:.2f} s) vs script "
            f"-> {apply['pass_ratio']:.2f}; Python start-up {apply['python_startup_s']:.1f} s"
        )
    if bw:
        print(
            f"  ib_write_bw: untuned {bw['untuned_MBps']:.2f} MB/s, agent "
            f"{bw['lossless_MBps']:.2f} -> agent/bare {bw['agent_over_bare']:.3f} "
            f"(budget >= 0.95); run-to-run spread (max/min) {bw['spread_max_over_min']}: a "
            "ratio inside the spread says nothing"
        )
    if idle:
        print(
            f"  idle agent: {idle['idle_cpu_percent']:.2f} % of a core (budget < 1), RSS "
            f"{idle['rss_MB']:.1f} MB (budget < 100), PSS {idle['pss_MB']:.1f} MB"
        )
    print(json.dumps(results, indent=1))
    return 0 if len(results) == len(sections) else 1


if __name__ == "__main__":
    raise SystemExit(main())
