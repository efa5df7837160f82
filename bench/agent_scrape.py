"""Benchmark: one metrics scrape of the agent with 8 RDMA devices (fixture tree).

Builds a node with 8 mlx5-style devices (2 ports each: IB port counters, hw_counters and
device-level hw_counters, the naming mlx5 uses) plus the rxe naming on 2 more, then times
full scrapes (read + text exposition: the body the HTTP handler sends) of the agent's
registry. Prints median and p95 next to the 50 ms budget. Not a timed test.

    .venv/bin/python bench/agent_scrape.py [--scrapes 200]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args()
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
