"""mpi4py programs run by mpirun.py across the fabric (Debian's /usr/bin/python3 + mpi4py).

    semantics [--skip A,B] point-to-point semantics real clients rely on; prints "OK <check>"
                         per check and "ALL OK" at the end (any failure aborts the job)
    allreduce SIZES      allreduce timing per size in bytes (comma list), data checked;
                         one JSON line per size from rank 0
    bandwidth SIZE       osu_bw-style streaming from rank 0 (namespace A) to the last rank
                         (namespace B): a window of Isend; one JSON line from rank 0

No numpy in Debian's python3 here: buffers are `array('q')` with a position-dependent
pattern whose period (4099 elements, a prime) aligns with no packet or chunk size, so a
byte placed at the wrong offset changes the checked result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from array import array

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
PERIOD = 4099


def pattern(n: int, salt: int) -> array[int]:
    base = array("q", ((i * 2654435761 + salt * 97) % 1000003 for i in range(PERIOD)))
    reps = n // PERIOD + 1
    return (base * reps)[:n]


def pattern_sum(n: int, ranks: int) -> array[int]:
    """The elementwise sum of pattern(n, r) over r < ranks (periodic, so summed per period)."""
    one = array("q", bytes(8 * PERIOD))
    for r in range(ranks):
        p = pattern(PERIOD, r)
        one = array("q", (a + b for a, b in zip(one, p, strict=True)))
    return (one * (n // PERIOD + 1))[:n]


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"FAIL rank {rank}: {what}", flush=True)
        comm.Abort(3)


failed: list[str] = []
"""Checks that failed without desynchronising the ranks (rank 0 only); reported at the end."""


def ok(what: str, name: str = "") -> None:
    comm.Barrier()
    if rank == 0:
        bad = [f for f in failed if name and f.startswith(name + ":")]
        print(f"FAIL {bad[0]}" if bad else f"OK {what}", flush=True)


LAST = size - 1


def check_namespaces() -> None:
    # more than one rank per namespace: ranks sharing a network namespace talk too. The
    # kernel's boot id with the inode: two guests booted alike number their namespaces alike
    with open("/proc/sys/kernel/random/boot_id") as f:
        net = f"{f.read().strip()[:8]}/{os.readlink('/proc/self/ns/net')}"
    nets = comm.allgather(net)
    check(
        all(nets.count(n) >= 2 for n in nets) and len(set(nets)) >= 2,
        f"namespaces {nets}",
    )
    ok(f"ranks per namespace {sorted(nets.count(n) for n in set(nets))}")


def check_pickled() -> None:
    # pickled recv (mpi4py's recv uses a matched probe: MPI_Mprobe + MPI_Mrecv)
    if rank == 0:
        for dst in range(1, size):
            comm.send({"to": dst, "blob": b"x" * (dst * 70000)}, dest=dst, tag=7)
    else:
        msg = comm.recv(source=0, tag=7)
        check(msg["to"] == rank and len(msg["blob"]) == rank * 70000, "pickled recv content")
    ok(f"pickled recv (matched probe), up to {(size - 1) * 70000 // 1024} KiB")


def check_any() -> None:
    # ANY_SOURCE / ANY_TAG, with the status telling who and which tag
    if rank == 0:
        seen = set()
        for _ in range(size - 1):
            st = MPI.Status()
            val = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
            check(val == st.Get_source() * 3 and st.Get_tag() == 100 + st.Get_source(), "status")
            seen.add(st.Get_source())
        check(seen == set(range(1, size)), f"ANY_SOURCE got {seen}")
    else:
        comm.send(rank * 3, dest=0, tag=100 + rank)
    ok("ANY_SOURCE/ANY_TAG with status")


def check_order() -> None:
    # directed receive order: same source, same tag, messages arrive in order (FI_ORDER_SAS)
    if rank == 0:
        for i in range(200):
            comm.Send(array("q", [i]), dest=LAST, tag=11)
    elif rank == LAST:
        buf = array("q", [0])
        for i in range(200):
            comm.Recv(buf, source=0, tag=11)
            check(buf[0] == i, f"order: got {buf[0]} expected {i}")
    ok("message order per pair and tag (200 messages)")


def check_cancel() -> None:
    # Cancel of a posted receive nobody matches
    if rank == 0:
        buf = array("q", [0])
        req = comm.Irecv(buf, source=LAST, tag=999)
        req.Cancel()
        st = MPI.Status()
        req.Wait(st)
        check(st.Is_cancelled(), "Irecv not cancelled")
    ok("Cancel of a posted receive")


def check_truncation() -> None:
    # truncation: a 1000-element message into a 10-element buffer is MPI_ERR_TRUNCATE
    if rank == LAST:
        comm.Send(array("q", range(1000)), dest=0, tag=21)
    elif rank == 0:
        small = array("q", [0] * 10)
        st = MPI.Status()
        try:
            comm.Recv(small, source=LAST, tag=21, status=st)
            failed.append(
                "truncation: a 8000 B message into an 80 B buffer completed without"
                f" MPI_ERR_TRUNCATE (count {st.Get_count(MPI.BYTE)} B)"
            )
        except MPI.Exception as e:
            check(e.Get_error_class() == MPI.ERR_TRUNCATE, f"error class {e.Get_error_class()}")
    ok("truncation reported as MPI_ERR_TRUNCATE", "truncation")


def check_issend() -> None:
    # Issend completes only once the receive is matched
    if rank == 0:
        req = comm.Issend(array("q", [42]), dest=LAST, tag=31)
        time.sleep(0.5)
        done_early = req.Test()
        comm.send("posted?", dest=LAST, tag=32)
        req.Wait()
        check(not done_early, "Issend completed before the receive was posted")
    elif rank == LAST:
        comm.recv(source=0, tag=32)
        buf = array("q", [0])
        comm.Recv(buf, source=0, tag=31)
        check(buf[0] == 42, "Issend data")
    ok("Issend completes only after the match")


def check_large() -> None:
    # zero-byte message, and a large one with every byte checked, across namespaces
    if rank == 0:
        comm.Send(bytearray(0), dest=LAST, tag=41)
        comm.Send(pattern(1 << 20, 5), dest=LAST, tag=42)
    elif rank == LAST:
        st = MPI.Status()
        comm.Recv(bytearray(0), source=0, tag=41, status=st)
        check(st.Get_count(MPI.BYTE) == 0, "zero-byte count")
        buf = array("q", bytes(8 << 20))
        comm.Recv(buf, source=0, tag=42)
        check(buf == pattern(1 << 20, 5), "8 MiB message content")
    ok("zero-byte and 8 MiB messages, content checked")


def check_allreduce() -> None:
    # allreduce with the data checked
    for nbytes in (8, 4096, 1 << 20, 4 << 20):
        n = nbytes // 8
        out = array("q", bytes(nbytes))
        comm.Allreduce(pattern(n, rank), out, op=MPI.SUM)
        want = pattern_sum(n, size)
        check(out == want, f"allreduce {nbytes} B content")
    ok("allreduce 8 B..4 MiB, content checked")


CHECKS = {
    "namespaces": check_namespaces,
    "pickled": check_pickled,
    "any": check_any,
    "order": check_order,
    "cancel": check_cancel,
    "truncation": check_truncation,
    "issend": check_issend,
    "large": check_large,
    "allreduce": check_allreduce,
}


def semantics(skip: set[str]) -> None:
    check(size >= 4, f"needs >= 4 ranks (2 per namespace), got {size}")
    unknown = skip - set(CHECKS)
    check(not unknown, f"--skip {sorted(unknown)}: checks are {', '.join(CHECKS)}")
    for name, fn in CHECKS.items():
        if name in skip:
            if rank == 0:
                print(f"SKIP {name} (asked: a known gap of this provider)", flush=True)
            continue
        fn()
    if rank == 0:
        print("ALL OK" if not failed else f"FAILED {len(failed)}", flush=True)
    if failed:
        sys.exit(1)


def allreduce(sizes: list[int], budget_s: float) -> None:
    """Per size: warm up, then iterate for ~budget_s (at least 5, at most 1000 times);
    report median and p99 of per-iteration times, the slowest rank's time counting."""
    for nbytes in sizes:
        n = max(1, nbytes // 8)
        src = pattern(n, rank)
        out = array("q", bytes(n * 8))
        comm.Allreduce(src, out, op=MPI.SUM)
        want = pattern_sum(n, size)
        good = out == want
        times: list[float] = []
        start = time.monotonic()
        # Only rank 0's clock decides when to stop (the bcast): a loop condition on each
        # rank's own clock let a rank leave while the others went on, a deadlock that
        # looked like a hung transport.
        while True:
            comm.Barrier()
            t0 = MPI.Wtime()
            comm.Allreduce(src, out, op=MPI.SUM)
            dt = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
            times.append(dt)
            elapsed = time.monotonic() - start
            stop = comm.bcast(len(times) >= 1000 or (elapsed >= budget_s and len(times) >= 5))
            if stop:
                break
        good = good and out == want
        good = comm.allreduce(good, op=MPI.LAND)
        if rank == 0:
            times.sort()
            p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
            print(
                json.dumps(
                    {
                        "size": n * 8,
                        "iters": len(times),
                        "median_s": statistics.median(times),
                        "p99_s": p99,
                        "correct": good,
                    }
                ),
                flush=True,
            )


def bandwidth(nbytes: int, seconds: float, window: int = 16) -> None:
    """Rank 0 streams `window` Isends of `nbytes` per round to the last rank, which acks
    each round with a zero-byte message (osu_bw style); rounds for ~`seconds`."""
    last = size - 1
    buf = pattern(max(1, nbytes // 8), 9)
    rounds = 0
    sent = 0
    if rank == 0:
        start = MPI.Wtime()
        t_cpu = time.process_time()
        while True:
            reqs = [comm.Isend(buf, dest=last, tag=51) for _ in range(window)]
            MPI.Request.Waitall(reqs)
            comm.Recv(bytearray(0), source=last, tag=52)
            rounds += 1
            sent += window * len(buf) * 8
            more = MPI.Wtime() - start < seconds
            comm.send(more, dest=last, tag=53)
            if not more:
                break
        el = MPI.Wtime() - start
        print(
            json.dumps(
                {
                    "size": len(buf) * 8,
                    "window": window,
                    "bytes": sent,
                    "seconds": el,
                    "mbit_s": sent * 8 / el / 1e6,
                    "cpu_s_sender": time.process_time() - t_cpu,
                }
            ),
            flush=True,
        )
    elif rank == last:
        rbufs = [array("q", bytes(len(buf) * 8)) for _ in range(window)]
        first = True
        while True:
            reqs = [comm.Irecv(rbufs[i], source=0, tag=51) for i in range(window)]
            MPI.Request.Waitall(reqs)
            if first:
                check(rbufs[0] == buf, "bandwidth payload content")
                first = False
            comm.Send(bytearray(0), dest=0, tag=52)
            if not comm.recv(source=0, tag=53):
                break


def main() -> None:
    cmd = sys.argv[1] if len(sys.argv) > 1 else "semantics"
    if cmd == "semantics":
        skip = (
            set(sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[2] == "--skip" else set()
        )
        semantics(skip)
    elif cmd == "allreduce":
        sizes = [int(x) for x in sys.argv[2].split(",")]
        budget = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
        allreduce(sizes, budget)
    elif cmd == "bandwidth":
        seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
        bandwidth(int(sys.argv[2]), seconds)
    else:
        raise SystemExit(f"mpi_checks.py: unknown command {cmd!r}: semantics|allreduce|bandwidth")


if __name__ == "__main__":
    main()
