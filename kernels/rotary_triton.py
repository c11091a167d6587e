"""q/k per-head RMSNorm and (partial, neox half-rotation) rotary in one pass: one program per (token, head)
row. Replaces about a dozen elementwise kernels per call of the unfused naive_rms_norm + naive_apply_rotary
and rounds where they round (every bf16 op rounds its result), so it matches naive_rms_norm_rotary."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _normed(x, weight, offs, mask, rstd, UNIT_OFFSET: tl.constexpr):
    """Load x at offs (fp32) and return its rms_norm, rounded to x's dtype, as fp32."""
    b_x = tl.load(x + offs, mask=mask, other=0).to(tl.float32)
    b_w = tl.load(weight + offs, mask=mask, other=0).to(tl.float32)
    if UNIT_OFFSET:
        return (b_x * rstd * (1.0 + b_w)).to(x.dtype.element_ty).to(tl.float32)
    return ((b_x * rstd).to(x.dtype.element_ty).to(tl.float32) * b_w).to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _norm_rotary_row(row, weight, positions, inv_freq, i_t, dim, rotary_dim, eps, o_d, m_d, UNIT_OFFSET: tl.constexpr):
    """One head row's rms_norm then rotary (fp32, rounded as the naive ops round)."""
    b_x = tl.load(row + o_d, mask=m_d, other=0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 0) / dim + eps)
    b_y = _normed(row, weight, o_d, m_d, rstd, UNIT_OFFSET)
    half = rotary_dim // 2
    is_rot = o_d < rotary_dim
    first = o_d < half
    partner = tl.where(first, o_d + half, o_d - half)
    # Channel d < R/2 pairs with d + R/2 (and back): the partner's normed value, same row statistics.
    b_p = _normed(row, weight, partner, m_d & is_rot, rstd, UNIT_OFFSET)
    pos = tl.load(positions + i_t).to(tl.float32)
    freq = pos * tl.load(inv_freq + tl.where(first, o_d, o_d - half), mask=is_rot, other=0)
    b_cos = tl.cos(freq).to(row.dtype.element_ty).to(tl.float32)
    b_sin = tl.sin(freq).to(row.dtype.element_ty).to(tl.float32)
    rotated = tl.where(first, -b_p, b_p)
    a = (b_y * b_cos).to(row.dtype.element_ty).to(tl.float32)
    b = (rotated * b_sin).to(row.dtype.element_ty).to(tl.float32)
    return tl.where(is_rot, a + b, b_y)


@triton.jit
def qk_norm_rotary_store_fwd_kernel(
    q, k, v, wq, wk, positions, inv_freq, q_out, k_out, pool_k, pool_v, rows,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pr, stride_ph,
    num_q_heads, num_kv_heads, dim, rotary_dim, eps,
    BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (token, head) of q's heads then k's: q and k normed and rotated into q_out / k_out; a k
    head's program also stores its row, and the token's v row of that head, into the pool at rows[token]."""
    pdl_enter(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    heads = num_q_heads + num_kv_heads
    i_t, i_h = i_r // heads, i_r % heads
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    if i_h < num_q_heads:
        b_q = _norm_rotary_row(q + i_t * stride_qt + i_h * stride_qh, wq, positions, inv_freq, i_t, dim, rotary_dim,
                               eps, o_d, m_d, UNIT_OFFSET)
        tl.store(q_out + (i_t * num_q_heads + i_h) * dim + o_d, b_q.to(q_out.dtype.element_ty), mask=m_d)
    else:
        i_k = i_h - num_q_heads
        b_v = tl.load(v + i_t * stride_vt + i_k * stride_vh + o_d, mask=m_d, other=0)
        b_k = _norm_rotary_row(k + i_t * stride_kt + i_k * stride_kh, wk, positions, inv_freq, i_t, dim, rotary_dim,
                               eps, o_d, m_d, UNIT_OFFSET)
        tl.store(k_out + (i_t * num_kv_heads + i_k) * dim + o_d, b_k.to(k_out.dtype.element_ty), mask=m_d)
        slot = tl.load(rows + i_t).to(tl.int64)
        tl.store(pool_k + slot * stride_pr + i_k * stride_ph + o_d, b_k.to(pool_k.dtype.element_ty), mask=m_d)
        tl.store(pool_v + slot * stride_pr + i_k * stride_ph + o_d, b_v.to(pool_v.dtype.element_ty), mask=m_d)


@triton.jit
def rms_norm_rotary_fwd_kernel(
    x, weight, positions, inv_freq, out, stride_xt, stride_xh, num_heads, dim, rotary_dim, eps,
    BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_t, i_h = i_r // num_heads, i_r % num_heads
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    b_out = _norm_rotary_row(x + i_t * stride_xt + i_h * stride_xh, weight, positions, inv_freq, i_t, dim, rotary_dim,
                             eps, o_d, m_d, UNIT_OFFSET)
    tl.store(out + i_r * dim + o_d, b_out.to(out.dtype.element_ty), mask=m_d)


def rms_norm_rotary(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
) -> torch.Tensor:
    """x [T, H, D] (rows may be strided, last dim contiguous), weight [D], positions [T] int, inv_freq [R/2] fp32
    -> [T, H, D] contiguous in x's dtype: rotary of the first R channels of rms_norm(x)."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_rotary x {tuple(x.shape)} must be [T, H, D] with a contiguous last dimension")
    tokens, heads, dim = x.shape
    rotary_dim = 2 * inv_freq.shape[0]
    if weight.shape != (dim,) or positions.shape != (tokens,) or rotary_dim > dim:
        raise ValueError(f"rms_norm_rotary: weight {tuple(weight.shape)} must be [{dim}], positions "
                         f"{tuple(positions.shape)} [{tokens}], rotary dim {rotary_dim} <= {dim}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens * heads:
        rms_norm_rotary_fwd_kernel[(tokens * heads,)](
            x, weight, positions, inv_freq.float(), out, x.stride(0), x.stride(1), heads, dim, rotary_dim, eps,
            BLOCK_D=triton.next_power_of_2(dim), UNIT_OFFSET=unit_offset, **pdl_launch(x.device),
        )
    return out


def qk_norm_rotary_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
    unit_offset: bool, positions: torch.Tensor, inv_freq: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_rotary of q [T, Hq, D] and k [T, Hkv, D] in one launch, k's result and v [T, Hkv, D] also stored into
    the pool's rows [T] (pool_k / pool_v [S, Hkv, D], one slot a token). Returns (q, k) normed and rotated,
    contiguous. Rows may be strided (last dims contiguous)."""
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = 2 * inv_freq.shape[0]
    if k.shape != (tokens, num_kv_heads, dim) or v.shape != k.shape or rows.shape != (tokens,) \
            or pool_k.shape[1:] != (num_kv_heads, dim) or pool_v.shape != pool_k.shape or pool_k.stride() != pool_v.stride():
        raise ValueError(f"qk_norm_rotary_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, rows "
                         f"{tuple(rows.shape)}, pool {tuple(pool_k.shape)}/{tuple(pool_v.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, pool_k, pool_v)) or pool_k.stride(1) != dim:
        raise ValueError("qk_norm_rotary_store: last dimensions must be contiguous, pool rows [Hkv, D] whole")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        qk_norm_rotary_store_fwd_kernel[(tokens * (num_q_heads + num_kv_heads),)](
            q, k, v, wq, wk, positions, inv_freq.float(), q_out, k_out, pool_k, pool_v, rows,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), pool_k.stride(0),
            pool_k.stride(1), num_q_heads, num_kv_heads, dim, rotary_dim, eps,
            BLOCK_D=triton.next_power_of_2(dim), UNIT_OFFSET=unit_offset, **pdl_launch(q.device),
        )
    return q_out, k_out
