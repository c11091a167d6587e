"""Prefill of the short causal conv1d (in front of Gated DeltaNet) for every sequence of a pass in one launch:
silu(depthwise conv) over each sequence's rows, the K-1 inputs before a sequence read from its carried state
in the SSM pool, and each sequence's new state (its last K-1 inputs) written to a separate [B, C, K-1] buffer,
since programs of the same sequence still read the old one. The reference is kernels/conv.py's
naive_causal_conv1d, per sequence. Replaces a per-sequence torch.cat + conv1d + silu + copy (about 30 ms of an
8,192-token pass of the 4B model on the H200)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _window_input(x, states, row0, slot, p, o_c, m, stride_x, stride_ss, stride_sc, KERNEL: tl.constexpr):
    """Inputs at relative positions p [R] of one sequence (rows from row0 in x; p < 0 from its state) -> [R, C] fp32."""
    from_x = p >= 0
    b_x = tl.load(x + (row0 + p)[:, None].to(tl.int64) * stride_x + o_c[None, :], mask=m & from_x[:, None], other=0)
    b_s = tl.load(states + slot * stride_ss + o_c[None, :] * stride_sc + (KERNEL - 1 + p)[:, None],
                  mask=m & (~from_x)[:, None], other=0)
    return b_x.to(tl.float32) + b_s.to(tl.float32)


@triton.jit
def causal_conv1d_varlen_fwd_kernel(
    x, weight, states, slots, offsets, out, new_states, stride_x, stride_wc, stride_ss, stride_sc, stride_o,
    stride_nb, stride_nc, CHANNELS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_b, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(offsets + i_b).to(tl.int32)
    length = tl.load(offsets + i_b + 1).to(tl.int32) - row0
    t0 = i_t * BLOCK_T
    if t0 >= length:
        return
    slot = tl.load(slots + i_b).to(tl.int64)
    o_t = t0 + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < CHANNELS
    m = (o_t < length)[:, None] & m_c[None, :]
    b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        b_in = _window_input(x, states, row0, slot, o_t - (KERNEL - 1) + j, o_c, m, stride_x, stride_ss, stride_sc,
                             KERNEL)
        b_w = tl.load(weight + o_c * stride_wc + j, mask=m_c, other=0).to(tl.float32)
        b_acc += b_in * b_w[None, :]
    b_out = b_acc / (1.0 + tl.exp(-b_acc))
    tl.store(out + (row0 + o_t)[:, None].to(tl.int64) * stride_o + o_c[None, :], b_out.to(out.dtype.element_ty),
             mask=m)
    if t0 + BLOCK_T >= length:
        # The sequence's last tile: its new state is the last K-1 inputs (some still from the old state if the
        # sequence is shorter than that).
        o_s = tl.arange(0, BLOCK_S)
        m_s = (o_s < KERNEL - 1)[:, None] & m_c[None, :]
        b_state = _window_input(x, states, row0, slot, length - (KERNEL - 1) + o_s, o_c, m_s, stride_x, stride_ss,
                                stride_sc, KERNEL)
        p_new = new_states + i_b * stride_nb + o_c[None, :] * stride_nc + o_s[:, None]
        tl.store(p_new, b_state.to(new_states.dtype.element_ty), mask=m_s)


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """x [N, C] (B sequences' rows, sequence b at cu_seqlens[b]..cu_seqlens[b+1]-1), weight [C, K], states
    [S, C, K-1] (the pool's), slots [B] -> silu(conv) [N, C] in x's dtype; states[slots[b]] becomes sequence
    b's last K-1 inputs."""
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_seqs = slots.shape[0]
    if states.shape[1:] != (channels, kernel - 1) or cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(f"conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, states {tuple(states.shape)}, "
                         f"cu_seqlens {tuple(cu_seqlens.shape)} for {num_seqs} slots")
    out = torch.empty_like(x)
    new_states = states.new_empty((num_seqs, channels, kernel - 1))
    if num_tokens == 0:
        return out
    block_t, block_c = 32, 128
    grid = (num_seqs, triton.cdiv(max_len, block_t), triton.cdiv(channels, block_c))
    causal_conv1d_varlen_fwd_kernel[grid](
        x, weight, states, slots, cu_seqlens, out, new_states, x.stride(0), weight.stride(0), states.stride(0),
        states.stride(1), out.stride(0), new_states.stride(0), new_states.stride(1), CHANNELS=channels,
        KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_S=triton.next_power_of_2(max(kernel - 1, 1)),
        num_warps=4,
    )
    states[slots] = new_states
    return out
