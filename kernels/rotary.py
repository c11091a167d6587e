"""Rotary position embedding (neox half-rotation), optionally on the first rotary_dim channels only."""

from __future__ import annotations

import torch


def rotary_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def naive_apply_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], positions [T] (int), inv_freq [R/2] -> [T, H, D]; channels past R pass through."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    rotary_dim = emb.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def naive_qk_norm_rotary_store(q, k, v, wq, wk, eps: float, unit_offset: bool, positions, inv_freq, pool_k, pool_v,
                               rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for rotary_triton.qk_norm_rotary_store: q and k through naive_rms_norm_rotary, k and v into the
    pool's rows."""
    q_out = naive_rms_norm_rotary(q, wq, eps, unit_offset, positions, inv_freq)
    k_out = naive_rms_norm_rotary(k, wk, eps, unit_offset, positions, inv_freq)
    pool_k[rows.long()], pool_v[rows.long()] = k_out.to(pool_k.dtype), v.to(pool_v.dtype)
    return q_out, k_out


def naive_rms_norm_rotary(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Per-head q/k RMSNorm, then rotary: x [T, H, D] (any strides), weight [D] -> [T, H, D] contiguous."""
    from headroom.kernels.norm import naive_rms_norm

    return naive_apply_rotary(naive_rms_norm(x, weight, eps, unit_offset), positions, inv_freq)
