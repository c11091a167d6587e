"""Quantize-on-write and dequantize-on-read for the KV pool's formats.

fp8: e4m3 with one fp32 scale per token per head (scale = amax / 448).
KIVI (int8/int4/int2), one page of P tokens at a time: keys per channel over the page's tokens,
values per token over groups of `value_group` channels; asymmetric, fp16 scale and zero point.
Codes are packed along the token axis of a page (P * bits / 8 bytes per channel), so any head_dim packs.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def naive_fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (codes [T, H, D] float8_e4m3fn, scale [T, H] fp32)."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    codes = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def naive_fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [T, H, D], scale [T, H] -> [T, H, D] in dtype."""
    return (codes.float() * scale[..., None]).to(dtype)


def _asymmetric(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantization along dim; scale and zero rounded to fp16 before use so read == write."""
    levels = 2**bits - 1
    low = x.amin(dim=dim, keepdim=True)
    high = x.amax(dim=dim, keepdim=True)
    scale = ((high - low) / levels).clamp(min=1e-6).to(torch.float16)
    zero = low.to(torch.float16)
    codes = torch.round((x - zero.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return codes, scale, zero


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [P, ...] uint8 < 2**bits -> [P * bits / 8, ...]; token i sits in byte i // (8/bits)."""
    per_byte = 8 // bits
    grouped = codes.reshape(codes.shape[0] // per_byte, per_byte, *codes.shape[1:]).to(torch.int32)
    packed = torch.zeros_like(grouped[:, 0])
    for i in range(per_byte):
        packed |= grouped[:, i] << (bits * i)
    return packed.to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: [P * bits / 8, ...] -> [P, ...] uint8."""
    per_byte = 8 // bits
    mask = 2**bits - 1
    as_int = packed.to(torch.int32)
    parts = [(as_int >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=1).reshape(packed.shape[0] * per_byte, *packed.shape[1:]).to(torch.uint8)


def naive_kivi_quantize_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One page k [P, H, D] -> (packed [P*bits/8, H, D] uint8, scale [H, D] fp16, zero [H, D] fp16)."""
    codes, scale, zero = _asymmetric(k.float(), 0, bits)
    return pack_codes(codes, bits), scale[0], zero[0]


def naive_kivi_dequantize_keys(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of naive_kivi_quantize_keys -> [P, H, D] in dtype."""
    codes = unpack_codes(packed, bits).float()
    return (codes * scale.float()[None] + zero.float()[None]).to(dtype)


def _channel_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """[P, H, D] -> [P, H, G, group], padding the last group by repeating its last channel (no effect on min/max)."""
    head_dim = x.shape[-1]
    num_groups = -(-head_dim // group)
    pad = num_groups * group - head_dim
    if pad:
        x = torch.cat((x, x[..., -1:].expand(*x.shape[:-1], pad)), dim=-1)
    return x.reshape(*x.shape[:-1], num_groups, group)


def naive_kivi_quantize_values(
    v: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One page v [P, H, D] -> (packed [P*bits/8, H, D] uint8, scale [P, H, G] fp16, zero [P, H, G] fp16)."""
    head_dim = v.shape[-1]
    codes, scale, zero = _asymmetric(_channel_groups(v.float(), group), 3, bits)
    codes = codes.reshape(*codes.shape[:2], -1)[..., :head_dim]
    return pack_codes(codes.contiguous(), bits), scale[..., 0], zero[..., 0]


def naive_kivi_dequantize_values(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of naive_kivi_quantize_values -> [P, H, D] in dtype."""
    codes = unpack_codes(packed, bits).float()
    head_dim = codes.shape[-1]
    expanded_scale = scale.float().repeat_interleave(group, dim=-1)[..., :head_dim]
    expanded_zero = zero.float().repeat_interleave(group, dim=-1)[..., :head_dim]
    return (codes * expanded_scale + expanded_zero).to(dtype)
