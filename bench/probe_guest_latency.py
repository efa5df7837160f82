"""The RDMA probe's latency figures against perftest's, side by side on two SoftRoCE guests.

The probe (node-agent/metaroce_agent/probe.py) is meant to measure the link, not its own
sleeping: both sides wait on completion channels. This runs, in one pair of guests:

1. the probe as the agent runs it (server on node-2, `probe_peer` from node-1), ROUNDS
   sessions of RC_PINGS pings each: p50 and p99 over all RTTs, UD loss, and the server
   process's CPU time per session;
2. optionally (`--old REV`) the probe of an older revision the same way (its module
   copied from git), to show the naps it had (b6733c0: 1 ms naps on both sides);
3. `ib_send_lat` (perftest, RC send, 64 bytes) between the same devices: the reference.

It prints probe / perftest ratios of p50 and p99. TCG guests are slow: ratios count.

    .venv/bin/python bench/probe_guest_latency.py [--rounds 5] [--old b6733c0]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from metaroce_harness.guests import GuestCluster

REPO = Path(__file__).resolve().parents[1]

SETUP = (
    "modprobe rdma_rxe && (rdma link show rxe_eth0 >/dev/null 2>&1 || "
    "rdma link add rxe_eth0 type rxe netdev eth0) && modprobe ib_uverbs"
)

COMMON = r"""
import glob, json, os, sys, time
sys.path.insert(0, "/tmp")
mod = __import__(sys.argv[1])
def gid_index():
    base = "/sys/class/infiniband/rxe_eth0/ports/1"
    for p in sorted(glob.glob(base + "/gid_attrs/types/*"), key=lambda s: int(s.rsplit("/", 1)[1])):
        i = p.rsplit("/", 1)[1]
        try:
            kind = open(p).read().strip(); gid = open(f"{base}/gids/{i}").read()
        except OSError:
            continue
        if kind == "RoCE v2" and "ffff" in gid:
            return int(i)
    raise SystemExit("no RoCE v2 IPv4 GID")
local = mod.Local("rxe_eth0", 1, gid_index(), 0)
"""

SERVER = (
    COMMON
    + r"""
import threading
srv = mod.ProbeServer(sys.argv[2], 47990, lambda *rail: local)
threading.Thread(target=srv.serve, daemon=True).start()
print("listening", flush=True)
while True:
    time.sleep(3600)
"""
)

CLIENT = (
    COMMON
    + r"""
rtts, sent, got = [], 0, 0
for i in range(int(sys.argv[3])):
    r = mod.probe_peer("peer", sys.argv[2], 47990, local)
    if not r.reachable:
        print(json.dumps({"error": r.message})); raise SystemExit(1)
    rtts += list(r.rtts_us)
    if getattr(r, "ud", None):
        sent += r.ud[0]; got += r.ud[1]
print(json.dumps({"rtts": rtts, "sent": sent, "got": got}))
"""
)


def pct(data: list[float], q: float) -> float:
    s = sorted(data)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def server_cpu(g: Any) -> float:
    """utime + stime (s) of the probe server process."""
    r = g.run("cat /proc/$(pgrep -f probe_server.py | head -1)/stat", timeout=30)
    fields = r.stdout.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def run_probe(guests: Any, module: str, rounds: int) -> dict[str, Any]:
    a, b = guests[0], guests[1]
    b.write_file("/tmp/probe_server.py", SERVER)
    a.write_file("/tmp/probe_client.py", CLIENT)
    srv = b.start(f"exec python3 /tmp/probe_server.py {module} {b.ip} >/tmp/probe_server.log 2>&1")
    try:
        for _ in range(60):
            if "listening" in b.run("cat /tmp/probe_server.log", timeout=30).stdout:
                break
            time.sleep(1)
        else:
            raise RuntimeError(b.run("cat /tmp/probe_server.log", timeout=30).stdout)
        cpu0, t0 = server_cpu(b), time.monotonic()
        r = a.run(f"python3 /tmp/probe_client.py {module} {b.ip} {rounds}", timeout=600)
        wall, cpu = time.monotonic() - t0, server_cpu(b) - cpu0
        assert r.returncode == 0, r.stdout + r.stderr
        data = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        srv.kill()
    rtts = data["rtts"]
    return {
        "n": len(rtts),
        "p50": pct(rtts, 0.5),
        "p99": pct(rtts, 0.99),
        "loss": f"{data['sent'] - data['got']} of {data['sent']}",
        "server_cpu_per_round_s": cpu / rounds,
        "wall_s": wall,
    }


def perftest(guests: Any, iters: int) -> dict[str, float]:
    a, b = guests[0], guests[1]
    opts = f"-d rxe_eth0 -x 1 -s 64 -n {iters}"
    server = b.start(f"exec timeout 300 ib_send_lat {opts}")
    time.sleep(3)
    r = a.run(f"timeout 280 ib_send_lat {opts} {b.ip}", timeout=300)
    server.wait(300)
    assert r.returncode == 0, r.stdout + r.stderr
    # "#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% percentile 99.9%"
    m = re.search(r"^\s*64\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                  r"\s+([\d.]+)", r.stdout, re.M)  # fmt: skip
    assert m, r.stdout
    return {"p50": float(m.group(3)), "p99": float(m.group(6))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--old", help="also measure the probe of this git revision")
    args = ap.parse_args()
    with GuestCluster(count=2, memory_mb=1024) as guests:
        for g in guests:
            g.run(SETUP, timeout=120, check=True)
        for g in guests:
            g.run("cp /share/node-agent/metaroce_agent/probe.py /tmp/probe_now.py", timeout=30)
        arms = [("now", "probe_now")]
        if args.old:
            old = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{args.old}:node-agent/metaroce_agent/probe.py"],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            for g in guests:
                g.write_file("/tmp/probe_old.py", old)
            arms.append((args.old, "probe_old"))
        results = {}
        for name, module in arms:
            print(f"probe {name}: {args.rounds} session(s)", flush=True)
            results[name] = run_probe(guests, module, args.rounds)
            print(f"  {results[name]}", flush=True)
        print("ib_send_lat (reference)", flush=True)
        ref = perftest(guests, 1000)
        print(f"  {ref}", flush=True)
    print("\nresults (TCG guests; ratios count)")
    for name, r in results.items():
        print(
            f"  probe {name}: p50 {r['p50']:.0f} us, p99 {r['p99']:.0f} us over {r['n']} RTTs; "
            f"p50 / ib_send_lat {r['p50'] / ref['p50']:.2f}, p99 / ib_send_lat "
            f"{r['p99'] / ref['p99']:.2f}; UD loss {r['loss']}; server CPU "
            f"{r['server_cpu_per_round_s']:.3f} s per session"
        )
    print(f"  ib_send_lat: typical {ref['p50']:.0f} us, 99% {ref['p99']:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
