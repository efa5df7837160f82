"""Guest or pod side: an RC queue pair written with pyverbs moves data both ways.

    python3 rc_pingpong.py server --port P [--tc TC] [--size N] [--rounds R] [--bw-seconds S]
    python3 rc_pingpong.py client --server IP --port P [--tc TC] [--size N] [--rounds R]
        [--bw-seconds S] [--depth D]

The two sides swap QP numbers, PSNs, GIDs and their buffer's address and rkey over TCP
(out of band). Each round the client RDMA-WRITEs a pattern into the server's buffer and
SENDs a message; the server checks both, then does the same the other way. The first
completion prints a `first-rdma` line (flushed) so a caller can time it. With
``--bw-seconds`` the client then streams RDMA WRITEs of ``--size`` bytes, ``--depth`` in
flight, for that long and reports the bandwidth (the server waits for its final SEND).

``--tc`` is the traffic class of this side's QP: it goes into the GRH of the address
vector given at RTR, and rxe puts it in the IP ToS byte of every packet the QP sends
(requests and ACKs); the QP's address vector is read back (`qp_traffic_class`).

In a pod the defaults come from what the MetaRoCE webhook and device plugin injected, as
NCCL would read them: the device from NCCL_IB_HCA, the GID index from NCCL_IB_GID_INDEX,
the traffic class from NCCL_IB_TC, the ACK timeout and retries from NCCL_IB_TIMEOUT and
NCCL_IB_RETRY_CNT. In a guest (no such variables) it finds the RoCE v2 GID of eth0.
Prints a JSON summary; exits non-zero on any mismatch.
"""

import argparse
import json
import os
import random
import socket
import sys
import time

import pyverbs.device as d
import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ


def local_ipv4_gid(ctx, ip: str) -> tuple[int, str]:
    """The RoCE v2 GID of port 1 that carries this IPv4 address."""
    want = "0000:0000:0000:0000:0000:ffff:" + "".join(
        f"{int(a):02x}{int(b):02x}:" for a, b in [ip.split(".")[0:2], ip.split(".")[2:4]]
    ).rstrip(":")
    for index in range(ctx.query_port(1).gid_tbl_len):
        try:
            entry = ctx.query_gid_ex(1, index)
        except Exception:
            break
        if entry.gid_type == e.IBV_GID_TYPE_ROCE_V2 and entry.gid_str() == want:
            return index, entry.gid_str()
    raise SystemExit(f"no RoCE v2 GID for {ip} (wanted {want})")


def env_device(default: str) -> str:
    """The first device NCCL_IB_HCA names (`=rxe_eth0:1,...` -> `rxe_eth0`)."""
    hca = os.environ.get("NCCL_IB_HCA", "").lstrip("=^")
    return hca.split(",")[0].split(":")[0] or default


def env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else default


def eth0_ip() -> str:
    with os.popen("ip -4 -o addr show dev eth0") as f:
        return f.read().split()[3].split("/")[0]


def oob(args) -> socket.socket:
    if args.role == "server":
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("0.0.0.0", args.port))
        ls.listen(1)
        print("listening", flush=True)
        conn, _ = ls.accept()
        ls.close()
        return conn
    deadline = time.monotonic() + 60
    while True:
        try:
            return socket.create_connection((args.server, args.port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Peer:
    """Newline-delimited JSON over the out-of-band TCP connection."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lines = conn.makefile("r")

    def swap(self, mine: dict) -> dict:
        self.conn.sendall((json.dumps(mine) + "\n").encode())
        line = self.lines.readline()
        if not line:
            raise SystemExit("peer closed the out-of-band connection")
        return json.loads(line)


def poll(cq: CQ, count: int, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    done = 0
    while done < count:
        n, wcs = cq.poll(count - done)
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise SystemExit(f"{what}: work completion failed with status {wc.status}")
        done += n
        if n == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: {done} of {count} completions after {timeout} s")
            time.sleep(0.001)


def pattern(tag: str, round_: int, size: int) -> bytes:
    return random.Random(f"{tag}-{round_}").randbytes(size)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--server")
    p.add_argument("--port", type=int, default=18515)
    p.add_argument("--dev", default=env_device("rxe0"))
    p.add_argument("--tc", type=int, default=env_int("NCCL_IB_TC", 0))
    p.add_argument("--gid-index", type=int, default=env_int("NCCL_IB_GID_INDEX", None))
    p.add_argument("--timeout", type=int, default=env_int("NCCL_IB_TIMEOUT", 14))
    p.add_argument("--retry", type=int, default=env_int("NCCL_IB_RETRY_CNT", 7))
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bw-seconds", type=float, default=0.0)
    p.add_argument("--depth", type=int, default=16)
    args = p.parse_args()
    size = args.size

    ctx = d.Context(name=args.dev)
    pd = PD(ctx)
    cq = CQ(ctx, 256, None, None, 0)
    # [0, size): receive buffer for SENDs; [size, 2 size): target of the peer's WRITEs;
    # [2 size, 3 size): what this side sends.
    mr = MR(pd, 3 * size, ACCESS)
    depth = max(args.depth, 16)  # the send queue also holds the ping-pong WRs
    cap = QPCap(max_send_wr=depth, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
    qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    if args.gid_index is None:
        gid_index, gid = local_ipv4_gid(ctx, eth0_ip())
    else:
        gid_index, gid = args.gid_index, ctx.query_gid(1, args.gid_index).gid
    psn = random.randrange(1 << 24)

    conn = Peer(oob(args))
    peer = conn.swap({"qpn": qp.qp_num, "psn": psn, "gid": gid, "rkey": mr.rkey, "addr": mr.buf})

    attr = QPAttr(port_num=1)
    attr.qp_access_flags = ACCESS
    attr.path_mtu = e.IBV_MTU_1024
    attr.dest_qp_num = peer["qpn"]
    attr.rq_psn = peer["psn"]
    attr.sq_psn = psn
    attr.max_dest_rd_atomic = 1
    attr.max_rd_atomic = 1
    attr.min_rnr_timer = 12
    attr.timeout = args.timeout
    attr.retry_cnt = args.retry
    attr.rnr_retry = 7
    gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=gid_index, traffic_class=args.tc)
    gr.hop_limit = 64
    attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=1)
    qp.to_rts(attr)
    qp_tc = qp.query(e.IBV_QP_AV)[0].ah_attr.traffic_class

    first: list[float] = []

    def first_completion() -> None:
        if not first:
            first.append(time.time())
            print("first-rdma", flush=True)

    def post_recv() -> None:
        qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf, size, mr.lkey)]))

    def write_and_send(tag: str, round_: int) -> None:
        mr.write(pattern(tag + "-write", round_, size), size, 2 * size)
        sge = SGE(mr.buf + 2 * size, size, mr.lkey)
        wr = SendWR(
            wr_id=2, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED
        )
        wr.set_wr_rdma(peer["rkey"], peer["addr"] + size)
        qp.post_send(wr)
        poll(cq, 1, f"RDMA WRITE ({tag})")
        first_completion()
        mr.write(pattern(tag + "-send", round_, size), size, 2 * size)
        wr = SendWR(
            wr_id=3, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED
        )
        qp.post_send(wr)
        poll(cq, 1, f"SEND ({tag})")

    def receive_and_check(tag: str, round_: int) -> None:
        poll(cq, 1, f"RECV ({tag})")
        first_completion()
        got_write = mr.read(size, size)
        got_send = mr.read(size, 0)
        if got_write != pattern(tag + "-write", round_, size):
            raise SystemExit(f"round {round_}: the RDMA WRITE from the {tag} did not arrive intact")
        if got_send != pattern(tag + "-send", round_, size):
            raise SystemExit(f"round {round_}: the SEND from the {tag} did not arrive intact")

    moved = {"client_to_server": 0, "server_to_client": 0}
    t0 = time.monotonic()
    for r in range(args.rounds):
        post_recv()
        conn.swap({"ready": r})  # both receive queues hold a WR before anyone sends
        if args.role == "client":
            write_and_send("client", r)
            receive_and_check("server", r)
        else:
            receive_and_check("client", r)
            write_and_send("server", r)
        moved["client_to_server"] += 2 * size
        moved["server_to_client"] += 2 * size
        conn.swap({"done": r})
    elapsed = time.monotonic() - t0
    bandwidth = stream(args, qp, cq, mr, peer, conn, post_recv) if args.bw_seconds else None
    print(
        json.dumps(
            {
                "role": args.role,
                "qpn": qp.qp_num,
                "peer_qpn": peer["qpn"],
                "gid": gid,
                "peer_gid": peer["gid"],
                "traffic_class": args.tc,
                "qp_traffic_class": qp_tc,
                "device": args.dev,
                "gid_index": gid_index,
                "bytes": moved,
                "rounds": args.rounds,
                "seconds": round(elapsed, 3),
                "verified": True,
                **(bandwidth or {}),
            }
        )
    )
    conn.conn.close()


def stream(args, qp: QP, cq: CQ, mr: MR, peer: dict, conn: Peer, post_recv) -> dict:
    """The client RDMA-WRITEs `size` bytes, `depth` in flight, for `bw_seconds`, then
    SENDs; the server waits for that SEND. Both report what the client measured."""
    size = args.size
    if args.role == "server":
        post_recv()
        conn.swap({"bw": "ready"})
        poll(cq, 1, "RECV (end of stream)", timeout=args.bw_seconds + 120)
        return conn.swap({"bw": "done"})
    conn.swap({"bw": "ready"})
    sge = SGE(mr.buf + 2 * size, size, mr.lkey)
    depth, posted, completed = args.depth, 0, 0
    t0 = time.monotonic()
    deadline = t0 + args.bw_seconds
    while True:
        now = time.monotonic()
        while posted - completed < depth and now < deadline:
            wr = SendWR(wr_id=4, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                        send_flags=e.IBV_SEND_SIGNALED)  # fmt: skip
            wr.set_wr_rdma(peer["rkey"], peer["addr"] + size)
            qp.post_send(wr)
            posted += 1
        if completed == posted:
            break
        n, wcs = cq.poll(depth)
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise SystemExit(f"RDMA WRITE stream: completion status {wc.status}")
        completed += n
        if n == 0:
            if now > deadline + 120:
                raise SystemExit(f"RDMA WRITE stream: {posted - completed} WRs never completed")
            time.sleep(0.0002)
    elapsed = time.monotonic() - t0
    wr = SendWR(wr_id=5, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
    qp.post_send(wr)
    poll(cq, 1, "SEND (end of stream)")
    result = {"bw_bytes": completed * size, "bw_seconds": round(elapsed, 3),
              "bw_gbps": round(completed * size * 8 / elapsed / 1e9, 4)}  # fmt: skip
    conn.swap(result)
    return result


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print(f"rc_pingpong: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
