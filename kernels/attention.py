"""Causal attention of a chunk of queries over a sequence's whole (dequantized) key/value prefix."""

from __future__ import annotations

import torch


def naive_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, Hq, D]; k, v [N, Hkv, D] for positions 0..N-1; q_positions [T] absolute positions.

    Query at position p sees keys 0..p. Hq must be a multiple of Hkv (grouped-query attention).
    Returns [T, Hq, D] in q's dtype; softmax in fp32.
    """
    group = q.shape[1] // k.shape[1]
    keys = k.to(q.dtype).repeat_interleave(group, dim=1)
    values = v.to(q.dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,nhd->htn", q, keys) * scale
    key_positions = torch.arange(k.shape[0], device=q.device)
    hidden = key_positions[None, :] > q_positions[:, None]
    scores = scores.masked_fill(hidden[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("htn,nhd->thd", probs, values)
