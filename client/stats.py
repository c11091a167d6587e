"""Percentiles and distribution summaries of latency samples (seconds in, milliseconds out)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks.

    Returns None for an empty sample: a missing figure must not read as zero latency.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    if not samples:
        return None
    ordered = sorted(samples)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    fraction = rank - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


def summarize_ms(samples_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50 / p95 / max / mean of samples given in seconds, reported in milliseconds, plus the count."""
    to_ms = _scaled(1000.0)
    return {
        "count": len(samples_s),
        "p50_ms": to_ms(percentile(samples_s, 50)),
        "p95_ms": to_ms(percentile(samples_s, 95)),
        "max_ms": to_ms(max(samples_s) if samples_s else None),
        "mean_ms": to_ms(sum(samples_s) / len(samples_s) if samples_s else None),
    }


def _scaled(factor: float):
    def scale(value: float | None) -> float | None:
        return None if value is None else round(value * factor, 3)

    return scale


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is zero (nothing was measured)."""
    return None if denominator == 0 else numerator / denominator
