"""A guest whose clock is wrong is booted again (``clock_is_wrong``)."""

from metaroce_harness.guests import clock_is_wrong


def test_a_guest_up_about_as_long_as_the_host_waited_has_a_sane_clock() -> None:
    assert clock_is_wrong(4.6, 4.9) is None  # an idle host: qemu's start-up is the gap
    assert clock_is_wrong(10.5, 12.2) is None  # both cores busy
    assert clock_is_wrong(5.3, 4.9) is None  # within the reading points' margin
    assert clock_is_wrong(30.0, 60.0) is None  # a slow start on a busy host


def test_a_guest_up_longer_than_the_host_waited_runs_fast() -> None:
    # the boot of 2026-12-05: 92.8 s of guest uptime after 5.1 s on the host
    why = clock_is_wrong(92.8, 5.1)
    assert why is not None
    assert "fast, 18.20x" in why and "92.8 s" in why and "5.1 s" in why
    assert clock_is_wrong(7.0, 5.0) is not None


def test_a_guest_that_booted_in_a_fraction_of_the_hosts_wait_runs_slow() -> None:
    why = clock_is_wrong(0.3, 5.1)
    assert why is not None and "slow" in why
    assert clock_is_wrong(8.0, 60.0) is not None
