"""The webhook server's bounds (issue 16 #14): a connection cap that closes idle
connections first, a deadline per request, a body limit, all against a real flood over
loopback TLS."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_webhooks_server import Harness, make_bundle, post, review
from webhook_testlib import pod

from metaroce_operator.webhooks.certs import write_cert_files
from metaroce_operator.webhooks.server import ServerOptions, WebhookServer

HERE = Path(__file__).parent


def _tls(port: int, ca: bytes, timeout: float) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cadata=ca.decode())
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def test_a_flood_of_idle_connections_does_not_block_admission(tmp_path: Path) -> None:
    bundle = make_bundle()
    write_cert_files(bundle, tmp_path)
    server = subprocess.Popen(
        [sys.executable, str(HERE / "flood_server.py"), str(tmp_path), "64"],
        stdout=subprocess.PIPE,
        text=True,
    )
    flood: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port, cap = map(int, server.stdout.readline().split())
        # More idle connections than the server has file descriptors: handshaked ones
        # (an idle keep-alive connection) while the server completes handshakes, then
        # bare TCP ones (which wait in the listen backlog or for their handshake).
        handshaked = 0
        for _ in range(cap + 200):
            try:
                flood.append(_tls(port, bundle.ca_bundle, timeout=2))
                handshaked += 1
            except (OSError, ssl.SSLError):
                break
        for _ in range(100):
            with_tcp = socket.create_connection(("127.0.0.1", port), timeout=1)
            flood.append(with_tcp)
        assert handshaked >= 64, handshaked
        started = time.monotonic()
        ctx = ssl.create_default_context(cadata=bundle.ca_bundle.decode())
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=8)
        answer = post(conn, "/mutate-pod", review(pod(None)))
        assert answer["allowed"]
        assert time.monotonic() - started < 8
    finally:
        for s in flood:
            s.close()
        server.kill()
        server.wait()


def test_a_request_that_trickles_in_is_cut_at_its_deadline(tmp_path: Path) -> None:
    bundle = make_bundle()
    write_cert_files(bundle, tmp_path)
    synced = threading.Event()
    synced.set()
    from metaroce_operator.webhooks.server import AdmissionHandler

    server = WebhookServer(
        ServerOptions(cert_dir=tmp_path, address="127.0.0.1", port=0, request_timeout=1.0),
        AdmissionHandler(lambda: {}, synced, lambda ns: {}, lambda: {}),
    )
    server.start()
    try:
        conn = _tls(server.port, bundle.ca_bundle, timeout=10)
        started = time.monotonic()
        closed = False
        for byte in b"POST /mutate-pod HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                conn.sendall(bytes([byte]))
                time.sleep(0.1)
            except OSError:
                closed = True
                break
        if not closed:
            conn.settimeout(2)
            closed = conn.recv(1) == b""
        assert closed
        assert time.monotonic() - started < 4
    finally:
        server.stop()


def test_a_body_larger_than_an_admission_review_is_refused_at_once(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        conn = _tls(h.server.port, h.bundle.ca_bundle, timeout=3)
        conn.sendall(
            b"POST /mutate-pod HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (5 << 20)
        )
        head = conn.recv(4096)
        assert head.startswith(b"HTTP/1.1 413"), head
    finally:
        h.server.stop()


@pytest.mark.parametrize(
    ("slots", "victim"),
    [
        ({}, None),
        ({"a": ("answering", 1.0)}, None),
        ({"a": ("answering", 1.0), "b": ("idle", 5.0), "c": ("idle", 3.0)}, "c"),
        ({"a": ("reading", 1.0), "b": ("idle", 5.0)}, "b"),
        ({"a": ("reading", 2.0), "b": ("reading", 1.0), "c": ("answering", 0.0)}, "b"),
    ],
)
def test_the_connection_closed_for_a_new_one(
    slots: dict[str, tuple[str, float]], victim: str | None
) -> None:
    from metaroce_operator.webhooks.server import pick_eviction

    assert pick_eviction(slots) == victim
