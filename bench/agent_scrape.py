"""Benchmark: metrics scrapes of the agent, over files and over the kernel's sysfs.

1. fixture tree (default): a node with 8 mlx5-style devices (2 ports each: IB port
   counters, hw_counters and device-level hw_counters, the naming mlx5 uses) plus the rxe
   naming on 2 more, as plain files in a temp directory; full scrapes (read + text
   exposition: the body the HTTP handler sends) timed against the 50 ms budget. This is
   the cost of the agent's own work per counter, NOT of sysfs: mlx5 `hw_counters` reads
   query the firmware, which no machine here has.
2. `--guest`: the same scrape in a SoftRoCE guest over the real sysfs of an rxe device
   (whose hw_counters the kernel computes per read) and, side by side in the same guest,
   over a copy of those files in tmpfs: the ratio is what a real sysfs costs over files.

    .venv/bin/python bench/agent_scrape.py [--scrapes 200] [--guest]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "agent"))

from fakes import MLX5_HW_COUNTERS, FixtureHost, SysfsTree

from metaroce_agent.exporter import AgentMetrics, RdmaCounterCollector

BUDGET_MS = 50.0


def build(root: Path, devices: int) -> SysfsTree:
    t = SysfsTree(root)
    for i in range(devices):
        nd = f"ens{i + 1}f0"
        t.netdev(nd, pci=f"0000:{0x3B + i:02x}:00.0", numa=i % 2, ipv4=[f"192.168.{i}.5/24"])
        t.rdma(
            f"mlx5_{i}",
            netdev=nd,
            ports=2,
            counter_value=123456789 + i,
            device_hw_counters=[f"dev_{c}" for c in MLX5_HW_COUNTERS[:10]],
        )
    for i in range(2):
        nd = f"eth{i}"
        t.netdev(nd, virtio=True, ipv4=[f"10.1.{i}.5/24"])
        t.rdma(f"rxe{i}", netdev=nd, software=True, counter_value=42)
    return t


GUEST_SCRAPE = r"""
import shutil, statistics, sys, time
from pathlib import Path
sys.path.insert(0, "/share/tests/unit/agent")
from fakes import FixtureHost
from metaroce_agent.exporter import RdmaCounterCollector
from metaroce_agent.host import Host
base = "/sys/class/infiniband/rxe_eth0"
copy = Path("/tmp/scrape-copy")
shutil.rmtree(copy, ignore_errors=True)
for sub in ("ports/1/hw_counters", "hw_counters"):
    src = Path(base) / sub
    if src.is_dir():
        dst = copy / base.lstrip("/") / sub
        dst.mkdir(parents=True)
        for f in src.iterdir():
            try:
                (dst / f.name).write_text(f.read_text())
            except OSError:
                pass
def timed(host, n):
    c = RdmaCounterCollector(host, "bench", devices=lambda: [("rxe_eth0", "eth0")])
    body = c.render()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); c.render(); ts.append((time.perf_counter() - t0) * 1000)
    return statistics.median(ts), body.count("\n")
n = int(sys.argv[1])
for _ in range(2):  # interleaved, twice
    real, lines = timed(Host(), n)
    files, lines2 = timed(FixtureHost(copy), n)
    print(f"sysfs {real:.3f} ms, tmpfs copy {files:.3f} ms, {lines} and {lines2} lines, "
          f"ratio {real / files:.2f}")
"""


def guest_arm(scrapes: int) -> None:
    from metaroce_harness.guests import GuestCluster

    with GuestCluster(count=1, memory_mb=1024) as guests:
        g = guests[0]
        g.run("modprobe rdma_rxe && rdma link add rxe_eth0 type rxe netdev eth0", timeout=120,
              check=True)  # fmt: skip
        g.write_file("/tmp/scrape.py", GUEST_SCRAPE)
        r = g.run(f"python3 /tmp/scrape.py {scrapes}", timeout=600, check=True)
        print("scrape of one rxe device in a TCG guest, median of each arm:")
        for line in r.stdout.strip().splitlines():
            print(f"  {line}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--guest", action="store_true", help="sysfs vs tmpfs in a SoftRoCE guest")
    args = ap.parse_args()
    if args.guest:
        guest_arm(args.scrapes)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tree = build(Path(tmp), args.devices)
        metrics = AgentMetrics("bench", "node-1")
        metrics.add_rdma_collector(RdmaCounterCollector(FixtureHost(tree.root), "bench"))
        body = metrics.render()  # warm-up, and the size
        samples = sum(1 for line in body.decode().splitlines() if line and line[0] != "#")
        times = []
        for _ in range(args.scrapes):
            t0 = time.perf_counter()
            metrics.render()
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    med = statistics.median(times)
    p95 = times[int(0.95 * (len(times) - 1))]
    print(
        f"metrics scrape, {args.devices} mlx5 devices x 2 ports + 2 rxe: {samples} samples, "
        f"{len(body) // 1024} KiB"
    )
    print(
        f"  median {med:.2f} ms, p95 {p95:.2f} ms, max {times[-1]:.2f} ms "
        f"over {args.scrapes} scrapes (budget {BUDGET_MS:.0f} ms)"
    )
    print(f"  p95 / budget = {p95 / BUDGET_MS:.2f} ({'OK' if p95 < BUDGET_MS else 'OVER'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
