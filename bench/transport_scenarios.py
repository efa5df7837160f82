"""The transport's fault scenarios on the namespace fabric, measured with metaroce-perf.

  link-failure  one of the 4 links drops everything for 1 s, from about 1 s into the run:
                goodput in 10 ms bins against the 4-link lossless figure (the bins before
                the cut), each series binned from the cut (when the nft call began): when
                it is back at 0.7 with 500 ms of bins all at 0.7 after it, and the 500 ms
                after the 100 ms the rule allows (their median, lowest bin and share below
                0.7, beside the lossless bins' own share: a busy 2-core host makes single
                10 ms bins dip with no failure at all); whether the link carries data again
                within 1 s after it recovers. Series: payload bytes first acknowledged (the
                sender's view), unique payload bytes the receiver placed (by when its
                endpoint placed them, and by when their datagrams reached the receiving
                host: the kernel's timestamp, free of the receiver's scheduling), and
                with --wire-bins the receiving links' bytes
  ce-share      5% of the ECT packets on one link marked CE: that link's share of the bytes
                (an even share is 1/4) and the total against a lossless run. With the
                other 3 links full, a share s gives a total of 3 / (4 (1 - s)) of a
                4-link lossless run: below 1/8 means at most 0.857
  lossless      lossless runs, spurious retransmits among them
  incast        4 senders at once into one receiver behind a tbf-shaped port (the
                incast fabric): total goodput against the port's measured capacity, the
                largest over the smallest sender's share, retransmits; with the
                receiver's rate hint set to the port's rate (rate_mbps=, as the agent
                would from the NIC's speed) and without it

Run as root (network namespaces). Figures print as a table and go to --json.

  .venv/bin/python bench/transport_scenarios.py [--runs 3] [--perf PATH] [--wire-bins]
      [--mtu 1500|9000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "transport" / "fabric"))

import fabric  # noqa: E402

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "metaroce"
PERF = CACHE / "transport/target/release/metaroce-perf"
BIN_MS = 10
DARK_LINK = 1  # the link the link-failure scenario blackholes


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[0]


def perf(
    fab: fabric.MultipathFabric,
    perf_bin: str,
    seconds: float,
    size: int = 1 << 18,
    bins: bool = True,
) -> dict[str, Any]:
    """One bw run B -> A (server in A, client in B): the client's JSON, with 10 ms bins
    when `bins` (both ends then read their counters every 0.25 ms)."""
    a, b = fab.data_addr("a"), fab.data_addr("b")
    server = [perf_bin, "server", "--once", "--config", f"addr={a},ports=30000-30100,mtu={fab.mtu}"]
    srv = subprocess.Popen(
        fab.exec_argv("a", server),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert srv.stdout is not None
        line = srv.stdout.readline()
        if "udp://" not in line:
            raise RuntimeError(f"metaroce-perf server did not start: {line!r}")
        url = line.split()[-1]
        argv = [perf_bin, "client", url, "--duration", str(seconds), "--size", str(size)]
        argv += ["--window", "32", "--json", *(["--bins-ms", str(BIN_MS)] if bins else [])]
        argv += ["--config", f"addr={b},ports=31000-31100,mtu={fab.mtu}"]
        p = subprocess.run(
            fab.exec_argv("b", argv), capture_output=True, text=True, timeout=seconds + 60
        )
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"metaroce-perf client failed ({p.returncode}): {p.stderr[-800:]}")
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


def link_rx(fab: fabric.MultipathFabric) -> dict[str, int]:
    """Bytes each data link delivered into A (the receiving side of perf)."""
    links = fab.counters()["a"]["links"]
    return {d: int(links[d]["rx_bytes"]) for d in fab.data_links()}


def recovery(bins: list[float], cut: int, lossless: float) -> dict[str, Any]:
    """After the cut: how long until goodput is at 0.7 of lossless and stays there for
    500 ms (every bin; searched over the 500 ms after the cut, before the link comes
    back), and the 500 ms that follow the 100 ms the rule allows (their median, lowest
    bin and share of bins under 0.7). The dip comes a few bins after the cut, when the
    dark link's packets are found lost: the first bin at 0.7 is not yet the recovery."""
    hold, grace = 500 // BIN_MS, 100 // BIN_MS
    level = 0.7 * lossless
    last = min(len(bins) - hold, cut + hold)
    back = next((i for i in range(cut, last + 1) if min(bins[i : i + hold]) >= level), None)
    window = bins[cut + grace : cut + grace + hold]
    out: dict[str, Any] = {
        "back_after_ms": None if back is None else (back - cut) * BIN_MS,
        "dip_min": min(bins[cut : cut + grace]) / lossless if bins[cut : cut + grace] else None,
    }
    if window:
        out["hold_median"] = statistics.median(window) / lossless
        out["hold_min"] = min(window) / lossless
        out["held"] = min(window) >= level
        out["hold_bins_below_0.7"] = below(window, level)
    return out


def below(bins: list[float], level: float) -> float | None:
    """The share of bins under `level`: set beside the lossless bins' own share, it
    tells a dip the failure caused from the bin-to-bin noise of a busy host."""
    return sum(1 for b in bins if b < level) / len(bins) if bins else None


def counter_bins(samples: list[list[float]], start: float, bin_ms: int) -> list[float]:
    """Mbit/s per bin from [time, bytes] samples of a growing counter, bin 0 starting at
    `start`: each sample's increase spread evenly over the time since the one before
    (as metaroce-perf's acknowledged-bytes bins), so a late sample moves no bytes."""
    bin_us = bin_ms * 1000
    out: list[float] = []
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        u0, u1 = round((t0 - start) * 1e6), round((t1 - start) * 1e6)
        if u1 <= u0 or u0 < 0:
            continue
        u = u0
        while u < u1:
            i = u // bin_us
            end = min((i + 1) * bin_us, u1)
            if len(out) <= i:
                out.extend([0.0] * (i + 1 - len(out)))
            out[i] += (b1 - b0) * (end - u) / (u1 - u0)
            u = end
    return [b * 8 / bin_ms / 1000 for b in out]


# The sender's loss-recovery counters kept beside each link-failure run: a copy the
# receiver already had (spurious) is wire that carried no goodput.
LOSS_COUNTERS = (
    "spurious_retransmits",
    "spurious_rtos",
    "tlps",
    "late_losses",
    "spurious_late_losses",
)


def link_failure(
    fab: fabric.MultipathFabric, perf_bin: str, capacity: float, wire: bool = False
) -> dict[str, Any]:
    marks: dict[str, dict[str, int]] = {}
    applied: list[tuple[float, float]] = []
    sampler = None
    if wire:  # the receiving links' counters, sampled beside the run (costs some CPU)
        argv = [sys.executable, str(ROOT / "bench" / "link_rx_sampler.py")]
        argv += [",".join(fab.data_links()), "--seconds", "3.5"]
        sampler = subprocess.Popen(fab.exec_argv("a", argv), stdout=subprocess.PIPE, text=True)

    def impair() -> None:
        time.sleep(1.0)
        applied.extend(fab.set_impairments([fabric.Impairment("blackhole", link=DARK_LINK)]))
        time.sleep(1.0)
        fab.set_impairments([])
        marks["restored"] = link_rx(fab)
        time.sleep(1.0)
        marks["restored+1s"] = link_rx(fab)

    t = threading.Thread(target=impair)
    t.start()
    # 64 KiB messages: a 10 ms bin at ~900 Mbit/s holds about 17 of them.
    doc = perf(fab, perf_bin, 4.0, size=1 << 16)
    t.join()
    link1 = fab.data_links()[DARK_LINK]
    used_again = marks["restored+1s"][link1] - marks["restored"][link1]
    # The cut: when the first `nft -f` began (the earliest the link could go dark;
    # the rules are in force in both directions by `in_force`). Every series is
    # binned against it: metaroce-perf's from the client's start (CLOCK_MONOTONIC,
    # the clock time.monotonic reads; the server's bins start at its READY, under a
    # millisecond earlier), each at the bin holding the cut.
    cut, in_force = applied[0][0], applied[-1][1]
    cut_bin = int((cut - float(doc["start_monotonic_s"])) * 1000) // BIN_MS

    def series(key: str) -> dict[str, Any]:
        return bin_figures([float(x) for x in doc.get(key) or []], capacity, cut_bin)

    # The verdict uses bins of payload bytes first acknowledged (packet-sized steps);
    # the receiver's placed bytes, completed messages and the wire sit beside them.
    acked = series("acked_bins_mbps")
    on_wire: dict[str, Any] = {}
    if sampler is not None:
        out, _ = sampler.communicate(timeout=60)
        per_link = json.loads(out)
        # Bin 100 starts at the cut. The dark link's counter also counts what the
        # receiving end's nftables drops (the sender's packets until the path is
        # failed, then probes): from the cut on, the bins are the 3 other links'.
        start = cut - 1.0

        def links(keep: list[int]) -> list[list[float]]:
            return [[t, sum(b[i] for i in keep)] for t, b in per_link]

        every = list(range(len(fab.data_links())))
        wire_bins = counter_bins(links(every), start, BIN_MS)[:100]
        left = [i for i in every if i != DARK_LINK]
        wire_bins += counter_bins(links(left), start, BIN_MS)[100:]
        on_wire = {
            "on_the_wire": bin_figures(wire_bins, capacity),
            # Each link's own bins (Mbit/s): which link a dip was on.
            "per_link_wire_mbit": [counter_bins(links([i]), start, BIN_MS) for i in every],
        }
    # The receiver's series: unique payload bytes its endpoint placed (its bytes_rcvd
    # counter read every 0.25 ms): the goodput the receiving application gets, free of
    # the ACKs' way back and of when the sender's thread got to them.
    delivered = series("delivered_bins_mbps") if doc.get("delivered_bins_mbps") else None
    # The same bytes binned by their datagrams' kernel receive time: when the fabric
    # delivered them, however late the receiving thread got a core to place them.
    arrived = series("arrival_bins_mbps") if doc.get("arrival_bins_mbps") else None
    return {
        **acked,
        **on_wire,
        **({"delivered": delivered} if delivered else {}),
        **({"arrived": arrived} if arrived else {}),
        "by_message_completion": series("bins_mbps"),
        "rule_in_force_within_ms": (in_force - cut) * 1000,
        "link_bytes_in_1s_after_recovery": used_again,
        "goodput_mbit": doc["goodput_gbps"] * 1000,
        "rtos": doc["rtos"],
        "retransmits": doc["retransmits"],
        **{k: doc.get(k) for k in LOSS_COUNTERS},
        "paths": doc.get("paths"),
    }


def bin_figures(bins: list[float], capacity: float, cut: int = 1000 // BIN_MS) -> dict[str, Any]:
    """The link-failure figures of one series of 10 ms bins, the cut in bin `cut`.

    Three links carry at most 3/4 of the measured capacity: `three_link_ceiling` is
    that over the lossless bins' median. A bin under 0.7 of lossless is under
    0.7 / ceiling of what three links can carry; `lossless_bins_below_same_depth` is
    the share of lossless bins that far under their own median, the host's noise at
    the depth the 0.7 rule asks of the three links."""
    before = bins[20:cut]  # skip the first 200 ms (slow start)
    lossless = statistics.median(before)
    ceiling = 0.75 * capacity / lossless
    return {
        "lossless_bins_mbit": lossless,
        "cut_bin": cut,
        "three_link_ceiling": ceiling,
        "first_10ms_bin_after_cut": bins[cut] / lossless if len(bins) > cut else None,
        "lossless_bins_below_0.7": below(before, 0.7 * lossless),
        "lossless_bins_below_same_depth": below(before, min(1.0, 0.7 / ceiling) * lossless),
        **recovery(bins, cut, lossless),
        "bins_mbit": bins,
    }


def ce_share(fab: fabric.MultipathFabric, perf_bin: str, lossless_mbit: float) -> dict[str, Any]:
    fab.set_impairments([fabric.Impairment("ce", 500, link=2)])
    before = link_rx(fab)
    doc = perf(fab, perf_bin, 3.0, bins=False)
    after = link_rx(fab)
    fab.set_impairments([])
    moved = {d: after[d] - before[d] for d in after}
    total = sum(moved.values())
    marked = fab.data_links()[2]
    return {
        "marked_link_share": moved[marked] / total if total else None,
        "shares": {d: round(v / total, 3) for d, v in moved.items()} if total else {},
        "goodput_mbit": doc["goodput_gbps"] * 1000,
        "ratio_to_lossless": doc["goodput_gbps"] * 1000 / lossless_mbit,
        "ce_marks": doc["ce_marks"],
    }


def incast(inc: fabric.IncastFabric, perf_bin: str, capacity: float, hint: bool) -> dict[str, Any]:
    """Every sender runs one metaroce-perf client for 4 s at once into one server in r."""
    seconds = 4.0
    cfg = f"addr={inc.addr('r')},ports=30000-30100"
    if hint:
        cfg += f",rate_mbps={inc.rate_mbit}"
    senders = [r for r in inc.roles() if r not in ("sw", "r")]
    server = [perf_bin, "server", "--sessions", str(len(senders)), "--config", cfg]
    srv = subprocess.Popen(
        inc.exec_argv("r", server), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert srv.stdout is not None
        line = srv.stdout.readline()
        if "udp://" not in line:
            raise RuntimeError(f"metaroce-perf server did not start: {line!r}")
        url = line.split()[-1]
        clients = {
            r: subprocess.Popen(
                inc.exec_argv(
                    r,
                    [
                        perf_bin,
                        "client",
                        url,
                        "--duration",
                        str(seconds),
                        "--window",
                        "32",
                        "--json",
                        "--config",
                        f"addr={inc.addr(r)},ports=31000-31100",
                    ],
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in senders
        }
        docs: dict[str, dict[str, Any]] = {}
        for r, c in clients.items():
            out, err = c.communicate(timeout=seconds + 60)
            lines = [x for x in out.splitlines() if x.startswith("{")]
            if c.returncode != 0 or not lines:
                raise RuntimeError(f"metaroce-perf client in {r} failed: {err[-800:]}")
            docs[r] = json.loads(lines[-1])
        srv.wait(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    per = {r: float(d["goodput_mbit"]) for r, d in docs.items()}
    total = sum(per.values())
    sent = sum(int(d["packets_sent"]) for d in docs.values())
    retx = sum(int(d["retransmits"]) for d in docs.values())
    spurious = sum(int(d["spurious_retransmits"]) for d in docs.values())
    return {
        "rate_hint_mbit": inc.rate_mbit if hint else 0,
        "per_sender_mbit": per,
        "total_mbit": total,
        "total_of_capacity": total / capacity,
        "total_of_port_rate": total / inc.rate_mbit,
        "share_max_over_min": max(per.values()) / min(per.values()) if min(per.values()) else None,
        "retransmits_of_sent": retx / sent if sent else None,
        "spurious_of_sent": spurious / sent if sent else None,
        "rtos": sum(int(d["rtos"]) for d in docs.values()),
        "tlps": sum(int(d["tlps"]) for d in docs.values()),
    }


def multipath_scenarios(
    runs: int, perf_bin: str, report: dict[str, Any], wire: bool, mtu: int
) -> None:
    report["runs"] = []
    report["mtu"] = mtu
    with fabric.MultipathFabric(name=fabric.new_name("mrfs"), mtu=mtu) as fab:
        cap = fab.capacity(seconds=3.0)
        capacity = float(cap["total_mbit"])
        report["capacity_mbit"] = capacity
        for i in range(runs):
            lossless = perf(fab, perf_bin, 4.0, bins=False)
            g = lossless["goodput_gbps"] * 1000
            row = {
                "lossless_mbit": g,
                "lossless_of_capacity": g / capacity,
                "spurious_of_sent": lossless["spurious_retransmits"] / lossless["packets_sent"],
                "link_failure": link_failure(fab, perf_bin, capacity, wire),
                "ce_share": ce_share(fab, perf_bin, g),
                "loadavg": loadavg(),
            }
            report["runs"].append(row)
            lf, ce = row["link_failure"], row["ce_share"]
            print(
                f"run {i + 1}: lossless {g:.0f} Mbit/s = {g / capacity:.3f} of capacity "
                f"{capacity:.0f}, spurious {row['spurious_of_sent']:.4f} | link down: first bin "
                f"{lf['first_10ms_bin_after_cut']:.2f}, lowest in 100 ms "
                f"{lf.get('dip_min') or 0:.2f}, back to 0.7 for 500 ms after "
                f"{lf['back_after_ms']} ms, "
                f"500 ms median {lf.get('hold_median') or 0:.2f}, bins below 0.7: "
                f"{lf.get('hold_bins_below_0.7') or 0:.2f} (lossless: "
                f"{lf['lossless_bins_below_0.7'] or 0:.2f}; three links' ceiling "
                f"{lf['three_link_ceiling']:.2f}, lossless bins as far under their median: "
                f"{lf['lossless_bins_below_same_depth'] or 0:.2f}), link used again "
                f"{lf['link_bytes_in_1s_after_recovery'] >> 10} KiB | CE 5%: share "
                f"{ce['marked_link_share']:.3f}, total {ce['ratio_to_lossless']:.3f} of lossless"
                f" | load {row['loadavg']}",
                flush=True,
            )
            print(f"  the link in both directions dark {lf['rule_in_force_within_ms']:.0f} ms "
                  f"after the cut (the first nft call's start, bin 0 of every series); "
                  f"{lf['retransmits']} resends, {lf['spurious_retransmits']} of them "
                  f"spurious, {lf['tlps']} TLPs, {lf['rtos']} RTOs")  # fmt: skip
            for key, what in SERIES:
                if key in lf:
                    print(f"  {what}: {recovery_line(lf[key])}", flush=True)
        report["link_failure_held"] = held_counts([r["link_failure"] for r in report["runs"]])
        for key, (held, of, lows) in report["link_failure_held"].items():
            low = ", ".join(f"{x:.3f}" for x in lows)
            print(f"link down, {key}: held in {held} of {of} runs; failing runs' lowest bins: "
                  f"{low or 'none'}")  # fmt: skip


SERIES = (
    ("delivered", "as the receiver placed it (unique payload bytes)"),
    ("arrived", "the same bytes by kernel arrival time at the receiver (SO_TIMESTAMPNS)"),
    ("on_the_wire", "on the wire (the 3 receiving links' rx bytes, headers and resends in)"),
)


def held_counts(runs: list[dict[str, Any]]) -> dict[str, tuple[int, int, list[float]]]:
    """Per series (acknowledged bytes first, then SERIES): in how many runs every bin of
    the 500 ms after the first 100 ms was at 0.7, of how many runs had that series, and
    the failing runs' lowest bins, lowest first."""
    out: dict[str, tuple[int, int, list[float]]] = {}
    for key in ("acknowledged", *(k for k, _ in SERIES)):
        series = [r if key == "acknowledged" else r.get(key) for r in runs]
        have = [f for f in series if f and "held" in f]
        if have:
            lows = sorted(float(f["hold_min"]) for f in have if not f["held"])
            out[key] = (sum(1 for f in have if f["held"]), len(have), lows)
    return out


def recovery_line(f: dict[str, Any]) -> str:
    """One series' recovery from the cut, in words."""
    return (
        f"lowest in 100 ms {f.get('dip_min') or 0:.2f}, back to 0.7 for 500 ms after "
        f"{f['back_after_ms']} ms; from 100 ms on: 500 ms median "
        f"{f.get('hold_median') or 0:.2f}, bins below 0.7: {f.get('hold_bins_below_0.7') or 0:.2f}"
        f" (lossless: {f['lossless_bins_below_0.7'] or 0:.2f}), lowest {f.get('hold_min') or 0:.2f}"
    )


def incast_scenarios(runs: int, perf_bin: str, report: dict[str, Any]) -> None:
    with fabric.IncastFabric(name=fabric.new_name("mrfi")) as inc:
        cap = float(inc.capacity()["total_mbit"])
        report["incast_capacity_mbit"] = cap
        report["incast"] = []
        for i in range(runs):
            for hint in (True, False):
                row = incast(inc, perf_bin, cap, hint) | {"loadavg": loadavg()}
                report["incast"].append(row)
                per = ", ".join(f"{v:.0f}" for v in row["per_sender_mbit"].values())
                print(
                    f"incast run {i + 1}, rate hint {row['rate_hint_mbit'] or 'off'}: total "
                    f"{row['total_mbit']:.0f} Mbit/s = {row['total_of_capacity']:.3f} of the "
                    f"port's {cap:.0f} ({row['total_of_port_rate']:.3f} of its tbf rate); "
                    f"senders {per} (max/min {row['share_max_over_min']:.2f}); "
                    f"retransmits {row['retransmits_of_sent']:.4f} (spurious "
                    f"{row['spurious_of_sent']:.4f}, {row['rtos']} RTOs, {row['tlps']} TLPs) "
                    f"| load {row['loadavg']}",
                    flush=True,
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each scenario")
    ap.add_argument("--perf", default=str(PERF), help="the metaroce-perf binary")
    ap.add_argument("--json", default="/tmp/transport_scenarios.json")
    ap.add_argument(
        "--only", choices=["multipath", "incast"], help="run one fabric's scenarios only"
    )
    ap.add_argument(
        "--wire-bins",
        action="store_true",
        help="also bin the link failure by the receiving links' rx counters, sampled every "
        "0.5 ms (bench/link_rx_sampler.py): the bytes on the wire, free of when the "
        "sender processed their ACKs; the sampler's CPU shows in the other figures",
    )
    ap.add_argument(
        "--mtu",
        type=int,
        default=fabric.DEFAULT_MTU,
        choices=[1500, 9000],
        help="the multipath fabric's MTU (and the endpoints'); capacity is measured with "
        "datagrams of the same size",
    )
    args = ap.parse_args()
    if not Path(args.perf).is_file():
        print(f"{args.perf} does not exist: run bash hack/build-transport.sh", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"loadavg_start": loadavg()}
    if args.only != "incast":
        multipath_scenarios(args.runs, args.perf, report, args.wire_bins, args.mtu)
    if args.only != "multipath":
        incast_scenarios(args.runs, args.perf, report)
    report["loadavg_end"] = loadavg()
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"report: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
