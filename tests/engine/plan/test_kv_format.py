"""Bytes per KV token and per SSM slot, checked by hand for a known shape."""

from __future__ import annotations

import pytest
from headroom.engine.plan import geometry_from_config, kv_bytes_per_token, ssm_slot_bytes
from headroom.engine.plan.presets import preset_config


@pytest.fixture
def qwen27b():
    return geometry_from_config(preset_config("qwen3.5-27b")[0])


def test_bf16_is_two_bytes_per_element_of_full_attention_layers_only(qwen27b):
    # 16 full-attention layers x K,V x 4 heads x 256 dims x 2 bytes
    assert kv_bytes_per_token(qwen27b, "bf16") == 16 * 2 * 4 * 256 * 2


def test_tensor_parallel_splits_kv_heads(qwen27b):
    assert kv_bytes_per_token(qwen27b, "bf16", tp=2) == kv_bytes_per_token(qwen27b, "bf16") // 2
    # more ranks than KV heads: heads are replicated, not split below one
    assert kv_bytes_per_token(qwen27b, "bf16", tp=8) == kv_bytes_per_token(qwen27b, "bf16") // 4


def test_kivi_scales_are_counted(qwen27b):
    data = 16 * 4 * 2 * 256 * 2 // 8
    # keys: 256 channels x 4 bytes per 32 tokens; values: 8 groups x 4 bytes; per head per layer
    scales = 16 * 4 * (256 * 4 // 32 + 8 * 4)
    assert kv_bytes_per_token(qwen27b, "int2") == data + scales
    assert kv_bytes_per_token(qwen27b, "int2") < kv_bytes_per_token(qwen27b, "int4") < kv_bytes_per_token(
        qwen27b, "int8"
    )


def test_fp8_has_a_scale_per_token_and_head(qwen27b):
    assert kv_bytes_per_token(qwen27b, "fp8") == 16 * 4 * (2 * 256 + 8)


def test_ssm_slot_matches_the_seed_measurement(qwen27b):
    # Seed 004: an fp16 mamba slot of the 27B hybrid on TP2 is about 38 MB.
    assert 36e6 < ssm_slot_bytes(qwen27b, tp=2, ssm_dtype="fp16") < 40e6
    assert ssm_slot_bytes(qwen27b, ssm_dtype="fp32") > ssm_slot_bytes(qwen27b, ssm_dtype="bf16")


def test_unknown_dtypes_are_named(qwen27b):
    with pytest.raises(ValueError, match="kv dtype 'int3'"):
        kv_bytes_per_token(qwen27b, "int3")
    with pytest.raises(ValueError, match="ssm dtype 'fp8'"):
        ssm_slot_bytes(qwen27b, ssm_dtype="fp8")
