"""RMSNorm variants: plain (w * x), unit-offset ((1 + w) * x, Qwen3.5/Qwen3-Next) and gated (GDN output); the
L2 norm of Gated DeltaNet's q and k."""

from __future__ import annotations

import torch


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype; statistics in fp32.

    unit_offset=True scales by (1 + weight) computed in fp32 before the cast back (Qwen3.5 order);
    False casts the normalised x back first and then scales by weight (Qwen3 order).
    """
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def naive_l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x / sqrt(sum(x^2) + eps) in x's dtype, statistics in fp32 (fla's q/k norm: eps inside)."""
    return (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def naive_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm-before-gate: weight * rmsnorm(x) * silu(gate). x, gate [..., D], weight [D]."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out * torch.nn.functional.silu(gate.float())).to(x.dtype)


def naive_add_rms_norm(
    delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's residual step: s = residual + delta (rounded to the model dtype), then rms_norm(s).
    delta, residual [N, D] -> (normed [N, D], s [N, D])."""
    summed = residual + delta
    return naive_rms_norm(summed, weight, eps, unit_offset), summed
