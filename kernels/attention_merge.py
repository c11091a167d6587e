"""Merging attention computed over disjoint key ranges, by their log-sum-exp (flash-decoding's reduction).

Used to join the paged pool prefix with a KIVI residual window, and the key splits of one decode step.
"""

from __future__ import annotations

import torch
from headroom.kernels.attention import naive_prefix_attention


def merge_attention_states(
    outputs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """outputs [S, N, H, D] (each normalised over its own keys), lses [S, N, H] fp32 natural log (-inf: no key).

    Returns (out [N, H, D] in dtype, lse [N, H] fp32): attention over the union of the S key ranges;
    a row that saw no key in any range gets out 0 and lse -inf.
    """
    top = lses.amax(dim=0)
    # Rows with no key anywhere: shift by 0 so every weight is exp(-inf) = 0 rather than NaN.
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - shift[None])
    total = weights.sum(dim=0)
    merged = (outputs.float() * weights[..., None]).sum(dim=0) / total.clamp(min=1e-30)[..., None]
    lse = torch.where(total > 0, shift + torch.log(total), torch.full_like(top, float("-inf")))
    return merged.to(dtype), lse


def merge_two(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ranges: out [N, H, D], lse [N, H] each -> merged (out in out_a's dtype, lse)."""
    return merge_attention_states(torch.stack((out_a.float(), out_b.float())), torch.stack((lse_a, lse_b)), out_a.dtype)


def naive_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_positions: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D]; k, v [N, Hkv, D]; a query at rel_positions[t] sees keys 0..rel_positions[t] (none if < 0).

    Returns (out [T, Hq, D] in q's dtype via naive_prefix_attention, lse [T, Hq] fp32; 0 and -inf for rows with no key).
    """
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    sees = rel_positions >= 0
    if k.shape[0] == 0 or not bool(sees.any()):
        return out, lse
    group = q.shape[1] // k.shape[1]
    q_seen, pos_seen = q[sees], rel_positions[sees]
    out[sees] = naive_prefix_attention(q_seen, k, v, pos_seen, scale)
    keys = k.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,nhd->thn", q_seen.float(), keys) * scale
    hidden = torch.arange(k.shape[0], device=q.device)[None, :] > pos_seen[:, None]
    lse[sees] = torch.logsumexp(scores.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
    return out, lse
