"""The UD loss count waits on the server's completions (finding 8): the client says how
many datagrams it sent and the server counts until that many arrived or none came for
COUNT_QUIET_SECONDS, asleep on its completion channel, instead of the client napping a
fixed 0.2 s and the server counting whatever had arrived by then.

Before this fix, datagrams completing later than 0.2 s after the burst (a TCG guest, a
loaded node) were counted as lost: a healthy peer showed 100% loss."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from fakes import WiredEndpoint

from metaroce_agent import probe
from metaroce_agent.probe import Local, ProbeServer, probe_peer

KEY = b"k" * 32
LOCAL = Local("rxe_eth0", 1, 1, 104)


class LateEndpoint(WiredEndpoint):
    ud_delay = 0.5


class LossyEndpoint(WiredEndpoint):
    ud_delivered = 150


def _server(endpoint: type[WiredEndpoint]) -> Iterator[ProbeServer]:
    srv = ProbeServer("127.0.0.1", 0, lambda rail: LOCAL, endpoint=endpoint, key=lambda: KEY)
    threading.Thread(target=srv.serve, daemon=True).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def late() -> Iterator[ProbeServer]:
    yield from _server(LateEndpoint)


@pytest.fixture
def lossy() -> Iterator[ProbeServer]:
    yield from _server(LossyEndpoint)


def test_datagrams_completing_late_are_counted_not_lost(late: ProbeServer) -> None:
    r = probe_peer("node-2", "127.0.0.1", late.port, LOCAL, key=KEY, endpoint=LateEndpoint)
    assert r.reachable, r
    assert len(r.rtts_us) == probe.RC_PINGS
    assert r.ud == (probe.UD_BURST, probe.UD_BURST) and r.loss == 0.0, r


def test_lost_datagrams_end_the_count_after_a_quiet_spell(lossy: ProbeServer) -> None:
    t0 = time.monotonic()
    r = probe_peer("node-2", "127.0.0.1", lossy.port, LOCAL, key=KEY, endpoint=LossyEndpoint)
    took = time.monotonic() - t0
    assert r.reachable and r.ud == (probe.UD_BURST, 150), r
    assert took < probe.COUNT_QUIET_SECONDS + 3, took  # the wait is bounded
