"""Decode step of the short causal conv1d for many sequences at once, state updated in place in the SSM pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def causal_conv1d_update_fwd_kernel(
    x, weight, states, slots, out, stride_xb, stride_wc, stride_ss, stride_sc, stride_ob,
    CHANNELS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_k = tl.arange(0, BLOCK_K)
    m_c = o_c < CHANNELS
    i_slot = tl.load(slots + i_b).to(tl.int64)
    b_x = tl.load(x + i_b * stride_xb + o_c, mask=m_c, other=0).to(tl.float32)
    p_state = states + i_slot * stride_ss + o_c[:, None] * stride_sc
    # Window column j < K-1 is the j-th carried input, column K-1 the new token.
    m_old = m_c[:, None] & (o_k < KERNEL - 1)[None, :]
    b_window = tl.load(p_state + o_k[None, :], mask=m_old, other=0).to(tl.float32)
    b_window = tl.where((o_k == KERNEL - 1)[None, :], b_x[:, None], b_window)
    m_w = m_c[:, None] & (o_k < KERNEL)[None, :]
    b_w = tl.load(weight + o_c[:, None] * stride_wc + o_k[None, :], mask=m_w, other=0).to(tl.float32)
    b_acc = tl.sum(b_window * b_w, 1)
    b_out = b_acc / (1.0 + tl.exp(-b_acc))
    tl.store(out + i_b * stride_ob + o_c, b_out.to(out.dtype.element_ty), mask=m_c)
    # New state: the window shifted left by one (the oldest input drops out).
    m_shift = m_c[:, None] & (o_k + 1 < KERNEL - 1)[None, :]
    b_next = tl.load(p_state + o_k[None, :] + 1, mask=m_shift, other=0)
    b_next = tl.where((o_k == KERNEL - 2)[None, :], b_x[:, None].to(b_next.dtype), b_next)
    tl.store(p_state + o_k[None, :], b_next, mask=m_old)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One new token per sequence. x [B, C]; weight [C, K]; states [S, C, K-1] (the SSM pool's conv states of
    one layer, updated in place at rows slots [B]). Returns silu(conv) [B, C] in x's dtype."""
    num_seqs, channels = x.shape
    kernel = weight.shape[1]
    if weight.shape[0] != channels or states.shape[1:] != (channels, kernel - 1) or slots.shape != (num_seqs,):
        raise ValueError(f"conv update: x {tuple(x.shape)}, weight {tuple(weight.shape)}, states {tuple(states.shape)}, "
                         f"slots {tuple(slots.shape)}")
    if kernel < 2 or x.stride(-1) != 1 or weight.stride(-1) != 1 or states.stride(-1) != 1:
        raise ValueError(f"conv update: kernel width {kernel} must be >= 2 and every last dimension contiguous")
    out = torch.empty_like(x)
    if num_seqs == 0:
        return out
    block_c = 128
    causal_conv1d_update_fwd_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, states, slots, out, x.stride(0), weight.stride(0), states.stride(0), states.stride(1), out.stride(0),
        CHANNELS=channels, KERNEL=kernel, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(kernel),
        **pdl_launch(x.device),
    )
    return out
