"""RDMA probe: reachability and latency over RC, loss over UD, to a few peers. A metaroce
network (netdevs, no RDMA device) runs the same sessions over UDP (`probe_udp`).

Peers find each other through their NodeStates: each agent publishes the address of a
small TCP side channel (`<ip>:<port>` on the RDMA netdev) in the annotation
`metaroce.io/probe-endpoint`, and probes the next `peersPerNode` nodes after itself in
name order (a ring, so every node is probed by as many as it probes), on every served RDMA
device: rail k of this node against rail k of the peer (the hello names the rail). Peers
come from a metadata-only index of the NodeStates kept by a watch (`PeerIndex`). A probe
session:

1. TCP connect; the server opens with a nonce, the client answers with its hello (GID,
   QP numbers, PSN) MACed with the network's probe key (`probe_auth`), and only then does
   the server create a PD, CQs, an MR, one RC and one UD queue pair on the network's
   RDMA device and answer with its own MACed hello, which the client checks;
2. RC: the client sends small messages, the server echoes each: round-trip times give
   reachability and latency percentiles (RC retransmits, so it hides loss);
3. UD: the client sends a burst of datagrams and says how many, the server counts what
   arrives (asleep on its completion channel until all did or none has for
   COUNT_QUIET_SECONDS); the count over TCP gives the loss fraction (UD does not
   retransmit);
4. both sides destroy the queue pairs. Idle, the server only blocks in `accept()`.

The server runs each session in a thread of its own, at most MAX_SESSIONS at once (the
next client is told "busy"), and ends a session at SESSION_SECONDS whatever the peer does:
a peer that vanishes or an idle client on the port cannot make the node look
unreachable to everyone, and a client without the key gets nothing but an error. Without
a key file (the operator has not mounted the network's probe Secret) the channel is
unauthenticated and the agent says so at start.

Latencies and loss go to metrics every round; the verdict stands on samples kept per peer
across rounds (a p99 over LATENCY_SAMPLES RTTs, loss by a Wilson bound over up to
LOSS_WINDOW datagrams, with hysteresis), and each peer's entry says how many
(`latencySamples`, `lossDatagrams`, and the message). The NodeState's probe summary is
replaced only when the verdict changes: healthy, each peer's pass/fail, and whether its
figures stand on enough samples yet (once per peer, so a healthy node's figures reach the
NodeState once they are stated). The operator, not the agent, decides taints from these
summaries. Needs pyverbs (guests, agent image).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metaroce_agent.kube import METADATA_LIST, METADATA_WATCH, KubeClient, KubeError, cluster_path
from metaroce_agent.probe_auth import (
    ProbeKeyError,
    choose_key,
    key_id,
    load_keys,
    new_nonce,
    sign,
    verify,
)
from metaroce_agent.report import now
from metaroce_api import ProbePeer, ProbeSummary, constants
from metaroce_api.base import parse_duration

log = logging.getLogger("metaroce.agent.probe")

QKEY = 0x4D52
MSG = 64
RC_PINGS = 100
UD_BURST = 200
LATENCY_SAMPLES = 1000
"""RTTs behind a p99 (kept per peer across rounds): fewer, and the p99 is one sample's
noise; until then latency does not fail a peer."""
LOSS_WINDOW = 4000
"""UD datagrams per peer kept across rounds for the loss decision: a 1% limit needs about
2,000 per decision to keep false failures near 1e-3."""
MIN_LOSS_DATAGRAMS = 2000
"""Datagrams behind a published loss fraction."""
WILSON_Z = 3.09
"""One-sided z for about 1e-3: a peer fails when the Wilson lower bound of its loss is over
the limit, and recovers only when the upper bound is under it (hysteresis)."""
PING_TIMEOUT = 1.0
PING_MISSES = 3
"""Pings in a row without an echo that end the pings: RC answers every ping or fails,
but a UDP ping (a metaroce network's probe) may be lost, which is a missing sample."""
MAX_SESSIONS = 8
"""Probe sessions served at once (each holds a PD, two CQs and two QPs)."""
SESSION_SECONDS = 30.0
"""A session's whole life, hello to bye: a client probe takes about a second."""
COUNT_QUIET_SECONDS = 0.5
"""Asked for its UD count, the server waits until as many datagrams as the client sent
have completed, or none has for this long: late completions (a loaded or emulated node)
are counted, and a lost datagram costs this much wait, not a fixed nap on every probe."""
COUNT_MAX_SECONDS = 3.0
"""The longest a count waits, whatever trickles in."""
COUNT_SENT = "count-sent"
"""The server's feature (in its challenge) of counting until the client's `sent`;
without it (an agent from before) the client naps 0.2 s before asking, as it used to."""


@dataclass(frozen=True)
class Local:
    device: str
    """The RDMA device; for a metaroce network's UDP probe, the netdev."""
    port: int
    gid_index: int
    tos: int
    address: str = ""
    """The netdev's address the UDP probe sends from (metaroce networks only)."""


@dataclass(frozen=True)
class PeerResult:
    node: str
    reachable: bool
    rtts_us: tuple[float, ...] = ()
    loss: float | None = None
    message: str = ""
    ud: tuple[int, int] | None = None
    """(sent, received) UD datagrams of this session."""
    device: str = ""
    """The local RDMA device (rail) this session ran on."""

    def percentile(self, q: float) -> float | None:
        if not self.rtts_us:
            return None
        data = sorted(self.rtts_us)
        k = min(len(data) - 1, max(0, round(q * (len(data) - 1))))
        return data[k]


class Endpoint:
    """Verbs resources of one probe session (RC + UD queue pairs)."""

    def __init__(self, local: Local) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.e = e
        self.local = local
        self.ctx: Any = Context(name=local.device)
        self.pd: Any = PD(self.ctx)
        # Completion channels, so both sides sleep in select() until a completion instead
        # of busy-polling or napping (which would add up to the nap to every RTT).
        with _CHANNELS:
            before = _event_fds()
            self.rc_ch: Any = CompChannel(self.ctx)
            mid = _event_fds()
            self.ud_ch: Any = CompChannel(self.ctx)
            after = _event_fds()
        rc_fd, ud_fd = mid - before, after - mid
        if len(rc_fd) != 1 or len(ud_fd) != 1:
            raise RuntimeError("cannot find the completion channels' file descriptors")
        self.rc_fd, self.ud_fd = rc_fd.pop(), ud_fd.pop()
        self.rc_cq: Any = CQ(self.ctx, 256, None, self.rc_ch, 0)
        self.ud_cq: Any = CQ(self.ctx, 512, None, self.ud_ch, 0)
        self._armed = {"rc": False, "ud": False}
        self.mr: Any = MR(self.pd, 64 * 1024, e.IBV_ACCESS_LOCAL_WRITE)
        cap = QPCap(max_send_wr=128, max_recv_wr=256, max_send_sge=1, max_recv_sge=1)
        attr = QPAttr(port_num=local.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
        self.rc: Any = QP(
            self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.rc_cq, rcq=self.rc_cq, cap=cap), attr
        )
        uattr = QPAttr(port_num=local.port)
        uattr.qkey = QKEY
        uattr.pkey_index = 0
        self.ud: Any = QP(
            self.pd,
            QPInitAttr(qp_type=e.IBV_QPT_UD, scq=self.ud_cq, rcq=self.ud_cq, cap=cap),
            uattr,
        )
        self.gid = str(self.ctx.query_gid(local.port, local.gid_index))
        self.psn = random.randrange(1 << 24)
        self.ah: Any = None

    def hello(self) -> dict[str, Any]:
        return {
            "gid": self.gid,
            "rc_qpn": self.rc.qp_num,
            "ud_qpn": self.ud.qp_num,
            "psn": self.psn,
        }

    def _ah_attr(self, gid: str) -> Any:
        from pyverbs.addr import GID, AHAttr, GlobalRoute

        gr = GlobalRoute(
            dgid=GID(gid),
            sgid_index=self.local.gid_index,
            hop_limit=64,
            traffic_class=self.local.tos,
        )
        return AHAttr(gr=gr, is_global=1, port_num=self.local.port)

    def connect(self, remote: dict[str, Any]) -> None:
        from pyverbs.addr import AH
        from pyverbs.qp import QPAttr

        e = self.e
        attr = QPAttr(port_num=self.local.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = int(remote["rc_qpn"])
        attr.rq_psn = int(remote["psn"])
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.ah_attr = self._ah_attr(str(remote["gid"]))
        self.rc.to_rtr(attr)
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = self.psn
        attr.max_rd_atomic = 1
        self.rc.to_rts(attr)
        self.ah = AH(self.pd, attr=self._ah_attr(str(remote["gid"])))
        self.remote_ud = int(remote["ud_qpn"])

    def _sge(self, offset: int, length: int) -> Any:
        from pyverbs.wr import SGE

        return SGE(self.mr.buf + offset, length, self.mr.lkey)

    def post_rc_recv(self, n: int) -> None:
        from pyverbs.wr import RecvWR

        for _ in range(n):
            self.rc.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[self._sge(4096, MSG)]))

    def post_ud_recv(self, n: int) -> None:
        from pyverbs.wr import RecvWR

        for _ in range(n):
            self.ud.post_recv(RecvWR(wr_id=2, num_sge=1, sg=[self._sge(8192, MSG + 40)]))

    def rc_send(self) -> None:
        from pyverbs.wr import SendWR

        self.rc.post_send(SendWR(opcode=self.e.IBV_WR_SEND, num_sge=1, sg=[self._sge(0, MSG)]))

    def ud_send(self) -> None:
        from pyverbs.wr import SendWR

        wr = SendWR(opcode=self.e.IBV_WR_SEND, num_sge=1, sg=[self._sge(2048, MSG)])
        wr.set_wr_ud(self.ah, self.remote_ud, QKEY)
        self.ud.post_send(wr)

    def poll(self, cq: Any, n: int = 16) -> list[tuple[int, int]]:
        """(opcode, status) of up to n completions."""
        npolled, wcs = cq.poll(n)
        return [(int(w.opcode), int(w.status)) for w in (wcs or [])[:npolled]]

    def wait(self, timeout: float, extra: tuple[Any, ...] = ()) -> list[Any]:
        """Sleep until a completion on either CQ, one of `extra` (sockets) is readable, or
        `timeout`; returns the readable ones of `extra`. A CQ that was not armed is armed
        and the call returns at once: the caller polls again, so a completion that came
        before the arming is not slept through."""
        newly = False
        for name, cq in (("rc", self.rc_cq), ("ud", self.ud_cq)):
            if not self._armed[name]:
                cq.req_notify()
                self._armed[name] = newly = True
        if newly:
            r, _, _ = select.select(list(extra), [], [], 0)
            return list(r)
        r, _, _ = select.select([self.rc_fd, self.ud_fd, *extra], [], [], max(0.0, timeout))
        for name, fd, ch, cq in (
            ("rc", self.rc_fd, self.rc_ch, self.rc_cq),
            ("ud", self.ud_fd, self.ud_ch, self.ud_cq),
        ):
            if fd in r:
                ch.get_cq_event(cq)  # readable: does not block
                cq.ack_events(1)
                self._armed[name] = False
        return [x for x in r if x in extra]

    def close(self) -> None:
        objs = (self.ah, self.rc, self.ud, self.mr, self.rc_cq, self.ud_cq, self.rc_ch, self.ud_ch)
        for obj in (*objs, self.pd, self.ctx):
            try:
                if obj is not None:
                    obj.close()
            except Exception:  # best effort: the process keeps running
                pass


_CHANNELS = threading.Lock()
"""Held while completion channels are made, so the new descriptors are this session's."""


def _event_fds() -> set[int]:
    """This process's open completion-channel descriptors (pyverbs does not expose them)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                out.add(int(name))
    return out


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _recv(f: Any) -> dict[str, Any]:
    line = f.readline()
    if not line:
        raise ConnectionError("peer closed the probe channel")
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError("bad probe message")
    return data


Keys = bytes | tuple[bytes, ...] | None
"""A probe key, the keys an agent holds (current first), or none (unauthenticated)."""


def key_set(keys: Keys) -> tuple[bytes, ...]:
    if keys is None:
        return ()
    return (keys,) if isinstance(keys, bytes) else keys


# --- server ----------------------------------------------------------------------------------


class ProbeServer:
    """Answers probe sessions on the RDMA netdev's address: concurrently, each with a
    deadline, at most `max_sessions` at once."""

    def __init__(
        self,
        address: str,
        port: int,
        local: Callable[[int], Local | None],
        *,
        endpoint: Callable[[Local], Any] | None = None,
        key: Callable[[], Keys] = lambda: None,
        max_sessions: int = MAX_SESSIONS,
        session_seconds: float = SESSION_SECONDS,
    ) -> None:
        self.local = local
        self.endpoint = endpoint or Endpoint
        self.key = key
        self.max_sessions = max_sessions
        self.session_seconds = session_seconds
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(max_sessions)
        self.sessions = 0
        self.refused = 0
        self.auth_failures = 0

    def serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(1)
                    _send(conn, {"error": f"busy: {self.max_sessions} probe sessions running"})
                continue
            threading.Thread(
                target=self._serve_one, args=(conn, peer), name="probe-session", daemon=True
            ).start()

    def _serve_one(self, conn: socket.socket, peer: Any) -> None:
        deadline = time.monotonic() + self.session_seconds
        try:
            with conn:
                conn.settimeout(min(5.0, self.session_seconds))
                if self._session(conn, deadline):
                    self.sessions += 1
        except Exception as e:
            log.info("probe session from %s ended: %s", peer[0], e)
        finally:
            self._slots.release()

    def _session(self, conn: socket.socket, deadline: float) -> bool:
        """One session; True when the peer said bye, False at the deadline."""
        f = conn.makefile("r")
        server_nonce = new_nonce()
        keys = key_set(self.key())
        challenge: dict[str, Any] = {"v": 2, "nonce": server_nonce, "features": [COUNT_SENT]}
        if keys:
            challenge["kids"] = [key_id(k) for k in keys]
        _send(conn, challenge)
        hello = _recv(f)
        client_nonce = str(hello.get("nonce") or "")
        matching = [
            k
            for k in keys
            if len(client_nonce) >= 32
            and verify(k, hello.get("mac"), "client", server_nonce, client_nonce, hello)
        ]
        key = matching[0] if matching else None
        if keys and key is None:
            self.auth_failures += 1
            log.warning("probe session: a client failed authentication")
            _send(conn, {"error": "authentication failed: the client's probe key differs "
                                  "from this node's (the network's probe Secret)"})  # fmt: skip
            return True
        rail = hello.get("rail", 0)
        local = self.local(rail) if isinstance(rail, int) and rail >= 0 else None
        if local is None:
            _send(conn, {"error": f"no RDMA device (or, for metaroce, netdev) ready on this "
                                  f"node for rail {rail}"})  # fmt: skip
            return True

        def signed(role: str, fields: dict[str, Any]) -> dict[str, Any]:
            if key is None:
                return fields
            return {**fields, "mac": sign(key, role, server_nonce, client_nonce, fields)}

        ep = self.endpoint(local)
        try:
            ep.post_rc_recv(128)
            ep.post_ud_recv(min(UD_BURST * 2, 250))
            ep.connect(hello)
            _send(conn, signed("server", {**ep.hello(), "node": socket.gethostname()}))
            received = 0
            conn.setblocking(False)
            buf = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    log.info("probe session: deadline of %.0f s reached", self.session_seconds)
                    return False
                busy = False
                for opcode, status in ep.poll(ep.rc_cq):
                    busy = True
                    if opcode == ep.e.IBV_WC_RECV and status == ep.e.IBV_WC_SUCCESS:
                        ep.post_rc_recv(1)
                        ep.rc_send()  # echo
                for opcode, status in ep.poll(ep.ud_cq, 64):
                    busy = True
                    if opcode == ep.e.IBV_WC_RECV and status == ep.e.IBV_WC_SUCCESS:
                        received += 1
                        ep.post_ud_recv(1)
                if busy:
                    r, _, _ = select.select([conn], [], [], 0)
                else:  # asleep until a completion or a message (at most 1 s: the deadline)
                    r = ep.wait(min(left, 1.0), (conn,))
                if not r:
                    continue
                chunk = conn.recv(4096)
                if not chunk:
                    return True
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if msg.get("op") == "count":
                        sent = msg.get("sent")
                        received = _count_ud(ep, received, sent if isinstance(sent, int) else None,
                                             deadline)  # fmt: skip
                        conn.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
                        _send(conn, signed("count", {"ud_received": received}))
                        conn.setblocking(False)
                    elif msg.get("op") == "bye":
                        return True
        finally:
            ep.close()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# --- client ----------------------------------------------------------------------------------


def probe_peer(
    node: str,
    address: str,
    port: int,
    local: Local,
    timeout: float = 20.0,
    *,
    key: Keys = None,
    endpoint: Callable[[Local], Any] | None = None,
    rail: int = 0,
) -> PeerResult:
    """One probe session against a peer; with a key, both sides authenticate."""

    def failed(message: str) -> PeerResult:
        return PeerResult(node, False, message=message, device=local.device)

    try:
        conn = socket.create_connection((address, port), timeout=5)
    except OSError as e:
        return PeerResult(
            node,
            False,
            device=local.device,
            message=f"side channel {address}:{port} unreachable: {e}",
        )
    ep: Any = None
    with conn:
        conn.settimeout(timeout)
        f = conn.makefile("r")
        try:
            challenge = _recv(f)
            if "error" in challenge:
                return failed(str(challenge["error"]))
            server_nonce = str(challenge.get("nonce") or "")
            client_nonce = new_nonce()
            held = key_set(key)
            key = choose_key(held, challenge.get("kids")) if held else None

            def authentic(role: str, msg: dict[str, Any]) -> bool:
                return key is None or verify(
                    key, msg.get("mac"), role, server_nonce, client_nonce, msg
                )

            ep = (endpoint or Endpoint)(local)
            ep.post_rc_recv(RC_PINGS + 8)
            hello = {**ep.hello(), "node": node, "nonce": client_nonce, "rail": rail}
            if key is not None:
                hello["mac"] = sign(key, "client", server_nonce, client_nonce, hello)
            _send(conn, hello)
            remote = _recv(f)
            if "error" in remote:
                return failed(str(remote["error"]))
            if not authentic("server", remote):
                return failed(
                    "the peer failed authentication: its probe key differs from this "
                    "node's, or it has none (the network's probe Secret)"
                )
            ep.connect(remote)
            rtts = _rc_pings(ep)
            if not rtts:
                _send(conn, {"op": "bye"})
                return failed(f"no RC echo (UDP for metaroce) to {PING_MISSES} pings in a "
                              f"row within {_ping_timeout(ep):g} s each")  # fmt: skip
            sent = _ud_burst(ep)
            if COUNT_SENT in (challenge.get("features") or ()):
                _send(conn, {"op": "count", "sent": sent})  # it waits for them
            else:  # an older server counts at once: give the datagrams time to land
                time.sleep(0.2)
                _send(conn, {"op": "count"})
            counted = _recv(f)
            if not authentic("count", counted):
                return PeerResult(
                    node,
                    False,
                    device=local.device,
                    message="the peer's count failed authentication",
                )
            got = int(counted.get("ud_received", 0))
            _send(conn, {"op": "bye"})
            loss = max(0.0, 1.0 - got / sent) if sent else None
            return PeerResult(
                node, True, tuple(rtts), loss, ud=(sent, min(got, sent)), device=local.device
            )
        except Exception as e:
            return failed(f"probe failed: {e}")
        finally:
            if ep is not None:
                ep.close()


def _count_ud(ep: Any, received: int, sent: int | None, deadline: float) -> int:
    """`received` plus the UD datagrams completing now: until `sent` have arrived (the
    client's count; None: whatever comes), none for COUNT_QUIET_SECONDS, COUNT_MAX_SECONDS
    or the session's deadline; asleep on the completion channel in between."""
    e = ep.e
    now = time.monotonic()
    end = min(deadline, now + COUNT_MAX_SECONDS)
    quiet = now + COUNT_QUIET_SECONDS
    while True:
        for opcode, status in ep.poll(ep.ud_cq, 256):
            if opcode == e.IBV_WC_RECV and status == e.IBV_WC_SUCCESS:
                received += 1
                ep.post_ud_recv(1)
                quiet = time.monotonic() + COUNT_QUIET_SECONDS
        left = min(end, quiet) - time.monotonic()
        if (sent is not None and received >= sent) or left <= 0:
            return received
        ep.wait(left)


def _ping_timeout(ep: Any) -> float:
    """How long a ping waits for its echo: the endpoint's own (UDP), else RC's."""
    return float(getattr(ep, "ping_timeout", PING_TIMEOUT))


def _rc_pings(ep: Any) -> list[float]:
    e = ep.e
    rtts: list[float] = []
    misses = 0
    timeout = _ping_timeout(ep)
    for _ in range(RC_PINGS):
        t0 = time.perf_counter()
        ep.rc_send()
        got = False
        while time.perf_counter() - t0 < timeout:
            done = ep.poll(ep.rc_cq)
            if any(s != e.IBV_WC_SUCCESS for _, s in done):
                return rtts
            if any(op == e.IBV_WC_RECV for op, _ in done):
                got = True
                break
            if not done:
                ep.wait(timeout - (time.perf_counter() - t0))
        if not got:
            misses += 1
            if misses >= PING_MISSES:
                break
            continue
        misses = 0
        rtts.append((time.perf_counter() - t0) * 1e6)
    return rtts


def _ud_burst(ep: Any) -> int:
    e = ep.e
    sent = outstanding = 0
    deadline = time.monotonic() + 5
    while sent < UD_BURST and time.monotonic() < deadline:
        if outstanding < 32:
            ep.ud_send()
            sent += 1
            outstanding += 1
        done = ep.poll(ep.ud_cq, 64)
        for _, status in done:
            outstanding -= 1
            if status != e.IBV_WC_SUCCESS:
                return sent
        if not done and outstanding >= 32:
            ep.wait(0.1)
    return sent


# --- the agent's prober ----------------------------------------------------------------------


def probe_address(ipv4: Sequence[str], ipv6: Sequence[str]) -> str | None:
    """The address to serve probes on: the netdev's first IPv4 address, else its first
    IPv6 address that peers can reach without a scope (not link-local); None while it has
    neither (never 0.0.0.0 or ::, which peers would take for their own host)."""
    import ipaddress

    for a in ipv4:
        return a.split("/")[0]
    for a in ipv6:
        try:
            ip = ipaddress.ip_address(a.split("/")[0])
        except ValueError:
            continue
        if not (ip.is_link_local or ip.is_unspecified or ip.is_loopback):
            return str(ip)
    return None


PROTOCOL = "probe2"
"""The side channel's protocol, named in the published endpoint: agents from before it
(bare `<ip>:<port>`, no nonces) and after it skip each other's endpoints during a rollout
instead of failing each other's probes."""


def endpoint_text(address: str, port: int) -> str:
    """`probe2://<ipv4>:<port>` or `probe2://[<ipv6>]:<port>`."""
    hostport = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return f"{PROTOCOL}://{hostport}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix(f"{PROTOCOL}://").rpartition(":")
    return host.strip("[]"), int(port)


def _probeable(endpoint: str) -> bool:
    """A peer's published endpoint speaks this protocol and names a real remote address:
    not unspecified (0.0.0.0 would reach the prober's own host) and not loopback."""
    import ipaddress

    if not endpoint.startswith(f"{PROTOCOL}://"):
        return False
    host, _, port = endpoint.removeprefix(f"{PROTOCOL}://").rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return port.isdigit() and not (ip.is_unspecified or ip.is_loopback)


def choose_peers(me: str, endpoints: dict[str, str], k: int) -> list[str]:
    """The next k nodes after `me` in name order (a ring)."""
    ring = sorted(set(endpoints) | {me})
    i = ring.index(me)
    others = [ring[(i + j) % len(ring)] for j in range(1, len(ring))]
    return [n for n in others if n in endpoints][:k]


def wilson_bounds(lost: int, sent: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a loss fraction (lost of sent)."""
    if sent <= 0:
        return 0.0, 1.0
    p = lost / sent
    z2 = z * z
    denom = 1 + z2 / sent
    center = (p + z2 / (2 * sent)) / denom
    half = z * math.sqrt(p * (1 - p) / sent + z2 / (4 * sent * sent)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def _percentile(data: list[float], q: float) -> float | None:
    if not data:
        return None
    data = sorted(data)
    return data[min(len(data) - 1, max(0, round(q * (len(data) - 1))))]


@dataclass
class PeerHistory:
    """One peer's samples across rounds and its loss state (for the hysteresis)."""

    rtts: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))
    ud: deque[tuple[int, int]] = field(default_factory=deque)
    loss_failing: bool = False

    def add(self, r: PeerResult) -> None:
        self.rtts.extend(r.rtts_us)
        if r.ud is not None and r.ud[0] > 0:
            self.ud.append(r.ud)
            while sum(s for s, _ in self.ud) - self.ud[0][0] >= LOSS_WINDOW:
                self.ud.popleft()

    def counts(self) -> tuple[int, int]:
        """(lost, sent) over the window."""
        sent = sum(s for s, _ in self.ud)
        return sent - sum(g for _, g in self.ud), sent

    def judge_loss(self, max_loss: float) -> tuple[bool, float, float]:
        lost, sent = self.counts()
        lo, hi = wilson_bounds(lost, sent)
        if self.loss_failing and hi <= max_loss:
            self.loss_failing = False
        elif not self.loss_failing and lo > max_loss:
            self.loss_failing = True
        return self.loss_failing, lo, hi


@dataclass(frozen=True)
class RailVerdict:
    """One rail's verdict on all its samples so far."""

    ok: bool
    message: str
    p50: float | None
    p99: float | None
    """None until LATENCY_SAMPLES RTTs stand behind it (the operator judges it)."""
    loss: float | None
    """None until MIN_LOSS_DATAGRAMS datagrams stand behind it."""
    rtts: int
    datagrams: int

    @property
    def judged(self) -> bool:
        """Whether both figures stand on enough samples to be stated."""
        return self.p99 is not None and self.loss is not None


def _judge(r: PeerResult, h: PeerHistory, max_latency_us: float, max_loss: float) -> RailVerdict:
    """One rail's verdict after adding its samples to `h`."""
    h.add(r)
    rtts = list(h.rtts)
    p99 = _percentile(rtts, 0.99)
    slow = p99 is not None and len(rtts) >= LATENCY_SAMPLES and p99 > max_latency_us
    loss_failing, lo, hi = h.judge_loss(max_loss)
    lost, sent = h.counts()
    ok = r.reachable and not slow and not loss_failing
    msg = r.message
    if r.reachable:
        shown = "?" if p99 is None else f"{p99:.0f}"
        pending = "" if len(rtts) >= LATENCY_SAMPLES else ", too few to judge"
        msg = (
            f"p99 {shown} us (max {max_latency_us:.0f}) over {len(rtts)} RTTs{pending}; "
            f"loss {lost} of {sent} datagrams, bound [{lo:.4f}, {hi:.4f}] (max {max_loss})"
        )
        if not ok:
            msg = "failing: " + msg
    stated_p99 = p99 if len(rtts) >= LATENCY_SAMPLES else None
    loss = (lost / sent) if sent >= MIN_LOSS_DATAGRAMS else None
    return RailVerdict(ok, msg, _percentile(rtts, 0.5), stated_p99, loss, len(rtts), sent)


def _worst(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def summarize(
    results: list[PeerResult],
    max_latency_us: float,
    max_loss: float,
    history: dict[str, PeerHistory] | None = None,
) -> tuple[ProbeSummary, tuple[Any, ...]]:
    """The summary and its verdict key (what must change for the NodeState to change:
    healthy, each peer's pass/fail, and whether its figures stand on enough samples yet).
    `history` (per peer and rail, kept by the caller across rounds) gets this round's
    samples; a verdict stands on all of them, and its entry says how many (the fewest of
    any rail). Several results for one node are its rails: one entry, failing when any
    rail fails, with the worst rail's numbers and every rail's message."""
    history = {} if history is None else history
    by_node: dict[str, list[PeerResult]] = {}
    for r in results:
        by_node.setdefault(r.node, []).append(r)
    peers = []
    verdicts = []
    for node, rails in by_node.items():
        judged: list[tuple[PeerResult, RailVerdict]] = []
        for r in rails:
            key = f"{node}/{r.device}" if r.device else node
            v = _judge(r, history.setdefault(key, PeerHistory()), max_latency_us, max_loss)
            judged.append((r, v))
        ok = all(v.ok for _, v in judged)
        if len(judged) == 1:
            message = judged[0][1].message
        else:
            message = "; ".join(f"{r.device}: {v.message}" for r, v in judged)
        peers.append(
            ProbePeer(
                node=node,
                reachable=all(r.reachable for r in rails),
                latency_p50_microseconds=_worst([v.p50 for _, v in judged]),
                latency_p99_microseconds=_worst([v.p99 for _, v in judged]),
                loss_fraction=_worst([v.loss for _, v in judged]),
                latency_samples=min(v.rtts for _, v in judged),
                loss_datagrams=min(v.datagrams for _, v in judged),
                message=message[:1024],
            )
        )
        verdicts.append((node, ok, all(v.judged for _, v in judged)))
    healthy = all(ok for _, ok, _ in verdicts) if verdicts else None
    summary = ProbeSummary(healthy=healthy, last_run_time=now(), peers=peers or None)
    return summary, (healthy, tuple(sorted(verdicts)))


class PeerIndex:
    """The probe endpoints of a network's NodeStates, from their metadata only (the node
    label and the endpoint annotation): listed once, then kept by a watch, so a probe
    round sends no request and no agent reads the others' status (finding 10)."""

    def __init__(self, kube: Any, network: str, me: str) -> None:
        self.kube = kube
        self.network = network
        self.me = me
        self.path = cluster_path(constants.GROUP, constants.VERSION, constants.NODESTATE_PLURAL)
        self.selector = f"{constants.NETWORK_LABEL}={network}"
        self._items: dict[str, tuple[str, str]] = {}  # object name -> (node, endpoint)
        self._lock = threading.Lock()
        self.resource_version: str | None = None
        self.old_protocol: set[str] = set()
        """Peers whose endpoint is of the protocol before PROTOCOL (a rollout)."""

    def _entry(self, obj: dict[str, Any]) -> tuple[str, tuple[str, str] | None]:
        md = obj.get("metadata") or {}
        node = str((md.get("labels") or {}).get(constants.NODE_LABEL) or "")
        if len(node) >= 63:  # the label may be a shortened name: the object has the real one
            full = self.kube.get(f"{self.path}/{md.get('name')}") or {}
            node = str((full.get("spec") or {}).get("node") or "")
        ep = str((md.get("annotations") or {}).get(constants.PROBE_ENDPOINT_ANNOTATION) or "")
        ok = node and node != self.me and _probeable(ep)
        old = bool(node) and node != self.me and bool(ep) and "://" not in ep
        with self._lock:
            if old and node not in self.old_protocol:
                log.info("probe: %s runs an older probe protocol: skipped until upgraded", node)
            (self.old_protocol.add if old else self.old_protocol.discard)(node)
        return str(md.get("name") or ""), ((node, ep) if ok else None)

    def relist(self) -> None:
        data = self.kube.request(
            "GET", self.path, params={"labelSelector": self.selector}, accept=METADATA_LIST
        )
        items: dict[str, tuple[str, str]] = {}
        for obj in data.get("items") or []:
            name, entry = self._entry(obj)
            if entry is not None:
                items[name] = entry
        with self._lock:
            self._items = items
            self.resource_version = str((data.get("metadata") or {}).get("resourceVersion"))

    def apply(self, event: dict[str, Any]) -> None:
        """One watch event."""
        obj = event.get("object") or {}
        name, entry = self._entry(obj)
        with self._lock:
            if event.get("type") == "DELETED" or entry is None:
                self._items.pop(name, None)
            else:
                self._items[name] = entry
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self.resource_version = str(rv)

    def endpoints(self) -> dict[str, str]:
        if self.resource_version is None:
            self.relist()
        with self._lock:
            return {node: ep for node, ep in self._items.values()}

    def run(self, stop: threading.Event) -> None:
        """Keep the index by a watch; relist when the watch ends badly or expires (410)."""
        while not stop.is_set():
            try:
                if self.resource_version is None:
                    self.relist()
                params = {
                    "labelSelector": self.selector,
                    "resourceVersion": str(self.resource_version),
                    "allowWatchBookmarks": "true",
                }
                for event in self.kube.watch(self.path, params, accept=METADATA_WATCH):
                    if stop.is_set():
                        return
                    kind = event.get("type")
                    if kind == "ERROR":
                        self.resource_version = None  # expired: list again
                        break
                    if kind == "BOOKMARK":
                        rv = ((event.get("object") or {}).get("metadata") or {}).get(
                            "resourceVersion"
                        )
                        self.resource_version = str(rv) if rv else self.resource_version
                        continue
                    self.apply(event)
            except Exception as e:  # never let the index thread die: list again
                log.warning("probe: peer watch: %s; listing again", e)
                self.resource_version = None
                stop.wait(5)


class Prober:
    """Runs the server and the periodic probe rounds of one agent."""

    def __init__(
        self,
        kube: KubeClient,
        network: str,
        node: str,
        address: Callable[[], str | None],
        port: int,
        local: Callable[[], list[Local]],
        publish: Callable[[str], None],
        report: Callable[[ProbeSummary], None],
        metrics: Any,
        interval: float,
        peers: int,
        max_latency_us: float,
        max_loss: float,
        key_file: Path | None = None,
        endpoint: Callable[[Local], Any] | None = None,
    ) -> None:
        self.kube = kube
        self.key_file = key_file
        self.endpoint = endpoint
        """The data plane of a session: verbs (None, `Endpoint`) or `UdpEndpoint`."""
        self.network = network
        self.node = node
        self.address = address
        self.port = port
        self.local = local
        self.publish = publish
        self.report = report
        self.metrics = metrics
        self.interval = interval
        self.peers = peers
        self.max_latency_us = max_latency_us
        self.max_loss = max_loss
        self.server: ProbeServer | None = None
        self.served_address: str | None = None
        self._stop = threading.Event()
        self._verdict: tuple[Any, ...] | None = None
        self.history: dict[str, PeerHistory] = {}
        self.index = PeerIndex(kube, network, node)
        self.rounds = 0
        self._serving = threading.Lock()

    @classmethod
    def for_agent(cls, agent: Any) -> Prober:
        """The agent's prober: over RDMA (RC and UD on the served devices), or for a
        metaroce network over UDP from the served netdevs (`probe_udp`)."""
        from metaroce_agent.probe_udp import UdpEndpoint

        cfg = agent.config
        opts = agent.options
        udp = cfg.transport.mode == "metaroce"

        def local() -> list[Local]:
            """Every served device with a usable GID, in plan order: rail k of this node
            is probed against rail k of each peer."""
            from metaroce_agent.transport.base import select_gid

            plan = agent.state.plan
            out = []
            for td in plan.devices if plan is not None else ():
                dev = agent.state.inventory.rdma_device(td.rdma_device)
                port = dev.port(td.port) if dev else None
                gid = select_gid(agent.config, port) if port else None
                if gid is not None:
                    tos = agent.config.qos.data.dscp << 2
                    out.append(Local(td.rdma_device, td.port, gid.index, tos))
            return out

        def netdevs() -> list[Local]:
            """metaroce: every served netdev with an address, in plan order (its rails)."""
            plan = agent.state.plan
            out = []
            for name in plan.netdevs if plan is not None else ():
                nd = agent.state.inventory.netdev(name)
                address = probe_address(nd.ipv4, nd.ipv6) if nd else None
                if address:
                    tos = agent.config.qos.data.dscp << 2
                    out.append(Local(name, 0, 0, tos, address=address))
            return out

        def address() -> str | None:
            """The RDMA netdev's address (`probe_address`); None while it has none."""
            plan = agent.state.plan
            if plan and plan.netdevs:
                nd = agent.state.inventory.netdev(plan.netdevs[0])
                if nd:
                    return probe_address(nd.ipv4, nd.ipv6)
            return None

        def publish(endpoint: str) -> None:
            if agent.writer is not None:
                agent.writer.set_annotation(constants.PROBE_ENDPOINT_ANNOTATION, endpoint)
                agent.report()

        return cls(
            kube=agent.kube,
            network=cfg.network,
            node=opts.node_name,
            address=address,
            port=opts.probe_port,
            local=netdevs if udp else local,
            publish=publish,
            report=agent.set_probe,
            metrics=agent.metrics,
            interval=parse_duration(cfg.probe.interval).total_seconds(),
            peers=cfg.probe.peers_per_node,
            max_latency_us=float(cfg.probe.max_latency_microseconds),
            max_loss=cfg.probe.max_loss_fraction,
            key_file=opts.probe_key_file,
            endpoint=UdpEndpoint if udp else None,
        )

    def key(self) -> tuple[bytes, ...]:
        """The network's probe keys (current, previous), read per use (a rotated Secret
        applies at once)."""
        return load_keys(self.key_file) if self.key_file is not None else ()

    def start(self) -> None:
        """Serve on the RDMA netdev's address (once it has one) and run the rounds."""
        try:
            if not self.key():
                log.warning(
                    "probe: no key at %s: the side channel is NOT authenticated; mount the "
                    "network's probe Secret there", self.key_file,
                )  # fmt: skip
        except ProbeKeyError as e:
            log.error("%s; probe sessions will fail until it is fixed", e)
        self.refresh()
        threading.Thread(target=self._loop, name="probe-rounds", daemon=True).start()
        threading.Thread(
            target=self.index.run, args=(self._stop,), name="probe-peers", daemon=True
        ).start()
        log.info("probe: %d peer(s) every %.0f s", self.peers, self.interval)

    def refresh(self) -> None:
        """(Re)listen and (re)publish when the netdev's address appeared or changed;
        publish nothing while it has none. Called at start and before every round."""
        with self._serving:
            address = self.address()
            if address == self.served_address and (address is None or self.server):
                return
            if self.server is not None:
                self.server.stop()
                self.server = None
            self.served_address = address
            if address is None:
                log.warning("probe: the RDMA netdev has no usable address yet: not serving")
                self.publish("")
                return
            try:
                self.server = ProbeServer(
                    address, self.port, self._rail, key=self.key, endpoint=self.endpoint
                )
            except OSError as e:
                log.error(
                    "probe server cannot listen on %s:%d: %s; no probes from this node. If "
                    "another network's agent runs here, give one of the two another "
                    "spec.agent.probePort",
                    address, self.port, e,
                )  # fmt: skip
                self.served_address = None
                return
            threading.Thread(target=self.server.serve, name="probe-server", daemon=True).start()
            self.publish(endpoint_text(address, self.server.port))
            log.info("probe: serving on %s:%d", address, self.server.port)

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop()

    def endpoints(self) -> dict[str, str]:
        return self.index.endpoints()

    def _rail(self, rail: int) -> Local | None:
        rails = self.local()
        return rails[rail] if rail < len(rails) else None

    def round(self) -> ProbeSummary | None:
        self.refresh()
        rails = self.local()
        if not rails:
            return None
        try:
            key = self.key()
        except ProbeKeyError as e:
            log.error("probe: %s", e)
            return None
        try:
            endpoints = self.endpoints()
        except KubeError as e:
            log.warning("probe: cannot list peers: %s", e)
            return None
        results = []
        for node in choose_peers(self.node, endpoints, self.peers):
            host, port = split_endpoint(endpoints[node])
            t0 = time.monotonic()
            mine = [probe_peer(node, host, port, loc, key=key, rail=k, endpoint=self.endpoint)
                    for k, loc in enumerate(rails)]  # fmt: skip
            results.extend(mine)
            self._record(node, mine)
            log.debug("probe %s: %s in %.2f s", node, mine, time.monotonic() - t0)
        self.rounds += 1
        if not results:
            return None
        summary, verdict = summarize(results, self.max_latency_us, self.max_loss, self.history)
        if verdict != self._verdict:
            self._verdict = verdict
            log.info("probe verdict: %s", verdict)
            self.report(summary)
        return summary

    def _record(self, node: str, rails: list[PeerResult]) -> None:
        """Metrics of one peer's sessions: every RTT observed; the gauges show the worst
        rail (a peer's label set stays {peer}, whatever its rails)."""
        m = self.metrics
        if m is None:
            return
        ok = all(r.reachable for r in rails)
        m.probe_rounds.labels(peer=node, result="ok" if ok else "unreachable").inc()
        for q in (0.5, 0.9, 0.99):
            v = _worst([r.percentile(q) for r in rails])
            if v is not None:
                m.probe_latency.labels(peer=node, quantile=str(q)).set(v)
        for r in rails:
            for rtt in r.rtts_us:
                m.probe_rtt.observe(rtt)
        loss = _worst([r.loss for r in rails])
        if loss is not None:
            m.probe_loss.labels(peer=node).set(loss)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.round()
            except Exception as e:  # never let the probe kill the agent
                log.error("probe round failed: %s", e)
