"""Guest side: an RC connection made by rdma_cm (pyverbs CMID) exchanges messages.

    python3 cm_pingpong.py server --addr MY_IP [--port P] [--size N] [--count K]
    python3 cm_pingpong.py client --addr MY_IP --server IP [--port P] [--size N] [--count K]

rdma_cm resolves the route itself, so the IP ToS of this connection's packets is what
rdma_cm chose: the device's configfs ``default_roce_tos`` unless the application set
one. Each of ``count`` messages goes client -> server and comes back. The server prints
"listening" once it accepts connections. Prints a JSON summary; exits non-zero on error.
"""

import argparse
import json
import sys
import time

import pyverbs.cm_enums as ce
import pyverbs.enums as e
from pyverbs.cmid import CMID, AddrInfo
from pyverbs.qp import QPCap, QPInitAttr


def message(i: int, size: int) -> bytes:
    return (f"message {i} ".encode() * (size // 8 + 1))[:size]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--addr", required=True, help="this guest's eth0 address")
    p.add_argument("--server")
    p.add_argument("--port", type=int, default=7471)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--count", type=int, default=8)
    args = p.parse_args()
    size = args.size

    cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
    init = QPInitAttr(qp_type=e.IBV_QPT_RC, cap=cap, sq_sig_all=1)
    t0 = time.monotonic()
    if args.role == "server":
        ai = AddrInfo(
            src=args.addr,
            src_service=str(args.port),
            port_space=ce.RDMA_PS_TCP,
            flags=ce.RAI_PASSIVE,
        )
        listener = CMID(creator=ai, qp_init_attr=init)
        listener.listen()
        print("listening", flush=True)
        cmid = listener.get_request()
        mr = cmid.reg_msgs(size)
        cmid.post_recv(mr, size)
        cmid.accept()
        for i in range(args.count):
            cmid.get_recv_comp()
            got = mr.read(size, 0)
            if got != message(i, size):
                raise SystemExit(f"message {i} arrived damaged: {got[:32]!r}")
            if i + 1 < args.count:
                cmid.post_recv(mr, size)  # the next request can only come after the reply
            cmid.post_send(mr, e.IBV_SEND_SIGNALED, size)  # echo it back
            cmid.get_send_comp()
    else:
        ai = AddrInfo(
            src=args.addr, dst=args.server, dst_service=str(args.port), port_space=ce.RDMA_PS_TCP
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                cmid = CMID(creator=ai, qp_init_attr=init)
                smr = cmid.reg_msgs(size)
                rmr = cmid.reg_msgs(size)
                cmid.connect()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for i in range(args.count):
            cmid.post_recv(rmr, size)
            smr.write(message(i, size), size, 0)
            cmid.post_send(smr, e.IBV_SEND_SIGNALED, size)
            cmid.get_send_comp()
            cmid.get_recv_comp()
            got = rmr.read(size, 0)
            if got != message(i, size):
                raise SystemExit(f"echo of message {i} came back damaged: {got[:32]!r}")
    elapsed = time.monotonic() - t0
    print(
        json.dumps(
            {
                "role": args.role,
                "qpn": cmid.qpn,
                "messages": args.count,
                "bytes_each_way": args.count * size,
                "seconds": round(elapsed, 3),
                "verified": True,
            }
        )
    )
    cmid.close()


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print(f"cm_pingpong: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
