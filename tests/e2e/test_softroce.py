"""Real SoftRoCE in qemu guests: devices, RC data movement, rdma_cm ToS, verbs traffic class."""

from __future__ import annotations

import json

import pytest
from e2e_support import (
    RXE_DEV,
    Capture,
    client_server,
    ensure_rxe,
    guest_program,
    run_json,
    set_default_roce_tos,
)

from metaroce_harness.guest_transport import hw_counters
from metaroce_harness.guests import Guest, GuestCluster

pytestmark = pytest.mark.e2e


def ipv4_mapped_gid(ip: str) -> str:
    a, b, c, d = (int(x) for x in ip.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


@pytest.fixture(scope="module")
def rxe_pair(guests: GuestCluster) -> tuple[Guest, Guest]:
    """Both guests with rdma_rxe loaded and rxe0 on eth0."""
    for g in guests:
        ensure_rxe(g)
    return guests[0], guests[1]


def test_rxe_on_eth0_is_active_with_a_rocev2_gid(node1: Guest) -> None:
    """One guest: rdma_rxe loads, rxe0 on eth0 is ACTIVE and has a RoCE v2 GID."""
    link = ensure_rxe(node1).stdout
    assert "state ACTIVE" in link and "netdev eth0" in link, link
    # /proc/modules and sysfs are read without starting programs: under TCG every
    # program start from the 9p root costs time.
    mods = node1.read_file("/proc/modules").decode()
    for mod in ("rdma_rxe", "ib_uverbs", "rdma_ucm", "crc32_generic"):
        assert f"\n{mod} " in "\n" + mods, f"{mod} is not loaded:\n{mods}"

    info = run_json(node1, ["python3", guest_program(node1, "rdma_info.py"), RXE_DEV])
    [dev] = info["devices"]
    port = dev["ports"]["1"]
    assert port["active"], f"pyverbs: port 1 of {RXE_DEV} is not ACTIVE: {port}"
    assert port["link_layer"] == 2, "pyverbs: link layer is not Ethernet"  # IBV_LINK_LAYER_ETHERNET
    want = ipv4_mapped_gid(node1.ip)
    v2 = [g for g in port["gids"] if g["type"] == "RoCE v2"]
    assert want in [g["gid"] for g in v2], f"pyverbs: no RoCE v2 GID {want} in {port['gids']}"

    # sysfs: the port's state and link layer, the GID table with each GID's type, and
    # the netdev behind the IPv4 GID (read with shell builtins only).
    sysfs = node1.run(
        f'cd /sys/class/infiniband/{RXE_DEV}/ports/1 && read -r s <state && echo "$s" && '
        'read -r l <link_layer && echo "$l" && for i in 0 1 2 3 4 5 6 7; do '
        'read -r g <gids/$i; t=""; read -r t <gid_attrs/types/$i 2>/dev/null; '
        'n=""; read -r n <gid_attrs/ndevs/$i 2>/dev/null; echo "$i $g $n $t"; done',
        check=True,
    ).stdout.splitlines()
    assert sysfs[0] == "4: ACTIVE", sysfs
    assert sysfs[1] == "Ethernet", sysfs
    assert any(line.endswith(f"{want} eth0 RoCE v2") for line in sysfs[2:]), sysfs


def test_pyverbs_rc_qp_moves_data_both_ways_and_hw_counters_count_it(
    rxe_pair: tuple[Guest, Guest],
) -> None:
    """Two guests: an RC QP written with pyverbs WRITEs and SENDs both ways, verified
    byte for byte, and both sides' hw_counters count the packets."""
    client, server = rxe_pair
    before = {g.name: hw_counters(g) for g in rxe_pair}
    size, rounds = 16384, 2
    prog = guest_program(server, "rc_pingpong.py")
    opts = ["--port", "18515", "--size", str(size), "--rounds", str(rounds)]
    cli, srv_result = client_server(
        client,
        server,
        ["python3", prog, "client", "--server", server.ip, *opts],
        ["python3", prog, "server", *opts],
    )
    c = json.loads(cli.stdout.strip().splitlines()[-1])
    s = json.loads(srv_result.stdout.strip().splitlines()[-1])
    assert c["verified"] and s["verified"]
    assert c["peer_qpn"] == s["qpn"] and s["peer_qpn"] == c["qpn"]
    per_way = 2 * size * rounds  # one RDMA WRITE and one SEND of `size` bytes per round
    assert c["bytes"] == {"client_to_server": per_way, "server_to_client": per_way}

    after = {g.name: hw_counters(g) for g in rxe_pair}
    # MTU 1024: each direction sends at least per_way/1024 request packets, and the
    # other side receives them (plus ACKs both ways).
    min_packets = per_way // 1024
    for g in rxe_pair:
        sent = after[g.name]["sent_pkts"] - before[g.name]["sent_pkts"]
        rcvd = after[g.name]["rcvd_pkts"] - before[g.name]["rcvd_pkts"]
        assert sent >= min_packets, f"{g.name}: sent_pkts grew by {sent} < {min_packets}"
        assert rcvd >= min_packets, f"{g.name}: rcvd_pkts grew by {rcvd} < {min_packets}"
        for err in ("send_err", "retry_exceeded_err"):
            assert after[g.name][err] == before[g.name][err], f"{g.name}: {err} grew"
    # Nothing is received that was not sent (the emulated wire may drop, RC resends).
    for src, dst in ((client, server), (server, client)):
        sent = after[src.name]["sent_pkts"] - before[src.name]["sent_pkts"]
        rcvd = after[dst.name]["rcvd_pkts"] - before[dst.name]["rcvd_pkts"]
        assert rcvd <= sent, f"{dst.name} received {rcvd} packets, {src.name} sent {sent}"


def test_rdma_cm_connection_carries_the_configfs_default_roce_tos(
    rxe_pair: tuple[Guest, Guest],
) -> None:
    """default_roce_tos written through rdma_cm's configfs is the IP ToS on the wire
    of an rdma_cm (pyverbs CMID) connection that does not set its own."""
    client, server = rxe_pair
    tos = 106  # DSCP 26, ECN 10: 0x6a on the wire
    for g in rxe_pair:
        set_default_roce_tos(g, tos)
    try:
        cap = Capture(server)
        prog = guest_program(server, "cm_pingpong.py")
        client_server(
            client,
            server,
            ["python3", prog, "client", "--addr", client.ip, "--server", server.ip],
            ["python3", prog, "server", "--addr", server.ip],
        )
        summary = cap.stop()
    finally:
        for g in rxe_pair:
            set_default_roce_tos(g, 0)

    groups = summary["groups"]
    data = [grp for grp in groups if grp["kind"] == "data"]
    for src, dst in ((client.ip, server.ip), (server.ip, client.ip)):
        way = [grp for grp in data if grp["src"] == src and grp["dst"] == dst]
        assert way, f"no rdma_cm data packets {src} -> {dst} captured: {groups}"
        assert {grp["tos"] for grp in way} == {tos}, (
            f"{src} -> {dst}: ToS {sorted({grp['tos'] for grp in way})} on the wire, "
            f"configfs default_roce_tos is {tos}: {groups}"
        )
    # The connection's own CM exchange (REQ/REP/RTU on QP 1) uses the same ToS.
    cm = [grp for grp in groups if grp["kind"] == "cm" and grp["tos"] == tos]
    assert {grp["src"] for grp in cm} == {client.ip, server.ip}, groups


def test_verbs_qp_traffic_class_from_rtr_attributes_is_on_the_wire(
    rxe_pair: tuple[Guest, Guest],
) -> None:
    """A verbs RC QP sends with the traffic class of the GRH given at RTR, each side its
    own, and rdma_cm's configfs default does not apply to it."""
    client, server = rxe_pair
    client_tc, server_tc, configfs_tos = 184, 144, 106  # 0xb8 / 0x90 vs 0x6a
    for g in rxe_pair:
        set_default_roce_tos(g, configfs_tos)
    try:
        cap = Capture(server)
        prog = guest_program(server, "rc_pingpong.py")
        client_server(
            client,
            server,
            ["python3", prog, "client", "--server", server.ip, "--port", "18516",
             "--tc", str(client_tc), "--rounds", "1"],
            ["python3", prog, "server", "--port", "18516", "--tc", str(server_tc),
             "--rounds", "1"],
        )  # fmt: skip
        summary = cap.stop()
    finally:
        for g in rxe_pair:
            set_default_roce_tos(g, 0)

    data = [grp for grp in summary["groups"] if grp["kind"] == "data"]
    ways = {(grp["src"], grp["dst"]): set() for grp in data}
    for grp in data:
        ways[(grp["src"], grp["dst"])].add(grp["tos"])
    assert ways == {
        (client.ip, server.ip): {client_tc},
        (server.ip, client.ip): {server_tc},
    }, f"ToS by direction: {ways} (groups: {summary['groups']})"
