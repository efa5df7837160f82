"""Benchmark: transports side by side under the same loss on the namespace multipath fabric.

One run, one fabric (transport/fabric/fabric.py: 4 x 250 Mbit/s tbf veth links with L4
ECMP, a control link), the same nftables rules for every arm:
  arms      udp;ofi_rxd and tcp;ofi_rxm (Debian's libfabric 1.17), and metaroce when
            --metaroce-provider-path has libmetaroce-fi.so (and --metaroce-perf-* given)
  capacity  4 independent iperf3 UDP floods at once, one pinned per link: the RECEIVED
            payload rate, not the tbf configuration
  goodput   per arm at 0, 0.1, 1, 3, 10 % random loss and bursty loss (1 % average, runs
            of 16 packets: fabric.BURSTY): fi_pingpong -e rdm -m tagged -S SIZE -I N -c
            (data checked; Debian ships no fabtests bandwidth tool, see clients.py) and an
            osu_bw-style Open MPI stream (mpi_checks.py bandwidth, a window of 16 Isend);
            ratios to the arm's own lossless goodput and to the measured capacity; CPU-s
            per GB of the two fi_pingpong processes (getrusage) and of softirq (/proc/stat)
  allreduce Open MPI (pml cm, mtl ofi, 2 ranks per namespace) median and p99 per size,
            1 KiB..64 MiB, data checked, at 0 and 1 % loss (and --allreduce-losses)
  rounds    --rounds N repeats capacity and the goodput conditions N times, interleaved
            (this 2-core host swings 0.65-1.0 between single runs minutes apart): the
            tables show each cell's median run, and a last table every round's ratios
            (to its own lossless run and to its own capacity) with their median
Every client runs under a timeout: a stalled arm is reported as stalled, never hangs.
Prints tables with the load average, writes JSON and an SVG goodput-vs-loss plot.

    flock /tmp/metaroce-heavy.lock python3 bench/transport_loss.py [--quick]
        [--arms udp,tcp[,metaroce]] [--losses 0,0.1,1,3,10] [--no-bursty]
        [--metaroce-provider-path DIR] [--metaroce-perf-server CMD --metaroce-perf-client CMD]
        [--json PATH] [--svg PATH] [--allreduce-idle-timeout 200] [--rounds N]
        [--allreduce-losses 0,1 | --allreduce-losses none] [--allreduce-rounds N]
Run as root (network namespaces). Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "transport" / "fabric"))

import clients  # noqa: E402
import fabric  # noqa: E402
import mpirun  # noqa: E402

ARMS = {"udp": "udp;ofi_rxd", "tcp": "tcp;ofi_rxm", "metaroce": "metaroce"}
CHECKS = str(ROOT / "transport" / "fabric" / "mpi_checks.py")
SIZES_FULL = [
    1 << 10,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    8 << 20,
    16 << 20,
    64 << 20,
]
SIZES_QUICK = [1 << 10, 64 << 10, 1 << 20, 8 << 20]
BURSTY_LABEL = "bursty 1%"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def human(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def conditions(losses: list[float], bursty: bool) -> list[tuple[str, list[fabric.Impairment]]]:
    out: list[tuple[str, list[fabric.Impairment]]] = []
    for pct in losses:
        per = round(pct * 100)
        out.append((f"{pct:g}%", [fabric.Impairment("drop", per)] if per else []))
    if bursty:
        out.append((BURSTY_LABEL, [fabric.Impairment("burst", 100, burst_len=16)]))
    return out


def loss_seen(
    before: dict[str, Any], after: dict[str, Any], fab: fabric.MultipathFabric
) -> dict[str, int]:
    """Where the loss was during one measurement: nft drops and tbf drops, per side."""
    out: dict[str, int] = {}
    for role in fab.roles():
        out[f"nft_drop_{role}"] = sum(
            after[role]["nft"][f"drop_{d}"]["packets"] - before[role]["nft"][f"drop_{d}"]["packets"]
            for d in fab.data_links()
        )
        out[f"tbf_drop_{role}"] = sum(
            after[role]["tbf"][d]["dropped"] - before[role]["tbf"][d]["dropped"]
            for d in fab.data_links()
        )
        out[f"seen_{role}"] = sum(
            after[role]["nft"][f"seen_{d}"]["packets"] - before[role]["nft"][f"seen_{d}"]["packets"]
            for d in fab.data_links()
        )
    out["softnet_drop"] = after["host"]["softnet_dropped"] - before["host"]["softnet_dropped"]
    return out


def pingpong(
    fab: fabric.MultipathFabric, prov: str, size: int, iters: int, timeout: float, path: str | None
) -> dict[str, Any]:
    before = fab.counters()
    res = clients.run_pingpong(fab, prov, size, iters, timeout=timeout, provider_path=path)
    d: dict[str, Any] = res.as_dict()
    d["loss"] = loss_seen(before, fab.counters(), fab)
    if not res.ok and not res.timed_out:
        d["error"] = res.output[-2000:]
    return d


def mpi_bandwidth(
    fab: fabric.MultipathFabric, prov: str, seconds: float, path: str | None
) -> dict[str, Any]:
    argv = [mpirun.MPI_PYTHON, CHECKS, "bandwidth", str(1 << 20), str(seconds)]
    res = mpirun.run_mpi(
        fab,
        prov,
        argv,
        ranks_per_ns=1,
        timeout=seconds + 60,
        provider_path=path,
        idle_timeout=seconds + 45,
    )
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    if res.timed_out or not rows:
        return {
            "ok": False,
            "timed_out": res.timed_out,
            "mbit_s": 0.0,
            "error": (res.stdout + res.stderr)[-1500:],
        }
    return {"ok": True, "timed_out": False, **rows[0]}


def perf_arm(
    fab: fabric.MultipathFabric, server: str, client: str, seconds: float
) -> dict[str, Any]:
    """metaroce-perf (the lead's tool): server in B, client in A. The templates get
    {a_data} {b_data} {a_ctl} {b_ctl} {seconds}; the client prints JSON (last line) with
    `goodput_mbit` (other fields are kept)."""
    keys = {
        "a_data": fab.data_addr("a"),
        "b_data": fab.data_addr("b"),
        "a_ctl": fab.ctl_addr("a"),
        "b_ctl": fab.ctl_addr("b"),
        "seconds": seconds,
    }
    srv = subprocess.Popen(
        fab.exec_argv("b", shlex.split(server.format(**keys))),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    try:
        p = subprocess.run(
            fab.exec_argv("a", shlex.split(client.format(**keys))),
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "timed_out": True, "goodput_mbit": 0.0}
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        return {
            "ok": False,
            "timed_out": False,
            "goodput_mbit": 0.0,
            "error": (p.stdout + p.stderr)[-1500:],
        }
    doc: dict[str, Any] = json.loads(lines[-1])
    return {"ok": True, "timed_out": False, **doc}


def allreduce(
    fab: fabric.MultipathFabric,
    prov: str,
    sizes: list[int],
    budget_s: float,
    idle_timeout: float,
    path: str | None,
    keep_going: bool = False,
    ranks_per_ns: int = 2,
) -> list[dict[str, Any]]:
    """One job for all sizes (each size prints a line); a size that prints nothing for
    `idle_timeout` s is reported stalled; the sizes after it are restarted in a new job
    with `keep_going`, else reported as not run (each further stall would cost the whole
    idle timeout again)."""
    rows: list[dict[str, Any]] = []
    todo = list(sizes)
    while todo:
        argv = [mpirun.MPI_PYTHON, CHECKS, "allreduce", ",".join(map(str, todo)), str(budget_s)]
        res = mpirun.run_mpi(
            fab,
            prov,
            argv,
            ranks_per_ns=ranks_per_ns,
            timeout=idle_timeout * (len(todo) + 1) + 60,
            provider_path=path,
            idle_timeout=idle_timeout,
        )
        got = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        rows += got
        done = {r["size"] for r in got}
        todo = [s for s in todo if s not in done]
        if not todo:
            break
        if not res.timed_out and res.returncode == 0:
            break
        stalled = todo.pop(0)
        why = f"no result within {idle_timeout:.0f} s" if res.timed_out else "job failed"
        rows.append(
            {
                "size": stalled,
                "stalled": True,
                "why": why,
                "error": "" if res.timed_out else (res.stdout + res.stderr)[-1500:],
            }
        )
        if not keep_going:
            rows += [
                {"size": z, "stalled": True, "why": f"not run: {human(stalled)} stalled"}
                for z in todo
            ]
            break
    return rows


def state(res: dict[str, Any]) -> str:
    return "STALLED" if res.get("timed_out") else ("ok" if res.get("ok") else "FAILED")


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def svg_plot(
    path: Path,
    labels: list[str],
    series: dict[str, list[float | None]],
    capacity: float,
    title: str,
) -> None:
    """A goodput-vs-loss line chart written by hand (no matplotlib in the project)."""
    w, h, left, right, top, bottom = 720, 420, 70, 160, 40, 60
    pw, ph = w - left - right, h - top - bottom
    ymax = max([capacity, *[v for vs in series.values() for v in vs if v]]) * 1.1

    def x(i: int) -> float:
        return left + pw * (i / max(1, len(labels) - 1))

    def y(v: float) -> float:
        return top + ph * (1 - v / ymax)

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14">{title}</text>',
        f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>',
    ]
    for k in range(6):
        tick = ymax * k / 5
        out.append(
            f'<text x="{left - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:.0f}</text>'
        )
        out.append(
            f'<line x1="{left}" y1="{y(tick):.1f}" x2="{left + pw}" y2="{y(tick):.1f}" '
            'stroke="#ddd"/>'
        )
    for i, lab in enumerate(labels):
        out.append(f'<text x="{x(i):.1f}" y="{top + ph + 18}" text-anchor="middle">{lab}</text>')
    out.append(
        f'<text x="{left + pw / 2}" y="{h - 15}" text-anchor="middle">packet loss '
        "(random, both directions; bursty: runs of 16)</text>"
    )
    out.append(
        f'<text x="18" y="{top + ph / 2}" transform="rotate(-90 18 {top + ph / 2})" '
        'text-anchor="middle">goodput, Mbit/s</text>'
    )
    out.append(
        f'<line x1="{left}" y1="{y(capacity):.1f}" x2="{left + pw}" y2="{y(capacity):.1f}" '
        'stroke="black" stroke-dasharray="6,4"/>'
    )
    out.append(
        f'<text x="{left + pw + 8}" y="{y(capacity) + 4:.1f}">capacity {capacity:.0f}</text>'
    )
    for n, (name, vals) in enumerate(series.items()):
        c = colors[n % len(colors)]
        pts = [(x(i), y(v)) for i, v in enumerate(vals) if v is not None]
        if pts:
            out.append(
                '<polyline fill="none" stroke-width="2" stroke="{}" points="{}"/>'.format(
                    c, " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
                )
            )
        for i, v in enumerate(vals):
            if v is None:
                continue
            out.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="3" fill="{c}"/>')
            if v == 0:
                out.append(
                    f'<text x="{x(i):.1f}" y="{y(v) - 8:.1f}" fill="{c}" '
                    'text-anchor="middle">stalled</text>'
                )
        ly = top + 20 + 18 * n
        out.append(
            f'<line x1="{left + pw + 8}" y1="{ly}" x2="{left + pw + 28}" y2="{ly}" '
            f'stroke="{c}" stroke-width="2"/>'
        )
        out.append(f'<text x="{left + pw + 32}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 0 and 1 %%, short runs")
    ap.add_argument("--arms", default="udp,tcp,metaroce")
    ap.add_argument("--losses", help="percent, comma list (default 0,0.1,1,3,10)")
    ap.add_argument("--no-bursty", action="store_true")
    ap.add_argument("--pingpong-size", type=int, default=4 << 20)
    ap.add_argument("--pingpong-seconds", type=float, help="lossless run length (iters calibrated)")
    ap.add_argument(
        "--stall-factor",
        type=float,
        default=10.0,
        help="a lossy run is stalled past this many times its lossless time",
    )
    ap.add_argument("--mpi-bw-seconds", type=float)
    ap.add_argument("--allreduce-losses", default="0,1", help="percent, comma list, or none")
    ap.add_argument(
        "--rounds", type=int, default=1, help="capacity and goodput runs, repeated (medians)"
    )
    ap.add_argument("--allreduce-budget", type=float, help="seconds of iterations per size")
    ap.add_argument(
        "--allreduce-rounds",
        type=int,
        default=1,
        help="allreduce jobs per loss, the losses alternating; each size's median round",
    )
    ap.add_argument(
        "--allreduce-ranks-per-ns",
        type=int,
        default=2,
        help="ranks in each namespace (2: 4 ranks; 1 leaves this 2-core host a core per rank)",
    )
    ap.add_argument(
        "--allreduce-idle-timeout",
        type=float,
        help="a size with no result this long is stalled (default 200, quick 60)",
    )
    ap.add_argument(
        "--allreduce-keep-going",
        action="store_true",
        help="after a stalled size, run the larger ones too (default: reported not run)",
    )
    ap.add_argument("--metaroce-provider-path", help="folder with libmetaroce-fi.so")
    ap.add_argument("--metaroce-perf-server", help="command template run in namespace B")
    ap.add_argument("--metaroce-perf-client", help="command template run in namespace A")
    ap.add_argument("--json", default="/tmp/transport_loss.json")
    ap.add_argument("--svg", default="/tmp/transport_loss.svg")
    args = ap.parse_args()

    q = args.quick
    losses = [float(x) for x in (args.losses or ("0,1" if q else "0,0.1,1,3,10")).split(",")]
    if 0.0 not in losses:
        raise SystemExit(f"--losses {args.losses}: must include 0 (the lossless reference)")
    pp_seconds = args.pingpong_seconds or (2.0 if q else 6.0)
    bw_seconds = args.mpi_bw_seconds or (2.0 if q else 5.0)
    ar_budget = args.allreduce_budget or (0.3 if q else 1.0)
    ar_idle = args.allreduce_idle_timeout or (60.0 if q else 200.0)
    ar_losses = (
        []
        if args.allreduce_losses == "none"
        else [float(x) for x in args.allreduce_losses.split(",")]
    )
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: at least 1")
    if args.allreduce_rounds < 1:
        raise SystemExit(f"--allreduce-rounds {args.allreduce_rounds}: at least 1")
    sizes = SIZES_QUICK if q else SIZES_FULL
    arms: dict[str, str] = {}
    for a in args.arms.split(","):
        if a not in ARMS:
            raise SystemExit(f"--arms {args.arms}: names from {', '.join(ARMS)}")
        if a == "metaroce":
            lib = Path(args.metaroce_provider_path or "/nonexistent") / "libmetaroce-fi.so"
            if not lib.is_file():
                print(
                    f"metaroce arm left out: {lib} does not exist "
                    "(--metaroce-provider-path DIR with libmetaroce-fi.so)"
                )
                continue
        arms[a] = ARMS[a]
    path_of = {a: (args.metaroce_provider_path if a == "metaroce" else None) for a in arms}
    conds = conditions(losses, not args.no_bursty)
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": q,
        "loadavg_start": loadavg(),
        "arms": arms,
        "allreduce_ranks": 2 * args.allreduce_ranks_per_ns,
        "allreduce_rounds": args.allreduce_rounds,
    }

    with fabric.MultipathFabric(name=fabric.new_name("mrfb")) as fab:
        report["fabric"] = fab.describe()
        print(
            f"fabric {fab.name}: {fab.links} x {fab.rate_mbit} Mbit/s tbf (burst "
            f"{fabric.LINK_BURST_BYTES} B, limit {fabric.LINK_LIMIT_BYTES} B), L4 ECMP"
        )
        # calibrate fi_pingpong iterations per arm so the lossless run lasts ~pp_seconds
        iters: dict[str, int] = {}
        for a, prov in arms.items():
            fab.set_impairments([])
            probe = clients.run_pingpong(
                fab, prov, args.pingpong_size, 3, timeout=60, provider_path=path_of[a]
            )
            per_iter = probe.seconds / 3 if probe.ok else 1.0
            iters[a] = max(3, min(2000, round(pp_seconds / max(per_iter, 1e-3))))
        report["pingpong"] = {"size": args.pingpong_size, "iters": iters}

        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}; load {loadavg()}", flush=True)
            fab.set_impairments([])
            cap = fab.capacity(seconds=2.0 if q else 5.0)
            print(
                f"capacity (4 UDP floods, received payload): {cap['total_mbit']:.1f} Mbit/s "
                f"({', '.join(f'{d} {v:.1f}' for d, v in cap['per_link_mbit'].items())}); "
                f"load {loadavg()}",
                flush=True,
            )
            results = goodput_round(fab, arms, path_of, conds, args, iters, bw_seconds)
            rounds.append({"capacity": cap, "goodput": results})
        fab.set_impairments([])
        report["rounds"] = rounds
        report["capacity"] = median_of(rounds, "capacity", "total_mbit")["capacity"]
        capacity = report["capacity"]["total_mbit"]
        report["goodput"] = median_cells(rounds, arms, conds)

        # Rounds alternate the losses (0, 1, 0, 1, ...), so a stretch of host noise
        # lands on both sides of a ratio; each size's cell is the median round.
        ar_rounds: dict[str, dict[str, list[list[dict[str, Any]]]]] = {a: {} for a in arms}
        ar_load: dict[str, dict[str, str]] = {a: {} for a in arms}
        for r in range(args.allreduce_rounds):
            for pct in ar_losses:
                per = round(pct * 100)
                for a, prov in arms.items():
                    fab.set_impairments([fabric.Impairment("drop", per)] if per else [])
                    rows = allreduce(
                        fab,
                        prov,
                        sizes,
                        ar_budget,
                        ar_idle,
                        path_of[a],
                        args.allreduce_keep_going,
                        args.allreduce_ranks_per_ns,
                    )
                    ar_rounds[a].setdefault(f"{pct:g}%", []).append(rows)
                    ar_load[a][f"{pct:g}%"] = loadavg()
                    print(
                        f"  allreduce {a} at {pct:g}% done (round {r + 1} of "
                        f"{args.allreduce_rounds}); load {loadavg()}",
                        flush=True,
                    )
        fab.set_impairments([])
        report["allreduce"] = {
            a: {
                lab: {"rows": median_rounds(runs), "rounds": runs, "loadavg": ar_load[a][lab]}
                for lab, runs in per_loss.items()
            }
            for a, per_loss in ar_rounds.items()
        }
        report["counters_end"] = fab.counters()
    report["loadavg_end"] = loadavg()

    print_tables(report, arms, conds, capacity, sizes)
    if len(report["rounds"]) > 1:
        round_ratios(report, arms, conds)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    labels = [c[0] for c in conds]
    series: dict[str, list[float | None]] = {}
    for a in arms:
        series[f"{a} fi_pingpong"] = [
            report["goodput"][a][lab]["pingpong"]["goodput_mbit"] for lab in labels
        ]
        series[f"{a} MPI stream"] = [
            report["goodput"][a][lab]["mpi_bw"].get("mbit_s", 0.0) for lab in labels
        ]
    svg_plot(
        Path(args.svg),
        labels,
        series,
        capacity,
        f"goodput vs loss, 4 x {fabric.LINK_RATE_MBIT} Mbit/s ECMP fabric",
    )
    print(f"\nJSON: {args.json}   plot: {args.svg}")
    return 0


def goodput_round(
    fab: fabric.MultipathFabric,
    arms: dict[str, str],
    path_of: dict[str, str | None],
    conds: list[tuple[str, list[fabric.Impairment]]],
    args: argparse.Namespace,
    iters: dict[str, int],
    bw_seconds: float,
) -> dict[str, dict[str, Any]]:
    """Every condition for every arm once: {arm: {loss label: row}}."""
    results: dict[str, dict[str, Any]] = {a: {} for a in arms}
    lossless_s: dict[str, float] = {}
    for label, imps in conds:
        for a, prov in arms.items():
            fab.set_impairments(imps)
            timeout = (
                60.0 if not lossless_s.get(a) else max(30.0, args.stall_factor * lossless_s[a])
            )
            pp = pingpong(fab, prov, args.pingpong_size, iters[a], timeout, path_of[a])
            if label == "0%" and pp["ok"]:
                lossless_s[a] = pp["seconds"]
            bw = mpi_bandwidth(fab, prov, bw_seconds, path_of[a])
            row: dict[str, Any] = {"pingpong": pp, "mpi_bw": bw}
            if a == "metaroce" and args.metaroce_perf_server and args.metaroce_perf_client:
                row["perf"] = perf_arm(
                    fab, args.metaroce_perf_server, args.metaroce_perf_client, bw_seconds
                )
            row["loadavg"] = loadavg()
            results[a][label] = row
            perf = f", metaroce-perf {row['perf']['goodput_mbit']:7.1f}" if "perf" in row else ""
            print(
                f"  {a:8} {label:>10}: pingpong {pp['goodput_mbit']:7.1f} Mbit/s"
                f" {state(pp)}, mpi stream {bw.get('mbit_s', 0.0):7.1f} Mbit/s"
                f" {state(bw)}{perf}; load {row['loadavg']}",
                flush=True,
            )
    return results


def median_rounds(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size, the median of the rounds' medians and p99s (each the lower middle),
    correct only if every round was; a size stalled in any round is reported stalled."""
    out: list[dict[str, Any]] = []
    sizes = list(dict.fromkeys(row["size"] for rows in runs for row in rows))
    for size in sizes:
        rows = [row for rows in runs for row in rows if row["size"] == size]
        stalled = [row for row in rows if row.get("stalled")]
        if stalled or len(rows) < len(runs):
            out.append(stalled[0] if stalled else {"size": size, "stalled": True, "why": "missing"})
            continue
        mid = (len(rows) - 1) // 2
        out.append(
            {
                "size": size,
                "iters": sum(int(row["iters"]) for row in rows),
                "median_s": sorted(float(row["median_s"]) for row in rows)[mid],
                "p99_s": sorted(float(row["p99_s"]) for row in rows)[mid],
                "correct": all(row["correct"] for row in rows),
                "round_medians_s": [float(row["median_s"]) for row in rows],
            }
        )
    return out


def median_of(rows: list[dict[str, Any]], key: str, field: str) -> dict[str, Any]:
    """The row of `rows` whose `row[key][field]` is the median (lower middle)."""
    ordered = sorted(rows, key=lambda x: float(x[key].get(field) or 0.0))
    return dict(ordered[(len(ordered) - 1) // 2])


def median_cells(
    rounds: list[dict[str, Any]],
    arms: dict[str, str],
    conds: list[tuple[str, list[fabric.Impairment]]],
) -> dict[str, dict[str, Any]]:
    """Per arm and loss, the round whose fi_pingpong goodput is the median; with the
    MPI stream's and metaroce-perf's medians put in its place (each tool's own)."""
    out: dict[str, dict[str, Any]] = {a: {} for a in arms}
    for a in arms:
        for label, _ in conds:
            rows = [r["goodput"][a][label] for r in rounds]
            cell = median_of(rows, "pingpong", "goodput_mbit")
            cell["mpi_bw"] = median_of(rows, "mpi_bw", "mbit_s")["mpi_bw"]
            if all("perf" in x for x in rows):
                cell["perf"] = median_of(rows, "perf", "goodput_mbit")["perf"]
            out[a][label] = cell
    return out


TOOLS = [("pingpong", "goodput_mbit"), ("mpi_bw", "mbit_s"), ("perf", "goodput_mbit")]


def tool_goodput(rnd: dict[str, Any], arm: str, label: str, key: str, field: str) -> float:
    return float(rnd["goodput"][arm][label][key].get(field) or 0.0)


def round_ratios(
    report: dict[str, Any], arms: dict[str, str], conds: list[tuple[str, list[fabric.Impairment]]]
) -> None:
    """Each round's ratios to its own lossless run and its own capacity, and their
    medians: the figures to judge by on a host whose single runs swing."""
    rounds = report["rounds"]
    print(f"\n== {len(rounds)} rounds: ratio per round (median) to the round's own lossless run")
    for a in arms:
        for key, field in TOOLS:
            if not all(key in r["goodput"][a]["0%"] for r in rounds):
                continue
            base = [tool_goodput(r, a, "0%", key, field) for r in rounds]
            caps = [
                b / float(r["capacity"]["total_mbit"]) for b, r in zip(base, rounds, strict=True)
            ]
            cells = [f"lossless/cap {fmt_list(caps)}"]
            for label, _ in conds:
                if label != "0%":
                    own = [
                        tool_goodput(r, a, label, key, field) / b if b else 0.0
                        for b, r in zip(base, rounds, strict=True)
                    ]
                    cells.append(f"{label} {fmt_list(own)}")
            print(f"{a:9}{key:>9}: " + "; ".join(cells))


def fmt_list(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({' '.join(f'{x:.2f}' for x in xs)})"


def print_tables(
    report: dict[str, Any],
    arms: dict[str, str],
    conds: list[tuple[str, list[fabric.Impairment]]],
    capacity: float,
    sizes: list[int],
) -> None:
    print(
        f"\n== goodput (Mbit/s) and ratios; capacity {capacity:.1f} Mbit/s; "
        f"load {report['loadavg_start']} -> {report['loadavg_end']}"
    )
    print(
        f"{'arm':9}{'loss':>11} | {'pingpong':>9}{'/own0':>7}{'/cap':>6}{'cpu s/GB':>10}"
        f"{'sirq s/GB':>10} | {'mpi bw':>8}{'/own0':>7}{'/cap':>6} | {'nft drop':>9}{'tbf drop':>9}"
        f" {'load':>15}"
    )
    for a in arms:
        base = report["goodput"][a]["0%"]
        b_pp = base["pingpong"]["goodput_mbit"] or None
        b_bw = base["mpi_bw"].get("mbit_s") or None
        for label, _ in conds:
            row = report["goodput"][a][label]
            pp, bw = row["pingpong"], row["mpi_bw"]
            g, m = pp["goodput_mbit"], bw.get("mbit_s", 0.0)
            cpg = pp["cpu_s_per_gb"]
            drops = pp["loss"]
            nft = drops["nft_drop_a"] + drops["nft_drop_b"]
            tbf = drops["tbf_drop_a"] + drops["tbf_drop_b"]
            pps = "STALLED" if pp["timed_out"] else ("FAILED" if not pp["ok"] else f"{g:.1f}")
            mbs = "STALLED" if bw.get("timed_out") else ("FAILED" if not bw["ok"] else f"{m:.1f}")
            print(
                f"{a:9}{label:>11} | {pps:>9}{fmt_ratio(g / b_pp if b_pp else None):>7}"
                f"{g / capacity:6.3f}{cpg['process']:10.1f}{cpg['softirq']:10.1f} | "
                f"{mbs:>8}{fmt_ratio(m / b_bw if b_bw else None):>7}{m / capacity:6.3f} | "
                f"{nft:9d}{tbf:9d} {row['loadavg']:>15}"
            )
    perf_rows = {lab: r["perf"] for lab, r in report["goodput"].get("metaroce", {}).items()
                 if "perf" in r}  # fmt: skip
    if perf_rows:
        base_perf = perf_rows.get("0%", {}).get("goodput_mbit") or None
        print("\n== metaroce-perf (the transport's own tool, 1 MiB messages): Mbit/s")
        for label, r in perf_rows.items():
            g = float(r.get("goodput_mbit") or 0.0)
            shown = f"{g:.1f}" if r.get("ok") else ("STALLED" if r.get("timed_out") else "FAILED")
            own = fmt_ratio(g / base_perf if base_perf else None)
            print(
                f"metaroce {label:>11} | {shown:>9}{own:>7}"
                f"{g / capacity:6.3f} | retransmits {r.get('retransmits', '-')}, spurious "
                f"{r.get('spurious_retransmits', '-')}"
            )
    ranks = int(report.get("allreduce_ranks", 4))
    n = int(report.get("allreduce_rounds", 1))
    print(
        f"\n== Open MPI allreduce ({ranks} ranks, {ranks // 2} per namespace): "
        "median / p99 ms, data checked"
        + (f"; each the median of {n} rounds, the losses alternating" if n > 1 else "")
    )
    for a in arms:
        for lab, res in report["allreduce"][a].items():
            cells = []
            by = {r["size"]: r for r in res["rows"]}
            for s in sizes:
                r = by.get(s)
                if r is None:
                    cells.append(f"{human(s)}: -")
                elif r.get("stalled"):
                    cells.append(f"{human(s)}: STALLED ({r['why']})")
                else:
                    bad = "" if r["correct"] else " WRONG"
                    cells.append(
                        f"{human(s)}: {r['median_s'] * 1e3:.2f}/{r['p99_s'] * 1e3:.2f}{bad}"
                    )
            print(f"{a:9}{lab:>6} (load {res['loadavg']}): " + "; ".join(cells))
        base = {r["size"]: r for r in report["allreduce"][a].get("0%", {}).get("rows", [])}
        for lab, res in report["allreduce"][a].items():
            if lab == "0%":
                continue
            ratios = []
            for r in res["rows"]:
                b = base.get(r["size"])
                if b and not b.get("stalled") and not r.get("stalled"):
                    ratios.append(f"{human(r['size'])} {r['median_s'] / b['median_s']:.2f}x")
            print(f"{a:9}{lab:>6} median / lossless median: {', '.join(ratios) or '-'}")


if __name__ == "__main__":
    sys.exit(main())
