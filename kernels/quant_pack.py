"""Dense weight -> the checkpoint layouts of kernels/quant_weight.py (no Triton): block-wise FP8 as the model
makers publish it, and group-wise INT4 in compressed-tensors' pack-quantized layout. Used to write test and
bench checkpoints; loading never quantizes."""

from __future__ import annotations

import torch
from headroom.kernels.quant_weight import INT4_SYMMETRIC_ZERO

FP8_MAX = 448.0


def _pad_to(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]): one amax/448 scale a block."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    blocks = _pad_to(w.float(), gn * bn, gk * bk).view(gn, bn, gk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    data = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data, scale


def pack_int4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Codes 0..15 (any int dtype) -> int32 words of eight along dim (code i in bits 4i), dim padded to 8."""
    moved = codes.movedim(dim, -1).to(torch.int32)
    pad = -moved.shape[-1] % 8
    moved = torch.nn.functional.pad(moved, (0, pad)).reshape(*moved.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    # The eighth code's top bit is the sign bit: sum in int64, then wrap into int32.
    words = (moved.long() << shifts.long()).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def quantize_int4_group(
    w: torch.Tensor, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K] -> (packed int32 [N, ceil(K/8)], scale [N, ceil(K/g)] in w's dtype, zero int32
    [ceil(N/8), ceil(K/g)] or None). Min-max scales; codes are signed int4 plus 8, as compressed-tensors stores."""
    n, k = w.shape
    groups = -(-k // group)
    padded = _pad_to(w.float(), n, groups * group).view(n, groups, group)
    if symmetric:
        scale = (padded.abs().amax(-1) / 7.5).clamp(min=1e-12)
        zero = torch.zeros_like(scale)
    else:
        low, high = padded.amin(-1).clamp(max=0), padded.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-12)
        zero = (-8 - torch.round(low / scale)).clamp(-8, 7)
    # Round the scale to the stored dtype first, so that the codes are computed against the stored scale.
    scale = scale.to(w.dtype).float()
    q = (torch.round(padded / scale[..., None]) + zero[..., None]).clamp(-8, 7)
    codes = (q + INT4_SYMMETRIC_ZERO).view(n, groups * group)[:, :k]
    packed_zero = None if symmetric else pack_int4(zero + INT4_SYMMETRIC_ZERO, dim=0)
    return pack_int4(codes, dim=1), scale.to(w.dtype), packed_zero
