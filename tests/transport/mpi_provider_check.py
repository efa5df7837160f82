"""MPI semantics over the metaroce libfabric provider (Open MPI, pml cm, mtl ofi).

Run by tests/transport/test_libfabric_provider.py under mpirun with 2 or more ranks;
each rank prints "CHECK <name> ok" per check and "ALL-OK rank N" at the end, and any
failure raises (mpirun then exits non-zero). Uses only the standard library and mpi4py
(Debian's python3-mpi4py), so it runs under /usr/bin/python3.
"""

from __future__ import annotations

import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()


def ok(name: str) -> None:
    comm.Barrier()
    print(f"CHECK {name} ok rank {rank}", flush=True)


def pattern(n: int, seed: int) -> bytearray:
    return bytearray((i * 31 + seed) & 0xFF for i in range(n))


def check_pickled() -> None:
    # comm.recv() of a pickled object: mpi4py uses MPI_Mprobe + MPI_Mrecv,
    # i.e. fi_trecvmsg(FI_PEEK | FI_CLAIM) then fi_trecvmsg(FI_CLAIM).
    if rank == 0:
        for dst in range(1, size):
            comm.send({"to": dst, "payload": list(range(dst * 10))}, dest=dst, tag=5)
        replies = sorted(comm.recv(source=MPI.ANY_SOURCE, tag=6) for _ in range(1, size))
        assert replies == [("back", r) for r in range(1, size)], replies
    else:
        obj = comm.recv(source=0, tag=5)
        assert obj == {"to": rank, "payload": list(range(rank * 10))}, obj
        comm.send(("back", rank), dest=0, tag=6)
    ok("pickled")


def check_any_source_any_tag() -> None:
    if rank == 0:
        seen = set()
        for _ in range(1, size):
            buf = bytearray(8)
            status = MPI.Status()
            comm.Recv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            src = int.from_bytes(buf, "little")
            assert status.Get_source() == src, (status.Get_source(), src)
            assert status.Get_tag() == 100 + src, status.Get_tag()
            assert status.Get_count(MPI.BYTE) == 8
            seen.add(src)
        assert seen == set(range(1, size)), seen
    else:
        comm.Send(rank.to_bytes(8, "little"), dest=0, tag=100 + rank)
    ok("any_source_any_tag")


def check_cancel() -> None:
    # A receive nobody matches: fi_cancel succeeds, the CQ reports FI_ECANCELED.
    buf = bytearray(16)
    req = comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=4242)
    req.Cancel()
    status = MPI.Status()
    req.Wait(status)
    assert status.Is_cancelled(), "Irecv was not cancelled"
    ok("cancel")


def check_truncation() -> None:
    # 100 bytes into a 10-byte buffer: FI_ETRUNC -> MPI_ERR_TRUNCATE.
    if rank == 1:
        comm.Send(pattern(100, 1), dest=0, tag=11)
    elif rank == 0:
        small = bytearray(10)
        try:
            comm.Recv(small, source=1, tag=11)
        except MPI.Exception as e:
            assert e.Get_error_class() == MPI.ERR_TRUNCATE, e.Get_error_string()
        else:
            raise AssertionError("a 100-byte message fit a 10-byte buffer")
    ok("truncation")


def check_issend() -> None:
    # Issend completes only once the receiver matched it.
    if rank == 1:
        req = comm.Issend(pattern(64, 2), dest=0, tag=12)
        time.sleep(0.3)
        assert not req.Test(), "Issend completed before the receive was posted"
        comm.send("posting", dest=0, tag=13)
        req.Wait()
    elif rank == 0:
        assert comm.recv(source=1, tag=13) == "posting"
        buf = bytearray(64)
        comm.Recv(buf, source=1, tag=12)
        assert buf == pattern(64, 2)
    ok("issend")


def check_mprobe_iprobe() -> None:
    if rank == 1:
        comm.Send(pattern(300, 3), dest=0, tag=14)
        comm.Send(pattern(5, 4), dest=0, tag=15)
    elif rank == 0:
        assert not comm.Iprobe(source=1, tag=999), "Iprobe found a message never sent"
        status = MPI.Status()
        msg = comm.Mprobe(source=1, tag=14, status=status)
        assert status.Get_count(MPI.BYTE) == 300
        buf = bytearray(300)
        msg.Recv(buf)
        assert buf == pattern(300, 3)
        m = None
        deadline = time.monotonic() + 30
        while m is None and time.monotonic() < deadline:
            m = comm.Improbe(source=MPI.ANY_SOURCE, tag=15)
        assert m is not None, "Improbe never matched"
        small = bytearray(5)
        m.Recv(small)
        assert small == pattern(5, 4)
    ok("mprobe_iprobe")


def check_sizes_and_order() -> None:
    # Zero bytes, eager-sized and rendezvous-sized messages, and send order kept
    # between one pair of endpoints (FI_ORDER_SAS).
    sizes = [0, 1, 4095, 4096, 65537, 4 * 1024 * 1024 + 3]
    if rank == 1:
        for i, n in enumerate(sizes):
            comm.Send(pattern(n, i), dest=0, tag=20)
        for i in range(200):
            comm.Send(i.to_bytes(4, "little"), dest=0, tag=21)
    elif rank == 0:
        for i, n in enumerate(sizes):
            buf = bytearray(n)
            status = MPI.Status()
            comm.Recv(buf, source=1, tag=20, status=status)
            assert status.Get_count(MPI.BYTE) == n
            assert buf == pattern(n, i), f"size {n} corrupted"
        for i in range(200):
            buf = bytearray(4)
            comm.Recv(buf, source=1, tag=21)
            assert int.from_bytes(buf, "little") == i, "out of order"
    ok("sizes_and_order")


def check_collectives() -> None:
    total = comm.allreduce(rank + 1, op=MPI.SUM)
    assert total == size * (size + 1) // 2, total
    gathered = comm.allgather(rank)
    assert gathered == list(range(size)), gathered
    ok("collectives")


def main() -> int:
    assert size >= 2, "run with at least 2 ranks"
    check_pickled()
    check_any_source_any_tag()
    check_cancel()
    check_truncation()
    check_issend()
    check_mprobe_iprobe()
    check_sizes_and_order()
    check_collectives()
    print(f"ALL-OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
