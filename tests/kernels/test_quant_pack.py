"""The INT4 packing is compressed-tensors' pack-quantized layout, bit for bit; FP8 blocks follow their definition."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from headroom.kernels.quant_pack import pack_int4, quantize_fp8_block
from headroom.kernels.quant_weight import unpack_int4


@pytest.mark.parametrize(("rows", "cols", "dim"), [(5, 24, 1), (3, 37, 1), (13, 6, 0), (16, 3, 0)])
def test_pack_int4_is_compressed_tensors_layout(rows, cols, dim):
    signed = torch.randint(-8, 8, (rows, cols), generator=torch.Generator().manual_seed(rows * cols), dtype=torch.int8)
    theirs = pack_to_int32(signed, 4, packed_dim=dim)
    ours = pack_int4(signed.to(torch.int32) + 8, dim=dim)
    assert ours.dtype == torch.int32 and torch.equal(ours, theirs)
    length = signed.shape[dim]
    assert torch.equal(unpack_int4(theirs, length, dim) - 8, signed.to(torch.int32))
    assert torch.equal(unpack_from_int32(ours, 4, signed.shape, packed_dim=dim), signed)


def test_fp8_block_scales_follow_the_definition():
    """scale_inv[i, j] = amax of block (i, j) / 448, and data * scale_inv reproduces w within fp8 rounding."""
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(1))
    data, scale = quantize_fp8_block(w, (16, 32))
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    assert torch.isclose(scale[2, 1], w[32:40, 32:64].abs().max() / 448)
    full = scale.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :70]
    restored = data.float() * full
    # e4m3 rounds to 3 mantissa bits (relative error <= 2^-4); below 2^-6 it is subnormal, steps of 2^-9.
    assert ((restored - w).abs() <= w.abs() / 16 + full * 2**-10 + 1e-7).all()
