"""The warm-up's pass-cost fit (server/factory.py): the first full chunk compiles the kernels and must not set
the prefill rate, or the pass-time bound cuts every later chunk (seen on a cold H200)."""

from __future__ import annotations

import pytest
from headroom.engine.loop.step import StepStats
from headroom.engine.server.factory import fit_cost_model


def test_the_compiling_pass_does_not_set_the_rate():
    timings = [StepStats(seconds=9.5, num_prefill_tokens=8192, num_decodes=1),  # compiles
               StepStats(seconds=0.284, num_prefill_tokens=8192, num_decodes=1),
               StepStats(seconds=0.02, num_prefill_tokens=1, num_decodes=1),
               StepStats(seconds=0.006, num_prefill_tokens=0, num_decodes=1),
               StepStats(seconds=0.004, num_prefill_tokens=0, num_decodes=1)]
    model = fit_cost_model(timings)
    assert model.fixed_s == pytest.approx(0.004)
    assert model.prefill_tokens_per_s == pytest.approx(8192 / 0.28)
    # An 8,192-token pass fits a 1 s bound: the bound does not bind on this GPU.
    assert model.prefill_tokens_within(1.0, 0) >= 8192


def test_small_passes_do_not_set_the_rate():
    """A 1-token pass's overhead is not a rate: only passes of at least half the biggest one's tokens count."""
    timings = [StepStats(seconds=0.5, num_prefill_tokens=4096, num_decodes=0),
               StepStats(seconds=0.0041, num_prefill_tokens=1, num_decodes=1),
               StepStats(seconds=0.004, num_prefill_tokens=0, num_decodes=1)]
    assert fit_cost_model(timings).prefill_tokens_per_s == pytest.approx(4096 / 0.496)
