"""Depthwise causal conv1d with a carried state (the short conv in front of Gated DeltaNet)."""

from __future__ import annotations

import torch
from headroom.kernels.norm import naive_l2_norm


def naive_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x [T, C], weight [C, K], state [C, K-1] (the K-1 inputs before x, zeros at start).

    Returns (silu(conv(x)) [T, C], new state [C, K-1] = the last K-1 inputs), both in x's dtype.
    """
    num_tokens = x.shape[0]
    kernel = weight.shape[1]
    window = torch.cat((state.to(x.dtype), x.transpose(0, 1)), dim=1)
    out = torch.nn.functional.conv1d(window[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]
    out = torch.nn.functional.silu(out[:, -num_tokens:]).transpose(0, 1)
    new_state = window[:, window.shape[1] - (kernel - 1) :]
    return out.contiguous(), new_state.contiguous()


def naive_causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reference: naive_causal_conv1d per sequence, state written back to its slot."""
    out = torch.empty_like(x)
    for b, slot in enumerate(slots.tolist()):
        out[b : b + 1], new_state = naive_causal_conv1d(x[b : b + 1], weight, states[slot])
        states[slot] = new_state
    return out


def naive_causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Reference for kernels/conv_varlen.py: naive_causal_conv1d per sequence (sequence b: the next lengths[b]
    rows of x), its state read from and written back to states[slots[b]]."""
    out = torch.empty_like(x)
    start = 0
    for slot, length in zip(slots.tolist(), lengths, strict=True):
        rows = slice(start, start + length)
        out[rows], new_state = naive_causal_conv1d(x[rows], weight, states[slot])
        states[slot] = new_state
        start += length
    return out


def naive_causal_conv1d_varlen_qkv(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, lengths: list[int],
    key_dim: int, norm_dim: int = 0, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for kernels/conv_varlen.py's causal_conv1d_varlen_qkv: the conv's output cut into q, k (key_dim
    channels each) and v, each contiguous; norm_dim > 0: q and k L2-normed per norm_dim-channel head."""
    out = naive_causal_conv1d_varlen(x, weight, states, slots, lengths)
    q, k, v = (part.contiguous() for part in out.split([key_dim, key_dim, x.shape[1] - 2 * key_dim], dim=1))
    if norm_dim:
        q, k = (naive_l2_norm(t.view(t.shape[0], -1, norm_dim), eps).view(t.shape) for t in (q, k))
    return q, k, v
