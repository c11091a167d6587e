"""KV and SSM pools allocate exactly the planner's bytes; quantized storage reads back what was written."""

from __future__ import annotations

import pytest
import torch
from headroom.engine.config import EngineConfig
from headroom.engine.plan.geometry import load_geometry
from headroom.engine.plan.kv_format import kv_bytes_per_token, ssm_slot_bytes
from headroom.engine.runtime.kv_pool import KVPool
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.sequence import Sequence


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int8", "int4", "int2"])
def test_pool_bytes_equal_the_planner_ledger(tiny_model_factory, kv_dtype):
    # qwen3_5 config 2: head_dim 32 (a multiple of 8, as real models), 2 full-attention layers.
    model_dir, _ = tiny_model_factory("qwen3_5", 2)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), kv_dtype=kv_dtype, max_total_tokens=96, ssm_slots=5,
                                      max_running_requests=5))
    geometry = load_geometry(model_dir)
    assert runner.kv_pool.nbytes() == kv_bytes_per_token(geometry, kv_dtype) * 96
    assert runner.ssm_pool is not None
    assert runner.ssm_pool.nbytes() == ssm_slot_bytes(geometry) * 5


@pytest.mark.parametrize("kv_dtype", ["int8", "int2"])
def test_kivi_residual_windows_are_the_planner_line(tiny_model_factory, kv_dtype):
    """One open page per running request and full-attention layer, K and V: the plan's kv_residual_window,
    twice over for the fp32 test checkpoint (the plan prices the 2-byte model dtype)."""
    from headroom.engine.plan.engines.base import Layout
    from headroom.engine.plan.engines.builtin import BuiltinEngine

    model_dir, _ = tiny_model_factory("qwen3_5", 2)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), kv_dtype=kv_dtype, max_total_tokens=96, ssm_slots=5,
                                      max_running_requests=5))
    line = BuiltinEngine().static_extras(load_geometry(model_dir), Layout(32, 96, 5, kv_dtype, 1, "fp32"))
    assert runner.kv_pool.residual_nbytes() == 2 * line["kv_residual_window"] > 0


def test_auto_kv_stores_the_model_dtype(tiny_model_factory):
    """fp32 checkpoints (CPU tests): `auto` stores fp32, twice the planner's bf16 figure."""
    model_dir, _ = tiny_model_factory("qwen3", 0)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=40))
    geometry = load_geometry(model_dir)
    assert runner.kv_pool.nbytes() == 2 * kv_bytes_per_token(geometry, "bf16") * 40


@pytest.mark.parametrize(("kv_dtype", "tolerance"), [("bf16", 0.01), ("fp8", 0.07), ("int8", 0.01), ("int4", 0.15), ("int2", 0.7)])
def test_store_then_context_round_trips(kv_dtype, tolerance):
    pool = KVPool(128, 2, 3, 40, kv_dtype, torch.float32, torch.device("cpu"))
    seq = Sequence("r", list(range(70)))
    seq.kv_slots = list(range(32, 128))
    k, v = torch.randn(70, 3, 40), torch.randn(70, 3, 40)
    # Odd chunks across page boundaries: the residual window carries the open page.
    for start, end in ((0, 5), (5, 40), (40, 41), (41, 70)):
        pool.store(1, seq, start, k[start:end], v[start:end])
    got_k, got_v = pool.context(1, seq, 70)
    assert got_k.shape == (70, 3, 40)
    assert (got_k - k).abs().max() < tolerance * 4 and (got_v - v).abs().max() < tolerance * 4
    if pool.is_kivi:
        # The open page (64..69) is still full precision.
        assert torch.equal(got_k[64:], k[64:]) and torch.equal(got_v[64:], v[64:])


def test_kivi_pool_needs_whole_pages():
    with pytest.raises(ValueError, match="not a multiple of the int4 page of 32"):
        KVPool(100, 1, 1, 32, "int4", torch.float32, torch.device("cpu"))
