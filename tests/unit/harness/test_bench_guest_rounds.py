"""bench/transport_guests.py's summary: medians, ratios to the lossless median, and the
paired ratio (each round's run over the same round's lossless run)."""

from __future__ import annotations

from bench_modules import load_bench


def test_a_drift_between_rounds_leaves_the_paired_ratio_alone() -> None:
    bench = load_bench("transport_guests")
    lossless, lossy = bench.new_level(0.0, 1.0), bench.new_level(1.0, 1.0)
    # The guests run at twice the speed in the last round; each round's 1% run is 0.9
    # of its own lossless run.
    lossless["arms"]["metaroce"]["gbps"] = [0.10, 0.10, 0.20]
    lossy["arms"]["metaroce"]["gbps"] = [0.09, 0.09, 0.18]
    lossless["arms"]["rxe"]["gbps"] = [0.5, 0.5, 0.5]
    lossy["arms"]["rxe"]["gbps"] = [0.0, 0.1, 0.05]
    bench.summarize([lossless, lossy])
    m = lossy["arms"]["metaroce"]
    assert m["median_gbps"] == 0.09
    assert abs(m["ratio_to_lossless"] - 0.9) < 1e-9
    assert [round(x, 6) for x in m["paired_ratios"]] == [0.9, 0.9, 0.9]
    assert abs(m["paired_ratio"] - 0.9) < 1e-9
    assert abs(lossy["arms"]["rxe"]["paired_ratio"] - 0.1) < 1e-9
    assert lossless["arms"]["metaroce"]["paired_ratio"] == 1.0


def test_a_failed_run_leaves_its_round_out_of_the_pairs() -> None:
    bench = load_bench("transport_guests")
    assert bench.paired_ratios([0.05, None, 0.1], [0.1, 0.1, None]) == [0.5]
    assert bench.paired_ratios([0.09], [0.0]) == []
