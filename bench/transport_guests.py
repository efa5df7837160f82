"""Benchmark: metaroce-perf beside ib_write_bw (rxe) between two SoftRoCE guests under netem.

Two qemu (TCG) guests on the harness's private L2. Both arms run node-1 -> node-2 over
eth0 with the same impairment, as netem on both guests' eth0 (data and ACK directions):

- metaroce: ``metaroce-perf client --json`` (1 MiB messages, 16 in flight), the host's
  release binary shared into the guests;
- rxe: ``ib_write_bw`` RC writes over rdma_rxe (go-back-N), flags in
  ``metaroce_harness.guest_transport.BENCH_RXE_FLAGS`` (a 0.54 s ACK timeout).

``--runs`` rounds; each round runs every level (lossless first, then each ``--loss``)
once per arm, arms interleaved, so a drift in the emulated guests' speed lands on every
level alike (run as blocks, lossless then 1%, one build gave 0.51 and 0.95 in two
sessions). The table gives medians, every run's figure, each arm's ratio to its own
lossless median (the issue's figure: metaroce >= 0.85 at 1%), and the paired ratio: the
median over rounds of each round's run over the same round's lossless run. The lossless
arm has the same netem delay, so the ratio isolates the loss. With ``--red`` a last section
shapes node-1's egress with htb + RED ``ecn`` and reports metaroce's CE marks, RED's
marks and the goodput against the shaped rate. TCG guests are 10-20x slower than
hardware: absolute figures are of emulated guests; ratios are what count.

    flock /tmp/metaroce-heavy.lock .venv/bin/python bench/transport_guests.py \
        [--runs 3] [--seconds 10] [--loss 1 --loss 3] [--delay-ms 1] [--red] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from metaroce_harness.guest_transport import (
    BENCH_RXE_FLAGS,
    clear_qdisc,
    ensure_rxe,
    ib_write_bw,
    load_average,
    metaroce_perf,
    paired_ratios,
    red_marked,
    set_netem,
    set_red_bottleneck,
    stage_perf,
    tune_socket_buffers,
)
from metaroce_harness.guests import Guest, GuestCluster

PERF_FIELDS = (
    "goodput_gbps",
    "bytes",
    "seconds",
    "packets_sent",
    "retransmits",
    "spurious_retransmits",
    "ce_marks",
    "rtos",
    "sock_rcvbuf",
)
"""metaroce-perf's report fields each run keeps."""


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def new_level(loss: float, delay_ms: float) -> dict[str, Any]:
    """One loss level's record; ``measure_run`` appends each round's runs to it."""
    return {
        "loss_percent": loss,
        "delay_ms": delay_ms,
        "arms": {
            "metaroce": {"gbps": [], "runs": [], "failures": []},
            "rxe": {"gbps": [], "failures": []},
        },
        "load_average": [],
    }


def measure_run(
    client: Guest,
    server: Guest,
    perf: Path,
    level: dict[str, Any],
    round_no: int,
    seconds: int,
    config: str = "",
    rxe_flags: str = BENCH_RXE_FLAGS,
) -> None:
    """One run of each arm at ``level``'s netem loss, appended to ``level``; a failed
    metaroce run appends None (rounds stay aligned for the paired ratio)."""
    loss, arms = level["loss_percent"], level["arms"]
    for g in (client, server):
        set_netem(g, loss, level["delay_ms"])
    tag = f"  round {round_no} loss {loss}%"
    try:
        r = metaroce_perf(client, server, perf, seconds, config=config)
        arms["metaroce"]["gbps"].append(r.gbps)
        rep = r.report
        arms["metaroce"]["runs"].append({k: rep[k] for k in PERF_FIELDS})
        print(
            f"{tag}: metaroce {r.gbps:.3f} Gb/s (retx {rep['retransmits']}, "
            f"spurious {rep['spurious_retransmits']}, rtos {rep['rtos']}, "
            f"pkts {rep['packets_sent']})",
            flush=True,
        )
    except AssertionError as e:
        arms["metaroce"]["gbps"].append(None)
        arms["metaroce"]["failures"].append(str(e)[-1500:])
        print(f"{tag}: metaroce FAILED: {str(e)[-400:]}", flush=True)
    try:
        bw = ib_write_bw(client, server, seconds, attempts=1, flags=rxe_flags)
        arms["rxe"]["gbps"].append(bw)
        print(f"{tag}: rxe      {bw:.3f} Gb/s", flush=True)
    except AssertionError as e:
        arms["rxe"]["failures"].append(str(e)[-1500:])
        arms["rxe"]["gbps"].append(0.0)  # RC gave up (retry exceeded): no goodput
        print(f"{tag}: rxe      FAILED (counted 0): {str(e)[-300:]}", flush=True)
    level["load_average"].append(load_average())


def summarize(levels: list[dict[str, Any]]) -> None:
    """Each arm's median, ratio to its lossless median, and paired ratio, into ``levels``."""
    base_runs = {arm: levels[0]["arms"][arm]["gbps"] for arm in ("metaroce", "rxe")}
    for level in levels:
        for arm in level["arms"].values():
            arm["median_gbps"] = _median([x for x in arm["gbps"] if x is not None])
    for level in levels:
        for name, arm in level["arms"].items():
            base = levels[0]["arms"][name]["median_gbps"]
            med = arm["median_gbps"]
            arm["ratio_to_lossless"] = med / base if med is not None and base else None
            arm["paired_ratios"] = paired_ratios(arm["gbps"], base_runs[name])
            arm["paired_ratio"] = _median(arm["paired_ratios"])


def measure_red(
    client: Guest, server: Guest, perf: Path, rate_mbit: int, delay_ms: float, seconds: int
) -> dict[str, Any]:
    """metaroce-perf through an htb bottleneck at ``rate_mbit`` with a RED ``ecn`` leaf on
    the client's egress (netem delay on the server's, for the ACK path)."""
    for g in (client, server):
        clear_qdisc(g)
    set_netem(server, 0, delay_ms)
    qdisc = set_red_bottleneck(client, rate_mbit, delay_ms=0)
    before = red_marked(client)
    r = metaroce_perf(client, server, perf, seconds)
    after = red_marked(client)
    rep = r.report
    return {
        "rate_mbit": rate_mbit,
        "goodput_gbps": r.gbps,
        "goodput_over_rate": r.gbps * 1000 / rate_mbit,
        "ce_marks_seen_by_receiver": rep["ce_marks"],
        "red_marked": after.get("marked", 0) - before.get("marked", 0),
        "red_early_drops": after.get("early", 0) - before.get("early", 0),
        "retransmits": rep["retransmits"],
        "packets_sent": rep["packets_sent"],
        "rtos": rep["rtos"],
        "qdisc": qdisc,
        "load_average": load_average(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="rounds; each runs every level once per arm")
    p.add_argument("--seconds", type=int, default=10, help="seconds per run")
    p.add_argument("--loss", type=float, action="append", help="netem loss %% (default 1 and 3)")
    p.add_argument("--delay-ms", type=float, default=1.0, help="netem delay on each guest")
    p.add_argument("--red", action="store_true", help="also the htb + RED ecn bottleneck")
    p.add_argument(
        "--red-rate-mbit",
        type=int,
        default=0,
        help="RED bottleneck rate (default: half metaroce's lossless median)",
    )
    p.add_argument("--config", default="", help="metaroce-perf --config K=V,... (both ends)")
    p.add_argument("--rxe-flags", default=BENCH_RXE_FLAGS, help="ib_write_bw's flags")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    p.add_argument(
        "--perf-dir",
        type=Path,
        help="a folder holding the metaroce-perf to run (default: the release build, "
        "built first): for comparing two builds",
    )
    args = p.parse_args(argv)
    if args.runs < 1 or args.seconds < 1:
        p.error(f"--runs {args.runs} / --seconds {args.seconds}: both must be at least 1")
    losses = args.loss or [1.0, 3.0]
    if any(not 0 < x < 100 for x in losses):
        p.error(f"--loss {losses}: each must be a percentage between 0 and 100 (exclusive)")
    results: dict[str, Any] = {
        "runs": args.runs,
        "seconds": args.seconds,
        "ib_write_bw_flags": args.rxe_flags,
        "metaroce_config": args.config,
        "load_average_start": load_average(),
        "levels": [],
    }
    print(f"load average at start: {results['load_average_start']}", flush=True)
    perf = stage_perf(args.perf_dir)
    t0 = time.monotonic()
    with GuestCluster(count=2, memory_mb=1024) as guests:
        client, server = guests[0], guests[1]
        for g in guests:
            tune_socket_buffers(g)
            ensure_rxe(g)
        results["levels"] = [new_level(x, args.delay_ms) for x in (0.0, *losses)]
        for i in range(1, args.runs + 1):
            for level in results["levels"]:
                measure_run(
                    client, server, perf, level, i, args.seconds, args.config, args.rxe_flags
                )
        summarize(results["levels"])
        if args.red:
            base = results["levels"][0]["arms"]["metaroce"]["median_gbps"] or 0.2
            rate = args.red_rate_mbit or max(20, int(base * 1000 / 2))
            print(f"RED ecn bottleneck at {rate} Mbit/s on node-1's egress:", flush=True)
            try:
                results["red"] = measure_red(
                    client, server, perf, rate, args.delay_ms, args.seconds
                )
            except AssertionError as e:
                results["red"] = {"rate_mbit": rate, "failed": str(e)[-1500:]}
        for g in guests:
            clear_qdisc(g)
    results["wall_seconds"] = round(time.monotonic() - t0, 1)
    results["load_average_end"] = load_average()

    print(
        "\nresults (medians; Gb/s; ratio = goodput / the same arm's lossless median; "
        "paired = median over rounds of the run / the same round's lossless run)"
    )
    print(
        f"  {'netem loss':>10}  {'metaroce':>9} {'ratio':>6} {'paired':>6}  "
        f"{'rxe':>9} {'ratio':>6} {'paired':>6}  runs"
    )
    for level in results["levels"]:
        row = [f"  {level['loss_percent']:>9}%"]
        runs = []
        for arm in ("metaroce", "rxe"):
            a = level["arms"][arm]
            row.append(
                f"{_fmt(a['median_gbps']):>9} {_fmt(a['ratio_to_lossless'], '.2f'):>6} "
                f"{_fmt(a['paired_ratio'], '.2f'):>6}"
            )
            runs.append(
                f"{arm} " + ",".join("failed" if x is None else f"{x:.3f}" for x in a["gbps"])
            )
        loads = ", ".join(str(x) for x in level["load_average"])
        print("  ".join(row) + "  " + "; ".join(runs) + f"  (load {loads})")
    red = results.get("red")
    if red and "failed" not in red:
        print(
            f"  RED ecn at {red['rate_mbit']} Mbit/s: metaroce {red['goodput_gbps']:.3f} Gb/s "
            f"= {red['goodput_over_rate']:.2f} of the rate; CE seen by the receiver "
            f"{red['ce_marks_seen_by_receiver']}, RED marked {red['red_marked']}, RED early "
            f"drops {red['red_early_drops']}, retransmits {red['retransmits']}"
        )
    elif red:
        print(f"  RED: FAILED {red['failed'][-400:]}")
    print(
        f"  load average: start {results['load_average_start']}, end {results['load_average_end']}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"  JSON: {args.json}")
    else:
        print(json.dumps(results, indent=1))
    failed = any(lv["arms"]["metaroce"]["failures"] for lv in results["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
