"""Samples the rx_bytes of network devices every --every-us microseconds for --seconds
and prints one JSON list of [CLOCK_MONOTONIC seconds, [bytes per device]].

Run inside the receiving namespace (`ip netns exec NS python3 ...`): a device's rx
counter grows when its veth peer transmits, i.e. when the shaping qdisc releases
the packet, so these samples time the bytes on the wire and not when an endpoint
got round to reading or acknowledging them (it also counts what the receiving end's
nftables then drops: the caller leaves a blackholed link out). The monotonic clock is
system-wide, so the caller can place the samples against its own events."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("devices", help="comma-separated device names")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--every-us", type=int, default=500)
    a = ap.parse_args()
    fds = [
        os.open(f"/sys/class/net/{d}/statistics/rx_bytes", os.O_RDONLY)
        for d in a.devices.split(",")
    ]
    end = time.monotonic() + a.seconds
    samples: list[tuple[float, list[int]]] = []
    while True:
        now = time.monotonic()
        samples.append((now, [int(os.pread(fd, 32, 0)) for fd in fds]))
        if now > end:
            break
        time.sleep(a.every_us / 1e6)
    json.dump(samples, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
