"""Finding the guests' L2 dead, reporting it and reviving it (``l2_health``), on real
guests: the L2 is killed the ways qemu and a guest can kill it, and must come back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metaroce_harness import l2_health
from metaroce_harness.guests import L2_NETDEV_ID, GuestCluster, GuestError
from metaroce_harness.qmp import qmp_command

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _deliberate_deaths_are_not_reported() -> Iterator[None]:
    """The tier's summary lists ``l2_health.heals`` as L2 deaths nobody caused; the
    ones these tests cause are taken back out."""
    before = list(l2_health.heals)
    yield
    l2_health.heals[:] = before


def test_a_live_l2_is_left_alone(guests: GuestCluster) -> None:
    assert l2_health.l2_unreachable(guests) == []
    assert l2_health.heal_l2(guests) is None


def test_a_nic_qemu_stopped_serving_is_found_reported_and_revived(guests: GuestCluster) -> None:
    a, b = guests[0], guests[1]
    # qemu stops carrying node-2's frames either way: from both guests, the L2 is dead
    qmp_command(b.qmp_socket, "set_link", {"name": L2_NETDEV_ID, "up": False})
    assert sorted(l2_health.l2_unreachable(guests)) == [f"{a.name}->{b.ip}", f"{b.name}->{a.ip}"]
    text = l2_health.heal_l2(guests)
    print(text)
    assert text is not None and text in l2_health.heals
    assert "came back after: qemu reads each tap again (QMP set_link up)" in text
    # the report of the dead L2: the taps, and what qemu holds of each NIC's rings
    assert "tap1: from guest" in text and f"{b.name} eth0 rx ring (qemu's view" in text
    assert l2_health.l2_unreachable(guests) == []


def test_a_guest_that_took_its_nic_down_gets_it_back(guests: GuestCluster) -> None:
    guests[1].run("ip link set eth0 down", check=True)
    try:
        text = l2_health.heal_l2(guests)
        assert text is not None and "ip link set eth0 down/up in each guest" in text
        assert l2_health.l2_unreachable(guests) == []
    finally:
        guests[1].run("ip link set eth0 up", check=False)


def test_a_bounced_nic_keeps_its_routes(guests: GuestCluster) -> None:
    b = guests[1]
    route = f"10.99.0.0/24 via {guests[0].ip}"
    b.run(f"ip route replace {route} dev eth0", check=True)
    try:
        l2_health.bounce_nic(b)
        assert route in b.run("ip -4 route show dev eth0", check=True).stdout
        assert l2_health.l2_unreachable(guests) == []
    finally:
        b.run("ip route del 10.99.0.0/24", check=False)


def test_kicking_a_live_nic_leaves_it_working(guests: GuestCluster) -> None:
    """The kick that revives a ring whose notification was lost: the guest finds its NIC's
    notify register and writing it disturbs nothing on a working L2."""
    for g in guests:
        l2_health.kick_nic(g)
    assert l2_health.l2_unreachable(guests) == []
    for g in guests:
        tx = g.nic_ring("tx")
        assert tx["posted"] == tx["last-avail-idx"], tx  # nothing left waiting on qemu


def test_an_l2_nothing_revives_fails_with_what_was_tried(
    guests: GuestCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(l2_health, "SETTLE_SECONDS", 2.0)  # each poke: one check, no wait
    b = guests[1]
    b.run("tc qdisc add dev eth0 ingress && "
          "tc filter add dev eth0 ingress matchall action drop", check=True)  # fmt: skip
    try:
        with pytest.raises(GuestError, match="stayed dead after: qemu reads each tap again"):
            l2_health.heal_l2(guests)
    finally:
        b.run("tc qdisc del dev eth0 ingress", check=True)
    assert l2_health.heal_l2(guests) is None
