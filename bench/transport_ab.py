"""Benchmark: two builds of metaroce-perf, A and B, interleaved on the multipath fabric.

For a protocol change: the same fabric as bench/transport_loss.py (4 x 250 Mbit/s tbf
veth links with L4 ECMP, nftables loss at the receiving side), and for each round and
each loss rate, one metaroce-perf run of A then one of B (the order alternates by
round, so a drift of the host's load favours neither). Prints every run, the medians
per build and loss, and the median of the paired ratios B / A, with the load average.

    flock /tmp/metaroce-heavy.lock python3 bench/transport_ab.py \\
        --a /tmp/base/release --b ~/.cache/metaroce/transport/target/release \\
        [--rounds 5] [--losses 0,1] [--seconds 5] [--size 1048576] [--window 16] [--mode bw|lat]

--a and --b are folders holding a metaroce-perf binary. Run as root (network
namespaces). Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "transport" / "fabric"))
sys.path.insert(0, str(ROOT / "bench"))

import fabric  # noqa: E402
from transport_loss import conditions, loadavg, perf_arm  # noqa: E402

SERVER = "{perf} server --once --config addr={{b_data}},ports=30000-30100"
CLIENT = (
    "{perf} client udp://{{b_data}}:30000 --mode {mode} --duration {{seconds}} --size {size} "
    "--window {window} --json --config addr={{a_data}},ports=31000-31100"
)
# What each mode compares: bw its goodput, lat its median round trip (and p99 beside).
METRIC = {"bw": ("goodput_mbit", "Mbit/s"), "lat": ("lat_p50_us", "us p50")}
FIELDS = (
    "packets_sent",
    "acks_rcvd",
    "retransmits",
    "spurious_retransmits",
    "rtos",
    "tlps",
    "late_losses",
    "spurious_late_losses",
)


def perf_binary(folder: str, flag: str) -> str:
    perf = Path(folder).expanduser() / "metaroce-perf"
    if not perf.is_file():
        raise SystemExit(f"{flag} {folder}: no metaroce-perf there (a cargo release folder)")
    return str(perf)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="folder with build A's metaroce-perf")
    ap.add_argument("--b", required=True, help="folder with build B's metaroce-perf")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--losses", default="0,1", help="percent, comma list")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument(
        "--mode",
        choices=sorted(METRIC),
        default="bw",
        help="bw: goodput; lat: ping-pong round trips of --size (a small message's "
        "loss recovery is what an allreduce waits on)",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: at least 1")
    builds = {"A": perf_binary(args.a, "--a"), "B": perf_binary(args.b, "--b")}
    try:
        losses = [float(x) for x in args.losses.split(",")]
    except ValueError:
        raise SystemExit(f"--losses {args.losses}: percents, e.g. 0,1") from None
    conds = conditions(losses, bursty=False)
    metric, unit = METRIC[args.mode]
    fields = FIELDS + (("lat_p99_us",) if args.mode == "lat" else ())
    runs: dict[tuple[str, str], list[float]] = {}
    start = loadavg()
    print(f"A = {builds['A']}\nB = {builds['B']}\nload average at start: {start}", flush=True)
    with fabric.MultipathFabric(name=fabric.new_name("mrab")) as fab:
        for rnd in range(args.rounds):
            for label, imps in conds:
                fab.set_impairments(imps)
                order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
                for build in order:
                    fmt = {
                        "perf": builds[build],
                        "size": args.size,
                        "window": args.window,
                        "mode": args.mode,
                    }
                    res: dict[str, Any] = perf_arm(
                        fab, SERVER.format(**fmt), CLIENT.format(**fmt), args.seconds
                    )
                    value = float(res.get(metric, 0.0))
                    runs.setdefault((build, label), []).append(value)
                    extra = ", ".join(f"{k} {res.get(k, '-')}" for k in fields)
                    err = "" if res["ok"] else f" FAILED {res.get('error', 'timed out')!r}"
                    print(
                        f"round {rnd + 1} {label:>4} {build}: {value:7.1f} {unit}"
                        f" ({extra}); load {loadavg()}{err}",
                        flush=True,
                    )
        fab.set_impairments([])
    print(f"\nmetaroce-perf {metric}, medians of {args.rounds} (load at end {loadavg()})")
    for label, _ in conds:
        a, b = runs[("A", label)], runs[("B", label)]
        paired = statistics.median(y / x if x > 0 else 0.0 for x, y in zip(a, b, strict=True))
        print(
            f"  {label:>4}: A {statistics.median(a):7.1f}  B {statistics.median(b):7.1f}"
            f"  B/A paired median {paired:.3f}  (A {a}, B {b})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
