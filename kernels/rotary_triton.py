"""q/k per-head RMSNorm and (partial, neox half-rotation) rotary in one pass. Replaces about a dozen elementwise
kernels per call of the unfused naive_rms_norm + naive_apply_rotary and rounds where they round (every bf16 op
rounds its result), so it matches naive_rms_norm_rotary.

A program takes a [BLOCK_H, BLOCK_D] tile: BLOCK_H heads of one token (q's heads and k's heads in separate programs,
heads past the count masked), so the token's position, cos and sin are computed once and broadcast over its heads,
and a thread holds several heads' channels. The first version ran one program of 4 warps per (token, head) row,
2 elements a thread: 163,840 programs for an 8K prefill chunk of the 4B model (16 q + 4 kv heads of 256), 0.27 ms
a call on the H200 (~0.75 TB/s; session 12), launch/scheduling bound rather than bandwidth bound.

Bit-for-bit with the per-row version: the arithmetic and its roundings are the same per element, and each head's
sum of squares (its rstd) is reduced in the same order, as the per-row version's layout reduced it: VEC contiguous
channels a thread (its own sum first), then the 32 lanes, then the 4 warps along the row. The column offsets carry
max_contiguous(VEC) so that the compiler's coalescing keeps that layout (VEC channels along D a thread, lanes and
warps along D, the BLOCK_H heads repeated in each thread's registers) instead of widening a thread's vector to 8
channels, which would reorder the sum (a last-ULP change of an fp32 rstd now and then flips a bf16 rounding).
_tile_config picks VEC as the per-row layout had it. (Checked in the sm_90 PTX of both versions, compiled
with the launch's divisibility specializations: the same fma/shuffle/shared-memory tree a head; not yet run on a GPU.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.kv_quant_triton import page_close_arguments, quantize_page
from headroom.kernels.paged_kv import PageClose
from headroom.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _normed(b_x, b_w, rstd, x, UNIT_OFFSET: tl.constexpr):
    """rms_norm of the fp32 tile b_x [BLOCK_H, BLOCK_D] (rstd [BLOCK_H, 1], weight b_w [BLOCK_D] fp32), rounded to
    the dtype of x (the rows' pointer) as the naive ops round, as fp32."""
    b_w = b_w[None, :]
    if UNIT_OFFSET:
        return (b_x * rstd * (1.0 + b_w)).to(x.dtype.element_ty).to(tl.float32)
    return ((b_x * rstd).to(x.dtype.element_ty).to(tl.float32) * b_w).to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotary_cols(positions, inv_freq, i_t, rotary_dim, o_d):
    """The token's per-channel rotary terms [BLOCK_D], once per program: which channels rotate, which are the first
    half, each channel's partner (d < R/2 pairs with d + R/2 and back), cos and sin (fp32, not yet rounded)."""
    half = rotary_dim // 2
    is_rot = o_d < rotary_dim
    first = o_d < half
    partner = tl.where(first, o_d + half, o_d - half)
    pos = tl.load(positions + i_t).to(tl.float32)
    freq = pos * tl.load(inv_freq + tl.where(first, o_d, o_d - half), mask=is_rot, other=0)
    return is_rot, first, partner, tl.cos(freq), tl.sin(freq)


@triton.jit
def _norm_rotary_tile(x, o_r, m_r, weight, dim, eps, o_d, m_d, is_rot, first, partner, cos, sin,
                      UNIT_OFFSET: tl.constexpr):
    """Rows x + o_r [BLOCK_H] (int64 element offsets; rows where m_r is off are masked) of one token: each row's
    rms_norm then rotary (fp32, rounded as the naive ops round) -> [BLOCK_H, BLOCK_D]."""
    m = m_r[:, None] & m_d[None, :]
    b_x = tl.load(x + o_r[:, None] + o_d[None, :], mask=m, other=0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) / dim + eps)
    b_w = tl.load(weight + o_d, mask=m_d, other=0).to(tl.float32)
    b_y = _normed(b_x, b_w, rstd[:, None], x, UNIT_OFFSET)
    # The partner channel's normed value, same row statistics: a second load of the rows at permuted columns.
    m_p = m_d & is_rot
    b_xp = tl.load(x + o_r[:, None] + partner[None, :], mask=m_r[:, None] & m_p[None, :], other=0).to(tl.float32)
    b_p = _normed(b_xp, tl.load(weight + partner, mask=m_p, other=0).to(tl.float32), rstd[:, None], x, UNIT_OFFSET)
    b_cos = cos.to(x.dtype.element_ty).to(tl.float32)[None, :]
    b_sin = sin.to(x.dtype.element_ty).to(tl.float32)[None, :]
    rotated = tl.where(first[None, :], -b_p, b_p)
    a = (b_y * b_cos).to(x.dtype.element_ty).to(tl.float32)
    b = (rotated * b_sin).to(x.dtype.element_ty).to(tl.float32)
    return tl.where(is_rot[None, :], a + b, b_y)


@triton.jit
def qk_norm_rotary_store_fwd_kernel(
    q, k, v, wq, wk, positions, inv_freq, q_out, k_out, pool_k, pool_v, rows,
    close_rows, close_pages, k_packed, v_packed, k_scale, k_zero, v_scale, v_zero, inv_levels,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pr, stride_ph,
    stride_cp, stride_cr, stride_ch, stride_ksp, stride_ksh, stride_vsp, stride_vsh,
    num_q_heads, num_kv_heads, dim, rotary_dim, eps,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
    CLOSE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 1, BITS: tl.constexpr = 2, PAGE: tl.constexpr = 1,
    GROUP_D: tl.constexpr = 1, BLOCK_G: tl.constexpr = 1, BLOCK_C: tl.constexpr = 1, RECIPROCAL: tl.constexpr = True,
):
    """Grid (tokens, cdiv(num_q_heads, BLOCK_H) + cdiv(num_kv_heads, BLOCK_H) [+ 2 num_kv_heads with CLOSE]): a
    program takes BLOCK_H of one token's q heads, or of its k heads, normed and rotated into q_out / k_out; a k
    program also stores its k rows, and the token's v rows of those heads, into the pool at rows[token]. CLOSE (a
    graphed KIVI decode step, pool_k and pool_v its flat windows; paged_kv.PageClose): where the token fills its
    window row (close_pages[token] >= 0), one more program a head and tensor stores that head's k (or v) row in
    the k program's place and then quantizes the row's page of that head into the KIVI pool page
    (kv_quant_triton.quantize_page), as kivi_quantize_pages would in a launch of its own: the 2 x num_kv_heads
    quantizations run side by side, and no row has two writers. (A launch of its own, most closing nothing, took
    0.019 ms of a 2.78 ms step at batch 1 on the H200, session 20; the k programs closing their heads' keys and
    values one after another 0.26 ms a close on the H100, session 21.)"""
    pdl_enter(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    kv_blocks = tl.cdiv(num_kv_heads, BLOCK_H)
    o_d = tl.max_contiguous(tl.arange(0, BLOCK_D), VEC)
    m_d = o_d < dim
    is_rot, first, partner, cos, sin = _rotary_cols(positions, inv_freq, i_t, rotary_dim, o_d)
    if i_b < q_blocks:
        o_h = (i_b * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        m_h = o_h < num_q_heads
        b_q = _norm_rotary_tile(q + i_t * stride_qt, o_h * stride_qh, m_h, wq, dim, eps, o_d, m_d, is_rot, first,
                                partner, cos, sin, UNIT_OFFSET)
        m = m_h[:, None] & m_d[None, :]
        tl.store(q_out + (i_t * num_q_heads + o_h)[:, None] * dim + o_d[None, :], b_q.to(q_out.dtype.element_ty), mask=m)
    elif i_b < q_blocks + kv_blocks:
        o_h = ((i_b - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        m_h = o_h < num_kv_heads
        m = m_h[:, None] & m_d[None, :]
        b_v = tl.load(v + i_t * stride_vt + o_h[:, None] * stride_vh + o_d[None, :], mask=m, other=0)
        b_k = _norm_rotary_tile(k + i_t * stride_kt, o_h * stride_kh, m_h, wk, dim, eps, o_d, m_d, is_rot, first,
                                partner, cos, sin, UNIT_OFFSET)
        tl.store(k_out + (i_t * num_kv_heads + o_h)[:, None] * dim + o_d[None, :], b_k.to(k_out.dtype.element_ty), mask=m)
        if CLOSE:
            # A row whose page closes is stored by its close programs, which read the page back after it. (The
            # flag loaded a head, not as a scalar: the interpreter's `mask & scalar` is no mask.)
            m = m & (tl.load(close_pages + i_t + o_h * 0) < 0)[:, None]
        o_p = tl.load(rows + i_t).to(tl.int64) * stride_pr + o_h[:, None] * stride_ph + o_d[None, :]
        tl.store(pool_k + o_p, b_k.to(pool_k.dtype.element_ty), mask=m)
        tl.store(pool_v + o_p, b_v.to(pool_v.dtype.element_ty), mask=m)
    elif CLOSE:
        i_c = i_b - q_blocks - kv_blocks
        i_dst = tl.load(close_pages + i_t).to(tl.int64)
        if i_dst >= 0:
            is_key = i_c < num_kv_heads
            i_h = i_c % num_kv_heads
            slot = tl.load(rows + i_t).to(tl.int64)
            i_row = tl.load(close_rows + i_t).to(tl.int64)
            if is_key:
                # The k program's tile of this head (its block's heads, the same layout and sums), this head's row.
                o_h = ((i_h // BLOCK_H) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
                b_k = _norm_rotary_tile(k + i_t * stride_kt, o_h * stride_kh, o_h < num_kv_heads, wk, dim, eps, o_d,
                                        m_d, is_rot, first, partner, cos, sin, UNIT_OFFSET)
                tl.store(pool_k + slot * stride_pr + o_h[:, None] * stride_ph + o_d[None, :],
                         b_k.to(pool_k.dtype.element_ty), mask=(o_h == i_h)[:, None] & m_d[None, :])
                # The row was stored by this program's threads in another layout than the page is read back in:
                # all stores before any thread's loads.
                tl.debug_barrier()
                quantize_page(pool_k, i_row, i_dst, k_packed, k_scale, k_zero, inv_levels, stride_pr, stride_ph,
                              stride_cp, stride_cr, stride_ch, stride_ksp, stride_ksh, i_h, True, HEAD_DIM, BITS, PAGE,
                              GROUP_D, BLOCK_G, BLOCK_C, RECIPROCAL)
            else:
                b_v = tl.load(v + i_t * stride_vt + i_h * stride_vh + o_d, mask=m_d, other=0)
                tl.store(pool_v + slot * stride_pr + i_h * stride_ph + o_d, b_v.to(pool_v.dtype.element_ty), mask=m_d)
                tl.debug_barrier()
                quantize_page(pool_v, i_row, i_dst, v_packed, v_scale, v_zero, inv_levels, stride_pr, stride_ph,
                              stride_cp, stride_cr, stride_ch, stride_vsp, stride_vsh, i_h, False, HEAD_DIM, BITS, PAGE,
                              GROUP_D, BLOCK_G, BLOCK_C, RECIPROCAL)


@triton.jit
def rms_norm_rotary_fwd_kernel(
    x, weight, positions, inv_freq, out, stride_xt, stride_xh, num_heads, dim, rotary_dim, eps,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (tokens, cdiv(num_heads, BLOCK_H)): a program takes BLOCK_H heads of one token."""
    pdl_enter(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    m_h = o_h < num_heads
    o_d = tl.max_contiguous(tl.arange(0, BLOCK_D), VEC)
    m_d = o_d < dim
    is_rot, first, partner, cos, sin = _rotary_cols(positions, inv_freq, i_t, rotary_dim, o_d)
    b_out = _norm_rotary_tile(x + i_t * stride_xt, o_h * stride_xh, m_h, weight, dim, eps, o_d, m_d, is_rot, first,
                              partner, cos, sin, UNIT_OFFSET)
    tl.store(out + (i_t * num_heads + o_h)[:, None] * dim + o_d[None, :], b_out.to(out.dtype.element_ty),
             mask=m_h[:, None] & m_d[None, :])


def _tile_config(heads: int, dim: int, config: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_D, VEC, num_warps). BLOCK_H: up to 4 heads a program (8 below 256 channels), no more than
    the heads; VEC: the contiguous channels a thread holds along a row, as the per-row version's 4-warp layout held
    them (BLOCK_D / 128, at least 1, at most 8), so the rstd sums keep their order. config: (BLOCK_H, num_warps)
    instead, for measuring (other num_warps than 4 change VEC and so may change the sums' order)."""
    block_d = triton.next_power_of_2(dim)
    block_h, warps = config or (min(triton.next_power_of_2(heads), 8 if block_d < 256 else 4), 4)
    if block_h < 1 or block_h & (block_h - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"rotary tile config {config}: BLOCK_H and num_warps must be powers of two")
    return block_h, block_d, max(1, min(8, block_d // (32 * warps))), warps


def rms_norm_rotary(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [T, H, D] (rows may be strided, last dim contiguous), weight [D], positions [T] int, inv_freq [R/2] fp32
    -> [T, H, D] contiguous in x's dtype: rotary of the first R channels of rms_norm(x). config: (BLOCK_H,
    num_warps), see _tile_config."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_rotary x {tuple(x.shape)} must be [T, H, D] with a contiguous last dimension")
    tokens, heads, dim = x.shape
    rotary_dim = 2 * inv_freq.shape[0]
    if weight.shape != (dim,) or positions.shape != (tokens,) or rotary_dim > dim:
        raise ValueError(f"rms_norm_rotary: weight {tuple(weight.shape)} must be [{dim}], positions "
                         f"{tuple(positions.shape)} [{tokens}], rotary dim {rotary_dim} <= {dim}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens * heads:
        block_h, block_d, vec, warps = _tile_config(heads, dim, config)
        rms_norm_rotary_fwd_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, weight, positions, inv_freq.float(), out, x.stride(0), x.stride(1), heads, dim, rotary_dim, eps,
            BLOCK_H=block_h, BLOCK_D=block_d, VEC=vec, UNIT_OFFSET=unit_offset, num_warps=warps,
            **pdl_launch(x.device),
        )
    return out


def qk_norm_rotary_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
    unit_offset: bool, positions: torch.Tensor, inv_freq: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
    rows: torch.Tensor, config: tuple[int, int] | None = None, close: PageClose | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_rotary of q [T, Hq, D] and k [T, Hkv, D] in one launch, k's result and v [T, Hkv, D] also stored into
    the pool's rows [T] (pool_k / pool_v [S, Hkv, D], one slot a token). Returns (q, k) normed and rotated,
    contiguous. Rows may be strided (last dims contiguous). config: (BLOCK_H, num_warps), see _tile_config.
    close: a graphed KIVI step's page close (pool_k / pool_v its flat windows), in the same launch."""
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
        block_h, block_d, vec, warps = _tile_config(max(num_q_heads, num_kv_heads), dim, config)
        # (with a close, its programs: one a KV head and tensor)
        grid = (tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h)
                + (2 * num_kv_heads if close is not None else 0))
        closing, close_strides, close_constants = page_close_arguments(close, pool_k, tokens, rows)
        qk_norm_rotary_store_fwd_kernel[grid](
            q, k, v, wq, wk, positions, inv_freq.float(), q_out, k_out, pool_k, pool_v, rows, *closing,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), pool_k.stride(0),
            pool_k.stride(1), *close_strides, num_q_heads, num_kv_heads, dim, rotary_dim, eps,
            BLOCK_H=block_h, BLOCK_D=block_d, VEC=vec, UNIT_OFFSET=unit_offset, num_warps=warps,
            CLOSE=close is not None, **close_constants, **pdl_launch(q.device),
        )
    return q_out, k_out
