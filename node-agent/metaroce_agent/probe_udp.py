"""The probe's data plane for metaroce networks: UDP on the network's netdev.

A metaroce network serves netdevs, not RDMA devices, and its packets are UDP datagrams
marked with the network's DSCP and ECT(0). `UdpEndpoint` sends the probe's traffic the
same way, from the netdev's address, and keeps the contract of the verbs `Endpoint` in
`probe.py`, so the side channel, authentication, sessions, verdicts and taints are the
RDMA probe's own:

- RC's role (reachability and latency): a ping datagram the server echoes; its round
  trip is the sample. A lost ping or echo is a missing sample, as an RC timeout is.
- UD's role (loss): a burst of datagrams the server counts, which UDP measures directly.
  The burst leaves from BURST_PORTS source ports in turn: the fabric's switches hash a
  UDP source port to a path (ECMP), as the transport's paths are its source ports, so
  a dead or lossy link among the paths shows in the count, not only the pings' path.

Every datagram carries a magic, its kind, the session's token (random, exchanged in the
authenticated hellos) and a sequence number; the endpoint takes datagrams only from the
peer's address named in its hello. Anything else is dropped and counted (`dropped`); an
echo of an earlier ping than the last one sent (it came after its ping timed out) is
counted in `stale`, never taken for the last ping's.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

MAGIC = b"MRPB"
PING, ECHO, BURST = b"P", b"E", b"U"
HEADER = struct.Struct("!4sc8sI")  # magic, kind, token, sequence
SIZE = 64
"""Bytes per datagram, as the verbs probe's messages."""
ECT0 = 0b10
RCVBUF = 1 << 20
"""Receive buffer of the session's socket: a whole burst (each small datagram takes
about a kilobyte of buffer in the kernel's accounting) must fit while the server's
thread waits for a core, or the host's drops would read as the fabric's loss."""
SO_RCVBUFFORCE = 33  # <asm-generic/socket.h>; Python's socket module lacks the name
BURST_PORTS = 8
"""Source ports a burst is spread over (the transport's paths, 16 by default, are its
source ports)."""


@dataclass(frozen=True)
class UdpOpcodes:
    """The verbs names the session code compares completions with."""

    IBV_WC_SUCCESS: int = 0
    IBV_WC_SEND: int = 0
    IBV_WC_RECV: int = 128


class UdpEndpoint:
    """One probe session's UDP socket, with the verbs endpoint's contract: `rc_cq` and
    `ud_cq` name two queues of (opcode, status) completions, filled from the socket."""

    e = UdpOpcodes()
    rc_cq = "rc"
    ud_cq = "ud"
    ping_timeout = 0.25
    """A ping's echo later than this is a lost sample (RC's 1 s is for a retrying QP;
    a lost UDP ping would hold the session for the whole second)."""

    def __init__(self, local: Any) -> None:
        if not local.address:
            raise ValueError(f"netdev {local.device}: no address to probe from")
        self.local = local
        self.family = socket.AF_INET6 if ":" in local.address else socket.AF_INET
        self.sock = self._socket()
        try:  # past net.core.rmem_max with CAP_NET_ADMIN (the agent has it), else capped
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.burst_socks: list[socket.socket] = []
        self.burst_next = 0
        self.sock.setblocking(False)
        self.token = secrets.token_bytes(8)
        self.peer: tuple[str, int] | None = None
        self.peer_token = b""
        self.queues: dict[str, deque[tuple[int, int]]] = {"rc": deque(), "ud": deque()}
        self.owed: deque[int] = deque()
        """Sequence numbers of pings received and not yet echoed (the server's side)."""
        self.ping_seq = 0
        self.dropped = 0
        self.stale = 0

    def _socket(self) -> socket.socket:
        """A UDP socket on the netdev's address, marked as the transport marks."""
        sock = socket.socket(self.family, socket.SOCK_DGRAM)
        try:
            # The network's DSCP with ECT(0), as the transport marks its own packets.
            tos = (self.local.tos & ~0b11) | ECT0
            if self.family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
            sock.bind((self.local.address, 0))
        except OSError:
            sock.close()
            raise
        return sock

    def hello(self) -> dict[str, Any]:
        return {
            "udp_addr": self.local.address,
            "udp_port": int(self.sock.getsockname()[1]),
            "token": self.token.hex(),
        }

    def connect(self, remote: dict[str, Any]) -> None:
        try:
            addr, port = str(remote["udp_addr"]), int(remote["udp_port"])
            token = bytes.fromhex(str(remote["token"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"the peer's hello has no UDP endpoint ({e}): is it an agent of a metaroce network?"
            ) from None
        if not 0 < port < 65536 or len(token) != 8:
            raise ValueError(f"the peer's hello names UDP port {port}, token {token.hex()}")
        self.peer, self.peer_token = (addr, port), token

    def post_rc_recv(self, n: int) -> None:
        """Nothing to post: the socket buffers what arrives."""

    def post_ud_recv(self, n: int) -> None:
        """Nothing to post: the socket buffers what arrives."""

    def _datagram(self, kind: bytes, seq: int) -> tuple[bytes, tuple[str, int]]:
        """A session datagram and where it goes (RuntimeError before connect)."""
        if self.peer is None:
            raise RuntimeError("send before connect")
        return HEADER.pack(MAGIC, kind, self.peer_token, seq).ljust(SIZE, b"\0"), self.peer

    def _send(self, kind: bytes, seq: int = 0) -> None:
        self.sock.sendto(*self._datagram(kind, seq))

    def rc_send(self) -> None:
        """Echo the oldest ping not yet answered (the server's side), else ping."""
        if self.owed:
            self._send(ECHO, self.owed.popleft())
        else:
            self.ping_seq += 1
            self._send(PING, self.ping_seq)

    def ud_send(self) -> None:
        """One datagram of the burst, from the next of BURST_PORTS source ports."""
        datagram = self._datagram(BURST, self.burst_next + 1)
        if not self.burst_socks:
            self.burst_socks = [self._socket() for _ in range(BURST_PORTS)]
        sock = self.burst_socks[self.burst_next % len(self.burst_socks)]
        self.burst_next += 1
        sock.sendto(*datagram)
        self.queues["ud"].append((self.e.IBV_WC_SEND, self.e.IBV_WC_SUCCESS))

    def _drain(self) -> None:
        """Move every datagram waiting in the socket into its queue."""
        recv = (self.e.IBV_WC_RECV, self.e.IBV_WC_SUCCESS)
        while True:
            try:
                data, src = self.sock.recvfrom(2048)
            except (BlockingIOError, InterruptedError):
                return
            got = self._parse(data, src)
            if got is None:
                self.dropped += 1
                continue
            kind, seq = got
            if kind == BURST:
                self.queues["ud"].append(recv)
            elif kind == PING:
                self.owed.append(seq)
                self.queues["rc"].append(recv)
            elif seq == self.ping_seq:
                self.queues["rc"].append(recv)
            else:
                self.stale += 1

    def _parse(self, data: bytes, src: Any) -> tuple[bytes, int] | None:
        """The datagram's kind and sequence number, or None for one that is not this
        session's."""
        if self.peer is None or len(data) < HEADER.size or src[0] != self.peer[0]:
            return None
        magic, kind, token, seq = HEADER.unpack_from(data)
        if magic != MAGIC or token != self.token or kind not in (PING, ECHO, BURST):
            return None
        if kind != BURST and src[1] != self.peer[1]:  # only a burst comes from other ports
            return None
        return bytes(kind), int(seq)

    def poll(self, cq: str, n: int = 16) -> list[tuple[int, int]]:
        self._drain()
        q = self.queues[cq]
        return [q.popleft() for _ in range(min(n, len(q)))]

    def wait(self, timeout: float, extra: tuple[Any, ...] = ()) -> list[Any]:
        """Sleep until a datagram, one of `extra` readable, or `timeout`; returns the
        readable ones of `extra`."""
        if any(self.queues.values()):
            r, _, _ = select.select(list(extra), [], [], 0)
            return list(r)
        r, _, _ = select.select([self.sock, *extra], [], [], max(0.0, timeout))
        return [x for x in r if x in extra]

    def close(self) -> None:
        for sock in (self.sock, *self.burst_socks):
            sock.close()
