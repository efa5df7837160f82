"""Probe verdicts stand on enough samples (finding 8): RTTs and UD counts accumulate across
rounds per peer, latency is judged only on a p99 over LATENCY_SAMPLES RTTs, loss by a
Wilson confidence bound with hysteresis, and each verdict says how many samples it has.

On b6733c0 each round stands alone: p99 of 20 samples, loss of 50 datagrams in 2% steps
against a 1% limit, so one lost datagram fails a healthy node."""

from __future__ import annotations

from metaroce_agent.probe import (
    LATENCY_SAMPLES,
    PeerHistory,
    PeerResult,
    summarize,
    wilson_bounds,
)


def _round(lost: int, sent: int = 200, rtt: float = 100.0, n: int = 100) -> PeerResult:
    return PeerResult("node-2", True, rtts_us=(rtt,) * n, loss=lost / sent, ud=(sent, sent - lost))


def test_wilson_bounds_need_thousands_of_datagrams_for_a_one_percent_limit() -> None:
    lo, hi = wilson_bounds(0, 50)
    assert lo == 0 and hi > 0.05  # 50 clean datagrams cannot show loss <= 1%
    lo, hi = wilson_bounds(0, 2000)
    assert hi < 0.01
    lo, hi = wilson_bounds(60, 2000)  # 3%
    assert lo > 0.01


def test_one_lost_datagram_does_not_fail_a_healthy_peer() -> None:
    history: dict[str, PeerHistory] = {}
    s, _ = summarize([_round(lost=1)], 1000, 0.01, history)
    assert s.healthy is True, s  # 1 of 200 is not evidence of > 1% loss


def test_loss_fails_only_when_the_bound_says_so_and_recovers_with_hysteresis() -> None:
    history: dict[str, PeerHistory] = {}
    verdicts = [summarize([_round(lost=10)], 1000, 0.01, history)[0].healthy for _ in range(3)]
    assert verdicts[-1] is False  # 5% over 600 datagrams: the lower bound is above 1%
    assert history["node-2"].loss_failing
    s, _ = summarize([_round(lost=0)], 1000, 0.01, history)
    assert s.healthy is False  # one clean round does not clear it: the window still has loss
    for _ in range(25):
        s, _ = summarize([_round(lost=0)], 1000, 0.01, history)
    assert s.healthy is True  # the upper bound fell below the limit


def test_latency_is_judged_on_a_p99_of_enough_samples_and_the_count_is_reported() -> None:
    history: dict[str, PeerHistory] = {}
    slow = PeerResult("node-2", True, rtts_us=(100.0,) * 95 + (5000.0,) * 5, ud=(200, 200))
    s, _ = summarize([slow], 1000, 0.01, history)
    assert s.healthy is True  # 100 samples: not enough for a p99
    assert s.peers is not None and "100 RTTs" in s.peers[0].message
    for _ in range(LATENCY_SAMPLES // 100):
        s, _ = summarize([slow], 1000, 0.01, history)
    assert s.healthy is False
    assert s.peers is not None and f"{LATENCY_SAMPLES} RTTs" in s.peers[0].message
    assert "datagrams" in s.peers[0].message


def test_numbers_the_operator_judges_are_stated_only_on_enough_samples() -> None:
    history: dict[str, PeerHistory] = {}
    s, _ = summarize([_round(lost=3)], 1000, 0.01, history)
    assert s.peers is not None
    p = s.peers[0]
    assert p.latency_p99_microseconds is None and p.loss_fraction is None
    assert "loss 3 of 200 datagrams" in p.message and "over 100 RTTs" in p.message
    for _ in range(9):
        s, _ = summarize([_round(lost=3)], 1000, 0.01, history)
    assert s.peers is not None
    assert s.peers[0].latency_p99_microseconds == 100.0
    assert s.peers[0].loss_fraction == 30 / 2000


def test_each_entry_says_how_many_samples_stand_behind_its_verdict() -> None:
    history: dict[str, PeerHistory] = {}
    s, _ = summarize([_round(lost=3)], 1000, 0.01, history)
    assert s.peers is not None
    assert (s.peers[0].latency_samples, s.peers[0].loss_datagrams) == (100, 200)
    for _ in range(2):
        s, _ = summarize([_round(lost=3)], 1000, 0.01, history)
    assert s.peers is not None
    assert (s.peers[0].latency_samples, s.peers[0].loss_datagrams) == (300, 600)
    dumped = s.to_api()
    assert dumped["peers"][0]["latencySamples"] == 300, dumped
    assert dumped["peers"][0]["lossDatagrams"] == 600


def test_two_rails_state_the_fewer_samples() -> None:
    history: dict[str, PeerHistory] = {}
    a = PeerResult("node-2", True, rtts_us=(100.0,) * 100, ud=(200, 200), device="rxe0")
    b = PeerResult("node-2", True, rtts_us=(100.0,) * 40, ud=(120, 120), device="rxe1")
    s, _ = summarize([a, b], 1000, 0.01, history)
    assert s.peers is not None and len(s.peers) == 1
    assert (s.peers[0].latency_samples, s.peers[0].loss_datagrams) == (40, 120)


def test_a_healthy_peer_is_reported_again_once_its_figures_are_stated() -> None:
    """The NodeState is written when the verdict key changes; a healthy peer stays healthy
    while its samples accumulate, so without the 'judged' part of the key the operator
    would keep seeing the first round's 100 RTTs and no p99 or loss fraction."""
    history: dict[str, PeerHistory] = {}
    keys = [summarize([_round(lost=0)], 1000, 0.01, history)[1] for _ in range(12)]
    changes = [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
    assert changes == [9], keys  # the 10th round: 1000 RTTs and 2000 datagrams
