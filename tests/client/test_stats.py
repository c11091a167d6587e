import pytest
from headroom.client.stats import percentile, ratio, summarize_ms


def test_percentile_interpolates_between_ranks():
    samples = [4.0, 1.0, 3.0, 2.0]
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 100) == 4.0
    assert percentile(samples, 50) == pytest.approx(2.5)
    assert percentile(samples, 95) == pytest.approx(3.85)


def test_percentile_of_nothing_is_none_not_zero():
    assert percentile([], 95) is None
    assert summarize_ms([])["p95_ms"] is None


def test_percentile_rejects_out_of_range_q():
    with pytest.raises(ValueError, match="101"):
        percentile([1.0], 101)


def test_summary_in_milliseconds():
    summary = summarize_ms([0.010, 0.020, 0.030])
    assert summary == {"count": 3, "p50_ms": 20.0, "p95_ms": 29.0, "max_ms": 30.0, "mean_ms": 20.0}


def test_ratio_of_zero_denominator_is_none():
    assert ratio(3, 0) is None
    assert ratio(1, 4) == 0.25
