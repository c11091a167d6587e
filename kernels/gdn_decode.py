"""Gated DeltaNet decode step for B sequences, recurrent states updated in place in the SSM pool by slot.

Replaces, per layer and step, fla's fused recurrent kernel plus the gather of the states out of the pool,
their fp32 copies and the scatter back (about four passes over B x 2 MiB of state for the 4B model) with
one pass that reads and writes each state once. Same recurrence and L2 norms as naive_gated_delta_rule:
S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q, q/k L2-normalised (eps 1e-6), q scaled by Dk^-1/2.
One program per (sequence, value head, block of value channels); the key dimension is one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gated_delta_decode_fwd_kernel(
    q, k, v, g, beta, states, slots, out,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_betab,
    stride_ss, stride_sh, stride_sk, stride_ob, stride_oh, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    i_b, i_hv, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_hk = i_hv // GROUP
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < DK
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < DV
    b_q = tl.load(q + i_b * stride_qb + i_hk * stride_qh + o_k, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(k + i_b * stride_kb + i_hk * stride_kh + o_k, mask=m_k, other=0).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_v = tl.load(v + i_b * stride_vb + i_hv * stride_vh + o_v, mask=m_v, other=0).to(tl.float32)
    b_g = tl.load(g + i_b * stride_gb + i_hv).to(tl.float32)
    b_beta = tl.load(beta + i_b * stride_betab + i_hv).to(tl.float32)
    slot = tl.load(slots + i_b).to(tl.int64)
    p_s = states + slot * stride_ss + i_hv * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0).to(tl.float32) * tl.exp(b_g)
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    tl.store(p_s, b_s.to(states.dtype.element_ty), mask=m_s)
    tl.store(out + i_b * stride_ob + i_hv * stride_oh + o_v, b_o.to(out.dtype.element_ty), mask=m_v)


def gated_delta_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; states [S, Hv, Dk, Dv] (updated in place at rows
    slots [B], int); strided rows allowed, last dims contiguous. Returns out [B, Hv, Dv] in v's dtype."""
    num_seqs, num_k_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != num_seqs or num_v_heads % num_k_heads \
            or g.shape != (num_seqs, num_v_heads) or beta.shape != (num_seqs, num_v_heads):
        raise ValueError(f"gated delta decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if states.shape[1:] != (num_v_heads, key_dim, value_dim) or slots.shape != (num_seqs,):
        raise ValueError(f"gated delta decode: states {tuple(states.shape)} must be [S, {num_v_heads}, {key_dim}, "
                         f"{value_dim}], slots {tuple(slots.shape)} [{num_seqs}]")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, beta, states)):
        raise ValueError("gated delta decode: every last dimension must be contiguous")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    # Small batches: narrower value blocks, so that more programs share the state reads.
    block_v = 16 if num_seqs < 4 else 32
    grid = (num_seqs, num_v_heads, triton.cdiv(value_dim, block_v))
    gated_delta_decode_fwd_kernel[grid](
        q, k, v, g, beta, states, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1), key_dim**-0.5,
        GROUP=num_v_heads // num_k_heads, DK=key_dim, DV=value_dim, BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=block_v, num_warps=4,
    )
    return out
