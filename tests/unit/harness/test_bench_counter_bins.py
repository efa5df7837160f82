"""bench/transport_scenarios.py's counter_bins: 10 ms bins from a sampled counter."""

from __future__ import annotations

from bench_modules import load_bench


def test_a_steady_counter_gives_even_bins_however_late_the_samples() -> None:
    bins_of = load_bench("transport_scenarios").counter_bins
    rate = 100_000_000 / 8  # bytes per second: 100 Mbit/s
    times = [10.0 + i * 0.0005 for i in range(200)]  # every 0.5 ms for 100 ms ...
    times[50:70] = [times[49] + 0.012]  # ... but one sample 12 ms late
    times = sorted(set(times))
    samples = [[t, int((t - 10.0) * rate)] for t in times]
    bins = bins_of(samples, 10.0, 10)
    assert len(bins) >= 9
    for b in bins[:9]:
        assert abs(b - 100.0) < 0.5, bins


def test_samples_before_the_start_are_left_out() -> None:
    bins_of = load_bench("transport_scenarios").counter_bins
    samples = [[9.99, 0], [10.0, 0], [10.01, 125_000], [10.02, 250_000]]
    assert bins_of(samples, 10.0, 10) == [100.0, 100.0]


def test_recovery_allows_a_dip_in_the_first_100_ms_and_counts_one_after() -> None:
    recovery = load_bench("transport_scenarios").recovery
    steady = [100.0] * 100 + [80.0] * 100  # the cut at bin 100: 3 links carry 0.8
    early = steady.copy()
    early[103:106] = [40.0, 50.0, 60.0]  # the dark link's packets found lost and resent
    r = recovery(early, 100, 100.0)
    assert r["back_after_ms"] == 60 and r["held"] and r["dip_min"] == 0.4
    late = steady.copy()
    late[130] = 60.0  # 300 ms after the cut: inside the 500 ms that must hold
    r = recovery(late, 100, 100.0)
    assert not r["held"] and r["hold_bins_below_0.7"] == 1 / 50 and r["back_after_ms"] == 310


def test_held_counts_per_series_with_the_failing_runs_lowest_bins() -> None:
    held_counts = load_bench("transport_scenarios").held_counts
    runs = [
        {"held": False, "hold_min": 0.62, "arrived": {"held": True, "hold_min": 0.73}},
        {"held": True, "hold_min": 0.71, "arrived": {"held": False, "hold_min": 0.698}},
        {"held": False, "hold_min": 0.55},  # a run from before arrival bins existed
    ]
    assert held_counts(runs) == {
        "acknowledged": (1, 3, [0.55, 0.62]),
        "arrived": (1, 2, [0.698]),
    }
