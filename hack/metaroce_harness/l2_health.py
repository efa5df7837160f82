"""Whether the guests still reach each other over their private L2, and reviving an
emulated NIC that stopped taking frames.

Seen in CI on 2026-12-04 and 2026-12-05, each time in the middle of an ib_write_bw
between the real nodes: the bridge kept handing frames to both taps, but neither guest's
``eth0`` counted one more received frame, and the L2 stayed dead for the rest of the run,
so every later cross-node test failed too. No setting of the network explains it: it is
the emulated NIC (qemu's virtio-net under TCG) or the guest's receive path. Seen again on
2026-12-06 with qemu's view of the rings: 234 receive buffers posted and none taken, the
tap holding frames, while the guest still sent; a flush of qemu's queue (``set_link``)
and the guest's down/up did not revive it. No GSO frames cross this L2 (the NIC offers no
offloads), so it is not qemu's stall on a frame larger than the posted buffers.

- ``l2_unreachable(cluster)``: the ``src->dst`` pairs whose ping over ``eth0`` fails now.
- ``heal_l2(cluster)``: None while every pair answers; otherwise the L2's report as it is
  (``GuestCluster.l2_report``: taps, NIC counters, interrupts, qemu's view of the rings),
  then pokes, gentlest first, until the pairs answer again: qemu reads its taps again
  (``set_link`` up, which flushes what it had stopped reading), a carrier flap, a reset of
  the NIC's receive queue (``reset_rx_queue``: qemu drops what it held of the ring and
  starts it again, addresses and routes untouched), and last the guest's own
  ``ip link set eth0 down/up`` (``bounce_nic``: its routes put back).
  Returns what was dead, the report and what revived it; raises ``GuestError`` with all
  of that when nothing did. Every revival is kept in ``heals`` so that a test run prints
  it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from metaroce_harness.guests import L2_NETDEV_ID, Guest, GuestCluster, GuestError
from metaroce_harness.qmp import QmpError, qmp_command

log = logging.getLogger("metaroce.guests")

heals: list[str] = []
"""Every revival of this process: what was dead and what revived it."""

SETTLE_SECONDS = 12.0
"""How long a poke gets before the next: ARP and the carrier need a few seconds."""


def l2_unreachable(cluster: GuestCluster) -> list[str]:
    """The ``src->dst`` pairs of guests whose ping over ``eth0`` gets no answer now (a
    ping needs both directions, so one dead receive side fails both of its pairs)."""
    dead = []
    for g in cluster:
        peers = " ".join(o.ip for o in cluster if o is not g)
        # three tries: the first may wait on ARP, after a flap or a failed neighbour entry
        script = (
            f"for p in {peers}; do ok=; for i in 1 2 3; do "
            "ping -n -q -c 1 -W 2 -I eth0 $p >/dev/null && { ok=1; break; }; done; "
            '[ -n "$ok" ] || echo $p; done'
        )
        out = g.run(script, timeout=30)
        dead += [f"{g.name}->{ip}" for ip in out.stdout.split()]
    return dead


def heal_l2(cluster: GuestCluster) -> str | None:
    """None when every guest reaches every other over the L2; else revive it (above)."""
    dead = l2_unreachable(cluster)
    if not dead:
        return None
    report = cluster.l2_report()
    tried = []
    for name, poke in _pokes(cluster):
        tried.append(name)
        try:
            poke()
        except (GuestError, QmpError) as exc:
            tried[-1] += f" (failed: {exc})"
            continue
        if _answers_within(cluster, SETTLE_SECONDS):
            text = (
                f"the guests' L2 was dead ({', '.join(dead)}) and came back after: "
                f"{'; then '.join(tried)}\nthe L2 when found dead:\n{report}"
            )
            heals.append(text)
            log.warning("%s", text)
            return text
    raise GuestError(
        f"the guests' L2 is dead ({', '.join(dead)}) and stayed dead after: "
        f"{'; '.join(tried)}\nthe L2 when found dead:\n{report}"
    )


def _answers_within(cluster: GuestCluster, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if not l2_unreachable(cluster):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1)


def _pokes(cluster: GuestCluster) -> list[tuple[str, Callable[[], None]]]:
    def set_link(up: bool) -> None:
        for g in cluster:
            qmp_command(g.qmp_socket, "set_link", {"name": L2_NETDEV_ID, "up": up})

    def flap() -> None:
        set_link(False)
        time.sleep(1)
        set_link(True)

    def reset_rx() -> None:
        for g in cluster:
            reset_rx_queue(g)

    def bounce() -> None:
        for g in cluster:
            bounce_nic(g)

    return [
        ("qemu reads each tap again (QMP set_link up)", lambda: set_link(True)),
        ("a carrier flap of each guest's eth0 (QMP set_link off, on)", flap),
        ("a reset of each guest's eth0 receive queue (ethtool -G rx)", reset_rx),
        ("ip link set eth0 down/up in each guest, its routes put back", bounce),
    ]


def reset_rx_queue(guest: Guest) -> None:
    """Resize eth0's receive ring to half and back (``ethtool -G``): with virtio's queue
    reset (negotiated by qemu 7.2 and Linux 6.1) the driver resets that one queue, qemu
    drops what it held of it (its queued frames, its ring indices) and both start it
    again from fresh buffers; the addresses, routes and RDMA devices on eth0 stay."""
    script = (
        "max=$(ethtool -g eth0 | awk '/^RX:/ {print $2; exit}'); "
        '[ -n "$max" ] || exit 1; '
        "ethtool -G eth0 rx $((max / 2)) && ethtool -G eth0 rx $max"
    )
    guest.run(script, timeout=30, check=True)


def bounce_nic(guest: Guest) -> None:
    """``ip link set eth0 down/up`` in the guest: its driver posts receive buffers and
    polls again. Down drops the routes over eth0 that are not the kernel's own (the pod
    subnets of the other nodes): they are put back once the carrier is up."""
    script = (
        "routes=$(ip -4 route show dev eth0 | grep -v 'proto kernel'); "
        "ip link set eth0 down && ip link set eth0 up || exit 1; "
        "for i in $(seq 50); do ip link show eth0 | grep -q LOWER_UP && break; sleep 0.1; done; "
        'echo "$routes" | while read -r r; do [ -n "$r" ] && ip route replace $r dev eth0; '
        "done; true"
    )
    guest.run(script, timeout=30, check=True)
