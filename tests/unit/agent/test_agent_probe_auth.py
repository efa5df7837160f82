"""Probe peers authenticate each other (finding 7, auth): an HMAC keyed by the network's
probe key, over a fresh nonce from each side, so a client without the key gets no verbs
resources and a recorded session cannot be replayed; the client checks the server too.

On b6733c0 (and before this fix) the side channel takes any client: whoever reaches the
port makes the server create a PD, CQs and QPs, and can feed it a fake peer."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import SilentEndpoint

from metaroce_agent.probe import Local, ProbeServer, probe_peer
from metaroce_agent.probe_auth import ProbeKeyError, load_key, sign, verify

KEY = b"k" * 32
OTHER = b"o" * 32
LOCAL = Local("rxe_eth0", 1, 1, 104)


class FakeEndpoint(SilentEndpoint):
    made: list[str] = []


@pytest.fixture
def server() -> Iterator[ProbeServer]:
    FakeEndpoint.made = []
    srv = ProbeServer(
        "127.0.0.1",
        0,
        lambda rail: LOCAL,
        endpoint=FakeEndpoint,
        key=lambda: KEY,
        session_seconds=2,
    )
    threading.Thread(target=srv.serve, daemon=True).start()
    try:
        yield srv
    finally:
        srv.stop()


def _open(port: int) -> tuple[socket.socket, Any, dict[str, Any]]:
    c = socket.create_connection(("127.0.0.1", port), timeout=3)
    f = c.makefile("r")
    return c, f, dict(json.loads(f.readline()))


def _send(c: socket.socket, msg: dict[str, Any]) -> None:
    c.sendall(json.dumps(msg).encode() + b"\n")


def test_a_client_without_the_key_gets_no_verbs_resources(server: ProbeServer) -> None:
    c, f, challenge = _open(server.port)
    with c:
        assert len(challenge["nonce"]) >= 32
        _send(c, {"node": "intruder", "gid": "::", "rc_qpn": 1, "ud_qpn": 2, "psn": 0})
        reply = json.loads(f.readline())
    assert "authentication" in reply.get("error", ""), reply
    assert FakeEndpoint.made == []
    assert server.auth_failures == 1


def test_a_recorded_hello_cannot_be_replayed(server: ProbeServer) -> None:
    c, f, challenge = _open(server.port)
    hello = {"node": "peer", "gid": "::", "rc_qpn": 1, "ud_qpn": 2, "psn": 0, "nonce": "ab" * 16}
    hello["mac"] = sign(KEY, "client", challenge["nonce"], hello["nonce"], hello)
    with c:
        _send(c, hello)
        assert "rc_qpn" in json.loads(f.readline())  # the genuine one is served
        _send(c, {"op": "bye"})
    c2, f2, _ = _open(server.port)  # a new session has a new nonce
    with c2:
        _send(c2, hello)
        reply = json.loads(f2.readline())
    assert "authentication" in reply.get("error", ""), reply


def test_the_client_authenticates_and_checks_the_server(server: ProbeServer) -> None:
    wrong = probe_peer("node-2", "127.0.0.1", server.port, LOCAL, key=OTHER, endpoint=FakeEndpoint)
    assert not wrong.reachable and "authentication" in wrong.message, wrong
    right = probe_peer("node-2", "127.0.0.1", server.port, LOCAL, key=KEY, endpoint=FakeEndpoint)
    assert "authentication" not in right.message and "RC echo" in right.message, right


def test_the_mac_binds_both_nonces_and_every_field() -> None:
    body = {"node": "a", "rc_qpn": 1, "nonce": "cd" * 16}
    mac = sign(KEY, "client", "ab" * 16, "cd" * 16, body)
    assert verify(KEY, mac, "client", "ab" * 16, "cd" * 16, {**body, "mac": mac})
    assert not verify(KEY, mac, "server", "ab" * 16, "cd" * 16, body)  # role
    assert not verify(KEY, mac, "client", "ef" * 16, "cd" * 16, body)  # server nonce
    assert not verify(KEY, mac, "client", "ab" * 16, "cd" * 16, {**body, "rc_qpn": 2})
    assert not verify(OTHER, mac, "client", "ab" * 16, "cd" * 16, body)


def test_a_key_file_is_checked_with_an_error_naming_it_and_the_fix(tmp_path: Path) -> None:
    assert load_key(tmp_path / "absent") is None
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    with pytest.raises(ProbeKeyError, match=r"short.*16 bytes"):
        load_key(short)
    good = tmp_path / "key"
    good.write_bytes(KEY + b"\n")
    assert load_key(good) == KEY
