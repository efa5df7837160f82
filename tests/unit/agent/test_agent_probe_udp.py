"""A metaroce network's probe: the RDMA probe's sessions (side channel, keys, verdicts)
over UDP datagrams from the served netdev's address (`probe_udp.UdpEndpoint`), here
between a real server and client on the loopback interface."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from metaroce_agent import probe
from metaroce_agent.probe import Local, ProbeServer, probe_peer
from metaroce_agent.probe_udp import BURST_PORTS, HEADER, MAGIC, PING, RCVBUF, UdpEndpoint

LOCAL = Local("eth0", 0, 0, 26 << 2, address="127.0.0.1")
KEY = (b"k" * 32,)


@pytest.fixture
def server() -> Iterator[ProbeServer]:
    srv = ProbeServer(
        "127.0.0.1", 0, lambda rail: LOCAL if rail == 0 else None,
        endpoint=UdpEndpoint, key=lambda: KEY,
    )  # fmt: skip
    threading.Thread(target=srv.serve, daemon=True).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_a_session_measures_latency_and_loss_over_udp(server: ProbeServer) -> None:
    r = probe_peer("peer", "127.0.0.1", server.port, LOCAL, key=KEY, endpoint=UdpEndpoint)
    assert r.reachable, r.message
    assert len(r.rtts_us) == probe.RC_PINGS
    assert r.ud == (probe.UD_BURST, probe.UD_BURST) and r.loss == 0.0
    assert r.device == "eth0"


def test_a_client_without_the_key_gets_nothing(server: ProbeServer) -> None:
    r = probe_peer("peer", "127.0.0.1", server.port, LOCAL, key=(b"x" * 32,),
                   endpoint=UdpEndpoint)  # fmt: skip
    assert not r.reachable and "authentication" in r.message


def test_a_verbs_peer_is_told_what_is_missing() -> None:
    ep = UdpEndpoint(LOCAL)
    try:
        with pytest.raises(ValueError, match=r"no UDP endpoint.*metaroce network"):
            ep.connect({"gid": "fe80::1", "rc_qpn": 17, "ud_qpn": 18, "psn": 1})
    finally:
        ep.close()


def test_a_netdev_without_an_address_is_refused() -> None:
    with pytest.raises(ValueError, match="netdev eth0: no address"):
        UdpEndpoint(Local("eth0", 0, 0, 104))


def _pair() -> tuple[UdpEndpoint, UdpEndpoint]:
    a, b = UdpEndpoint(LOCAL), UdpEndpoint(LOCAL)
    a.connect(b.hello())
    b.connect(a.hello())
    return a, b


def test_datagrams_not_of_the_session_are_dropped_and_counted() -> None:
    a, b = _pair()
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        port = b.sock.getsockname()[1]
        good_header = HEADER.pack(MAGIC, PING, b.token, 1).ljust(64, b"\0")
        stranger.sendto(good_header, ("127.0.0.1", port))  # right token, wrong sender
        a.sock.sendto(HEADER.pack(MAGIC, PING, b"\0" * 8, 1), ("127.0.0.1", port))  # token
        a.sock.sendto(b"MRPB", ("127.0.0.1", port))  # too short
        a.sock.sendto(HEADER.pack(b"XXXX", PING, b.token, 1), ("127.0.0.1", port))  # magic
        a.rc_send()  # a's ping: the one that counts
        b.wait(1.0)
        got = b.poll(b.rc_cq)
        assert got == [(b.e.IBV_WC_RECV, b.e.IBV_WC_SUCCESS)]
        assert b.dropped == 4
    finally:
        stranger.close()
        a.close()
        b.close()


def test_an_echo_of_an_earlier_ping_is_not_the_last_pings() -> None:
    client, server = _pair()
    try:
        client.rc_send()  # ping 1 ...
        server.wait(1.0)
        assert server.poll(server.rc_cq)
        client.rc_send()  # ... ping 2, sent before ping 1's echo came back
        server.rc_send()  # the echo of ping 1
        client.wait(1.0)
        assert client.poll(client.rc_cq) == []
        assert client.stale == 1
        server.wait(1.0)
        server.poll(server.rc_cq)
        server.rc_send()  # the echo of ping 2
        client.wait(1.0)
        assert client.poll(client.rc_cq) == [(128, 0)]
    finally:
        client.close()
        server.close()


def test_the_datagrams_carry_the_networks_dscp_with_ect0() -> None:
    ep = UdpEndpoint(LOCAL)
    try:
        assert ep.sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == (26 << 2) | 0b10
    finally:
        ep.close()


def test_a_burst_leaves_from_several_source_ports_and_is_counted_whole() -> None:
    client, server = _pair()
    try:
        for _ in range(3 * BURST_PORTS):
            client.ud_send()
        ports = {s.getsockname()[1] for s in client.burst_socks}
        assert len(ports) == BURST_PORTS  # as many ECMP hashes as source ports
        received = 0
        for _ in range(50):
            server.wait(0.1)
            received += sum(1 for op, _ in server.poll(server.ud_cq, 256) if op == 128)
            if received == 3 * BURST_PORTS:
                break
        assert received == 3 * BURST_PORTS and server.dropped == 0
    finally:
        client.close()
        server.close()


def test_the_session_socket_holds_a_whole_burst() -> None:
    ep = UdpEndpoint(LOCAL)
    try:  # the kernel reports twice what it grants: past rmem_max as root (the agent)
        granted = ep.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
        assert granted >= 2 * (RCVBUF if os.geteuid() == 0 else min(RCVBUF, rmem_max))
    finally:
        ep.close()
