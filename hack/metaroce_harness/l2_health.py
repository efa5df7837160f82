"""Whether the guests still reach each other over their private L2, and reviving an
emulated NIC that stopped taking frames.

Seen in CI on 2026-12-04, 2026-12-05 and 2026-12-06, each time in the middle of an
ib_write_bw between the real nodes, and the L2 stayed dead for the rest of the run, so
every later cross-node test failed too. Reproduced on 2026-12-06 by back-to-back 30 s
ib_write_bw runs (64 KiB, one in flight) between two bare guests, twice within seven
runs: the sender's transmit ring held 131-197 frames its guest had posted (its avail
index, read from guest memory) that qemu never took, qemu's avail_event sat at the index
it had taken up to, and qemu was not waiting on the tap (no POLLOUT): it waited for a
kick that never came. The receiver's ring merely starved. A manual kick (the
guest writing the queue's notify register) revived it; a flush (``set_link``), a carrier
flap or ``ip link set eth0 down/up`` did not. A late revival can cost the guest: rxe frees
a QP whose frames still sit in the ring when the QP's process exits (a WARNING in
``__rxe_cleanup``), and the frames' destructor then dereferences it. The guests' L2 NIC
therefore runs without virtio's event index (``event_idx=off`` in ``guests``); with it
off, the same stress ran 25 times in a row (12.5 min of streaming at 11-20 MB/s, as with
it on) without a stall, which at 2 stalls in 7 runs would come by chance with p ~ 2e-4.

- ``l2_unreachable(cluster)``: the ``src->dst`` pairs whose ping over ``eth0`` fails now.
- ``heal_l2(cluster)``: None while every pair answers; otherwise the L2's report as it is
  (``GuestCluster.l2_report``: taps, NIC counters, interrupts, qemu's view of the rings),
  then pokes, gentlest first, until the pairs answer again: qemu reads its taps again
  (``set_link`` up, which flushes what it had stopped reading), a carrier flap, a kick of
  each queue of the NIC from inside the guest (``kick_nic``), and last the guest's own
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

    def kick() -> None:
        for g in cluster:
            kick_nic(g)

    def bounce() -> None:
        for g in cluster:
            bounce_nic(g)

    return [
        ("qemu reads each tap again (QMP set_link up)", lambda: set_link(True)),
        ("a carrier flap of each guest's eth0 (QMP set_link off, on)", flap),
        ("a kick of each guest's eth0 queues (their notify register)", kick),
        ("ip link set eth0 down/up in each guest, its routes put back", bounce),
    ]


def kick_nic(guest: Guest) -> None:
    """Notify qemu of eth0's receive (0) and transmit (1) queues as the driver would: one
    byte, the queue's index, to the legacy notify register (offset 16 of the device's I/O
    BAR; the memory BAR is the driver's alone). qemu then looks at the ring again, which
    revives one whose kick was lost (see above)."""
    script = (
        "read -r start _ flags < /sys/class/net/eth0/device/../resource; "
        "(( flags & 0x100 )) || { echo 'eth0: BAR 0 is not an I/O BAR' >&2; exit 1; }; "
        'for q in 0 1; do printf "\\x0$q" | '
        "dd of=/dev/port bs=1 seek=$((start + 16)) count=1 status=none || exit 1; done"
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
