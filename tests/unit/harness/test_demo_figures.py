"""The demo's figures: the ratio of medians and the paired ratio (each lossy run over
the lossless run just before it), with the least and greatest pair beside it."""

from __future__ import annotations

from metaroce_harness.demo import LOSS_PERCENT, METAROCE, Figures


def test_the_paired_ratio_follows_each_pair_through_a_drift() -> None:
    f = Figures(METAROCE)
    # The guests are twice as fast in the last pair; each lossy run is 0.9 of its own
    # lossless run, save one pair at 0.5.
    for lossless, lossy in ((0.10, 0.09), (0.10, 0.05), (0.20, 0.18)):
        f.add(0.0, lossless, 0)
        f.add(LOSS_PERCENT, lossy, 3)
    assert abs(f.paired_ratio() - 0.9) < 1e-9
    assert abs(f.ratio() - 0.9) < 1e-9
    assert f.paired_column() == "0.90 (0.50-0.90)"


def test_one_pair_has_no_spread_to_show() -> None:
    f = Figures(METAROCE)
    f.add(0.0, 0.10, 0)
    f.add(LOSS_PERCENT, 0.08, 2)
    assert f.paired_column() == "0.80"


def test_a_lossless_run_that_moved_nothing_is_left_out_of_the_pairs() -> None:
    f = Figures(METAROCE)
    f.add(0.0, 0.0, 0)
    f.add(LOSS_PERCENT, 0.05, 1)
    assert f.paired_ratio() == 0.0
    f.add(0.0, 0.1, 0)
    f.add(LOSS_PERCENT, 0.08, 1)
    assert abs(f.paired_ratio() - 0.8) < 1e-9
