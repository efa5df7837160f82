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
from metaroce_agent.probe_auth import ProbeKeyError, key_id, load_key, load_keys, sign, verify

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


def _serve(keys: tuple[bytes, ...]) -> ProbeServer:
    srv = ProbeServer(
        "127.0.0.1", 0, lambda rail: LOCAL, endpoint=FakeEndpoint, key=lambda: keys,
        session_seconds=2,
    )  # fmt: skip
    threading.Thread(target=srv.serve, daemon=True).start()
    return srv


@pytest.mark.parametrize(
    ("server_keys", "client_keys"),
    [((OTHER, KEY), (KEY,)), ((KEY,), (OTHER, KEY)), ((OTHER, KEY), (OTHER, KEY))],
    ids=["rotated-server", "rotated-client", "both-rotated"],
)
def test_a_rotation_reaching_the_nodes_one_by_one_keeps_them_authenticated(
    server_keys: tuple[bytes, ...], client_keys: tuple[bytes, ...]
) -> None:
    """The operator's probe Secret is rotated by putting a new `key` and the old one in
    `previous`; the kubelet updates the mounted Secret node by node, so for a while an
    updated agent (new, old) meets one that holds only the old key: they agree on it."""
    srv = _serve(server_keys)
    try:
        got = probe_peer("n2", "127.0.0.1", srv.port, LOCAL, key=client_keys, endpoint=FakeEndpoint)
        assert "authentication" not in got.message and "RC echo" in got.message, got
        assert srv.auth_failures == 0
    finally:
        srv.stop()


def test_a_dropped_previous_key_is_refused() -> None:
    srv = _serve((OTHER,))
    try:
        got = probe_peer("n2", "127.0.0.1", srv.port, LOCAL, key=(KEY,), endpoint=FakeEndpoint)
        assert not got.reachable and "authentication" in got.message, got
    finally:
        srv.stop()


def test_the_keys_are_the_key_file_and_the_previous_one_beside_it(tmp_path: Path) -> None:
    key = tmp_path / "key"
    assert load_keys(key) == ()
    key.write_bytes(KEY)
    assert load_keys(key) == (KEY,)
    (tmp_path / "previous").write_bytes(KEY + b"\n")  # the same key: one
    assert load_keys(key) == (KEY,)
    (tmp_path / "previous").write_bytes(OTHER)
    assert load_keys(key) == (KEY, OTHER)
    assert key_id(KEY) != key_id(OTHER) and KEY.hex() not in key_id(KEY)
