"""Quantized linear weights as the checkpoint stores them, and the dequantize-then-matmul references (no Triton).

fp8_block:  data float8_e4m3fn [N, K]; scale [ceil(N/bn), ceil(K/bk)] (the checkpoint's weight_scale_inv,
            a multiplier despite its name); w[n, k] = data[n, k] * scale[n // bn, k // bk].
int4_group: data int32 [N, ceil(K/8)], eight 4-bit codes per word, code k % 8 in bits 4*(k % 8) (low first);
            scale [N, ceil(K/g)]; zero int32 [ceil(N/8), ceil(K/g)] packed the same way along N, or None
            (symmetric: zero point 8); w[n, k] = (code - zero) * scale[n, k // g].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

INT4_SYMMETRIC_ZERO = 8


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear layer's weight [out_features, in_features] in a quantized layout (see the module docstring)."""

    method: Literal["fp8_block", "int4_group"]
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    out_features: int
    in_features: int
    # fp8_block: (bn, bk); int4_group: (1, g).
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        parts = [self.data, self.scale] + ([self.zero] if self.zero is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


def unpack_int4(packed: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit codes along dim -> uint8-valued int32 codes, `length` along dim."""
    moved = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    codes = (moved.unsqueeze(-1) >> shifts) & 0xF
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] * 8)[..., :length]
    return codes.movedim(-1, dim)


def naive_dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QuantizedWeight -> dense [out_features, in_features] in dtype (computed in fp32)."""
    n, k = weight.shape
    bn, bk = weight.block
    scale = weight.scale.float()
    if weight.method == "fp8_block":
        full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return (weight.data.float() * full).to(dtype)
    codes = unpack_int4(weight.data, k, dim=1).float()
    if weight.zero is None:
        zero = torch.full_like(scale, INT4_SYMMETRIC_ZERO)
    else:
        zero = unpack_int4(weight.zero, n, dim=0).float()
    per_column = (scale.repeat_interleave(bk, dim=1)[:, :k], zero.repeat_interleave(bk, dim=1)[:, :k])
    return ((codes - per_column[1]) * per_column[0]).to(dtype)


def naive_quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized weight.T -> [M, N] in x's dtype (+ bias)."""
    out = x @ naive_dequantize(weight, x.dtype).t()
    return out + bias if bias is not None else out
