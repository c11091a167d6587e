"""KV quantization references: packing is lossless, errors stay within half a quantization step."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels import ops
from headroom.kernels.kv_quant import pack_codes, unpack_codes


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [5, 32, 40])
def test_pack_unpack_round_trip(bits, dim):
    codes = torch.randint(0, 2**bits, (32, 3, dim), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (32 * bits // 8, 3, dim)
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [12, 64, 70])
def test_kivi_error_is_at_most_half_a_step(bits, dim):
    k, v = torch.randn(32, 2, dim) * 3, torch.randn(32, 2, dim)
    packed, scale, zero = ops.kivi_quantize_keys(k, bits)
    assert scale.shape == (2, dim) and scale.dtype == torch.float16
    k_back = ops.kivi_dequantize_keys(packed, scale, zero, bits, torch.float32)
    key_step = scale.float()[None]
    # Half a step, plus fp16 rounding of the zero point.
    assert ((k_back - k).abs() <= key_step / 2 + 1e-2 * k.abs().amax()).all()
    packed_v, v_scale, v_zero = ops.kivi_quantize_values(v, bits, 32)
    assert v_scale.shape == (32, 2, -(-dim // 32))
    v_back = ops.kivi_dequantize_values(packed_v, v_scale, v_zero, bits, 32, torch.float32)
    value_step = v_scale.float().repeat_interleave(32, -1)[..., :dim]
    assert ((v_back - v).abs() <= value_step / 2 + 1e-2 * v.abs().amax()).all()


def test_fp8_relative_error():
    x = torch.randn(9, 3, 20) * 10
    codes, scale = ops.fp8_quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (9, 3)
    back = ops.fp8_dequantize(codes, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 1/16 of each value's magnitude (plus subnormal floor).
    assert ((back - x).abs() <= x.abs() / 16 + scale[..., None] * 2**-9).all()


def test_constant_group_does_not_divide_by_zero():
    k = torch.full((32, 1, 8), 0.5)
    packed, scale, zero = ops.kivi_quantize_keys(k, 2)
    back = ops.kivi_dequantize_keys(packed, scale, zero, 2, torch.float32)
    assert torch.isfinite(back).all() and (back - k).abs().max() < 1e-3
