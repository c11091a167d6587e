"""Decode step of the short causal conv1d for many sequences at once, state updated in place in the SSM pool.
conv_step is the step itself, shared with kernels/gemv.py's CONV epilogue (Gated DeltaNet's in-projection GEMV
convolving its own output), so both give the same bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def conv_step(x, p_state, p_w, mask, KERNEL: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's causal conv at a tile of channels (any shape S): x fp32 [S] the new inputs (values the state's
    dtype holds exactly), p_state [S] each channel's KERNEL - 1 carried inputs (oldest first, unit stride), p_w [S]
    its KERNEL taps (unit stride), mask [S] the channels to step. Returns silu(conv) fp32 [S] (conv_window) and
    rolls the carried inputs in place (conv_roll: the oldest out, x in)."""
    out = conv_window(x, p_state, p_w, mask, KERNEL, BLOCK_K)
    conv_roll(x, p_state, mask, KERNEL, BLOCK_K)
    return out


@triton.jit
def conv_window(x, p_state, p_w, mask, KERNEL: tl.constexpr, BLOCK_K: tl.constexpr):
    """conv_step's silu(conv) fp32 [S], nothing stored: a channel's carried inputs then x, times its taps. The
    taps' products are summed one at a time in tap order, whatever the tile's layout, so every caller gets the
    same bits."""
    o_k = tl.arange(0, BLOCK_K)
    p_s = tl.expand_dims(p_state, -1) + o_k
    m = tl.expand_dims(mask, -1)
    x_k = tl.expand_dims(x, -1)
    # Window column j < KERNEL-1 is the j-th carried input, column KERNEL-1 the new token.
    window = tl.load(p_s, mask=m & (o_k < KERNEL - 1), other=0).to(tl.float32)
    window = tl.where(o_k == KERNEL - 1, x_k, window)
    taps = tl.load(tl.expand_dims(p_w, -1) + o_k, mask=m & (o_k < KERNEL), other=0).to(tl.float32)
    products = window * taps
    acc = tl.sum(tl.where(o_k == 0, products, 0.0), -1)
    for j in tl.static_range(1, KERNEL):
        acc += tl.sum(tl.where(o_k == j, products, 0.0), -1)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def conv_roll(x, p_state, mask, KERNEL: tl.constexpr, BLOCK_K: tl.constexpr):
    """conv_step's state update at the channels in mask: the carried inputs shifted left by one, x last. Every
    load comes before the barrier and every store after it, since a tile may hold a channel in several threads (a
    reduction's output is replicated) and one thread's store must not reach another's load."""
    o_k = tl.arange(0, BLOCK_K)
    p_s = tl.expand_dims(p_state, -1) + o_k
    m = tl.expand_dims(mask, -1)
    shifted = tl.load(p_s + 1, mask=m & (o_k + 1 < KERNEL - 1), other=0)
    shifted = tl.where(o_k == KERNEL - 2, tl.expand_dims(x, -1).to(shifted.dtype), shifted)
    tl.debug_barrier()
    tl.store(p_s, shifted, mask=m & (o_k < KERNEL - 1))


@triton.jit
def causal_conv1d_update_fwd_kernel(
    x, weight, states, slots, out, stride_xb, stride_wc, stride_ss, stride_sc, stride_ob,
    CHANNELS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < CHANNELS
    i_slot = tl.load(slots + i_b).to(tl.int64)
    b_x = tl.load(x + i_b * stride_xb + o_c, mask=m_c, other=0).to(tl.float32)
    b_out = conv_step(b_x, states + i_slot * stride_ss + o_c * stride_sc, weight + o_c * stride_wc, m_c, KERNEL,
                      BLOCK_K)
    tl.store(out + i_b * stride_ob + o_c, b_out.to(out.dtype.element_ty), mask=m_c)


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
