"""The probe server cannot be pinned (finding 7, the server's side): sessions run
concurrently, each with a deadline, and beyond a cap a client is told 'busy'.

On b6733c0 sessions run one at a time, the 30 s socket timeout stops applying after
`setblocking(False)`, and a session has no deadline: an idle client on the
unauthenticated port blocks every other peer, and the node looks unreachable to all."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fakes import SilentEndpoint

from metaroce_agent.probe import Local, ProbeServer

FakeEndpoint = SilentEndpoint


LOCAL = Local("rxe_eth0", 1, 1, 104)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[ProbeServer]:
    kw = getattr(request, "param", {})
    srv = ProbeServer("127.0.0.1", 0, lambda rail: kw.get("local"), **kw.get("args", {}))
    threading.Thread(target=srv.serve, daemon=True).start()
    try:
        yield srv
    finally:
        srv.stop()


def _hello(port: int, timeout: float = 3.0) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        f = c.makefile("r")
        challenge = dict(json.loads(f.readline()))  # the server opens with a nonce
        if "error" in challenge:
            return challenge
        c.sendall(json.dumps({"node": "peer"}).encode() + b"\n")
        return dict(json.loads(f.readline()))


def test_an_idle_client_does_not_block_other_peers(server: ProbeServer) -> None:
    idle = socket.create_connection(("127.0.0.1", server.port))  # connects, says nothing
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        reply = _hello(server.port)  # answered at once, not after the idle one's timeout
        assert "no RDMA device" in reply.get("error", ""), reply
        assert time.monotonic() - t0 < 2
    finally:
        idle.close()


@pytest.mark.parametrize(
    "server",
    [{"local": LOCAL, "args": {"endpoint": FakeEndpoint, "session_seconds": 0.5}}],
    indirect=True,
)
def test_a_session_ends_at_its_deadline(server: ProbeServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as c:
        f = c.makefile("r")
        assert "nonce" in json.loads(f.readline())
        c.sendall(json.dumps({"node": "peer"}).encode() + b"\n")
        assert "rc_qpn" in json.loads(f.readline())
        t0 = time.monotonic()
        assert f.readline() == ""  # the server hangs up: the peer went silent
        assert time.monotonic() - t0 < 3


@pytest.mark.parametrize(
    "server",
    [{"local": LOCAL, "args": {"endpoint": FakeEndpoint, "max_sessions": 1}}],
    indirect=True,
)
def test_beyond_the_cap_a_client_is_told_busy(server: ProbeServer) -> None:
    first = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        f = first.makefile("r")
        assert "nonce" in json.loads(f.readline())
        first.sendall(json.dumps({"node": "a"}).encode() + b"\n")
        assert "rc_qpn" in json.loads(f.readline())
        reply = _hello(server.port)
        assert "busy" in reply.get("error", ""), reply
    finally:
        first.close()
