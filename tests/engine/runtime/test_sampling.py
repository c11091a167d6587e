"""Sampling never raises on values the API admits: any integer seed, any temperature > 0, any top_p in (0, 1]."""

from __future__ import annotations

import pytest
import torch
from headroom.engine.runtime.sampling import sample, sample_one
from headroom.engine.sequence import SamplingParams, Sequence


def _seq(**sampling) -> Sequence:
    return Sequence("r", [1, 2], SamplingParams(**sampling))


@pytest.mark.parametrize("seed", [1_700_000_000_000_000_000, 2**64, 2**200, -1, -(2**70)])
def test_any_integer_seed_samples_reproducibly(seed):
    logits = torch.randn(37, generator=torch.Generator().manual_seed(0))
    first = sample_one(logits, _seq(temperature=1.0, seed=seed))
    assert 0 <= first < 37
    assert sample_one(logits, _seq(temperature=1.0, seed=seed)) == first


@pytest.mark.parametrize("sampling", [dict(temperature=5e-324), dict(temperature=1e-45), dict(temperature=1e-8),
                                      dict(temperature=1.0, top_p=1e-300), dict(temperature=2.0, top_p=1e-45)])
def test_extreme_temperature_or_top_p_picks_the_argmax(sampling):
    logits = torch.randn(41, generator=torch.Generator().manual_seed(1)) * 30
    assert sample_one(logits, _seq(seed=3, **sampling)) == int(torch.argmax(logits))


def test_mixed_rows_sample_each():
    logits = torch.randn(2, 19, generator=torch.Generator().manual_seed(2))
    tokens = sample(logits, [_seq(temperature=0.0), _seq(temperature=1.0, seed=2**90)])
    assert tokens[0] == int(torch.argmax(logits[0]))
    assert 0 <= tokens[1] < 19
