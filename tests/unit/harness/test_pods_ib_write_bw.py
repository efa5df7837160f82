"""The pods' ib_write_bw wrapper: which runs it repeats and which it fails at once."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from metaroce_harness import pods

HEADER = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
GOOD = HEADER + " 65536      502           0.070000            0.066000            0.000126\n"
UNCALIBRATED = (
    HEADER
    + " 65536      502           0.000000            0.000000            0.000000\n"
    + "Correlation coefficient r^2: 0.850709 < 0.9\n"
)
NOTHING = HEADER + " 65536      0           0.000000            0.000000            0.000000\n"


def _runner(outputs: list[tuple[int, str]]) -> tuple[pods.StartServer, pods.RunClient, list[str]]:
    """Server and client callables that play ``outputs`` in turn, and the servers started."""
    servers: list[str] = []
    replies = iter(outputs)

    def server(cmd: str) -> Callable[[], None]:
        servers.append(cmd)
        return lambda: None

    def client(cmd: str) -> tuple[int, str]:
        return next(replies)

    return server, client, servers


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pods.time, "sleep", lambda _s: None)


def test_a_run_whose_clock_was_not_calibrated_is_repeated() -> None:
    server, client, servers = _runner([(0, UNCALIBRATED), (0, GOOD)])
    bw, _ = pods.ib_write_bw(server, client, "10.0.0.2", "-D 4", None)
    assert bw == pytest.approx(0.066)
    assert len(servers) == 2


def test_a_run_that_moved_nothing_fails_at_once() -> None:
    server, client, servers = _runner([(0, NOTHING), (0, GOOD)])
    with pytest.raises(AssertionError, match="moved nothing"):
        pods.ib_write_bw(server, client, "10.0.0.2", "-D 4", None)
    assert len(servers) == 1


def test_a_clock_that_never_calibrates_fails_and_says_so() -> None:
    server, client, servers = _runner([(0, UNCALIBRATED)] * pods.CALIBRATION_RUNS)
    with pytest.raises(AssertionError, match="could not calibrate its cycle clock in 3 run"):
        pods.ib_write_bw(server, client, "10.0.0.2", "-D 4", None)
    assert len(servers) == pods.CALIBRATION_RUNS


def test_a_run_during_which_the_l2_died_is_repeated_once_it_is_revived() -> None:
    server, client, servers = _runner([(124, NOTHING), (0, GOOD)])
    revived: list[str] = []

    def revive() -> str | None:
        revived.append("poked")
        return "the guests' L2 was dead (node-1->192.168.77.12) and came back after: x"

    bw, _ = pods.ib_write_bw(server, client, "10.0.0.2", "-D 4", None, revive_l2=revive)
    assert bw == pytest.approx(0.066)
    assert len(servers) == 2 and revived == ["poked"]


def test_a_run_that_moved_nothing_over_a_live_l2_still_fails() -> None:
    server, client, servers = _runner([(0, NOTHING), (0, GOOD)])
    with pytest.raises(AssertionError, match="moved nothing"):
        pods.ib_write_bw(server, client, "10.0.0.2", "-D 4", None, revive_l2=lambda: None)
    assert len(servers) == 1


def test_a_revived_l2_gets_one_more_run_not_two() -> None:
    server, client, servers = _runner([(124, NOTHING), (124, NOTHING), (0, GOOD)])
    with pytest.raises(AssertionError, match="moved nothing"):
        pods.ib_write_bw(server, client, "10.0.0.2", "-D 4", None, revive_l2=lambda: "revived")
    assert len(servers) == 2
