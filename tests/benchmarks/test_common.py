"""benchmarks.common's paired ratios: per-round ratios cancel a drift of machine speed between rounds."""

import pytest

from benchmarks import common


def test_paired_ratio_cancels_drift_between_rounds():
    # The machine slows down 2x per round; within each round `a` takes 1/3 of `b`'s time.
    a = [1.0, 2.0, 4.0, 8.0, 16.0]
    b = [3.0, 6.0, 12.0, 24.0, 48.0]
    assert common.paired_ratio(a, b) == (3.0, 3.0, 3.0)


def test_paired_ratio_reports_the_spread():
    median, low, high = common.paired_ratio([1.0, 1.0, 1.0], [1.2, 1.5, 0.9])
    assert (median, low, high) == pytest.approx((1.2, 0.9, 1.5))
    assert common.ratio_text((median, low, high)) == "1.20 (0.90-1.50 over rounds)"


def test_paired_ratio_needs_paired_rounds():
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        common.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        common.paired_ratio([], [])
