"""Decode attention over a KIVI pool (int2/int4/int8 keys and values) at a few instructions per element.

The general paged kernel (kernels/paged_attention.py) unpacks a KIVI tile byte by byte: each code is shifted down
to bit 0, made a float, and dequantized with a scale broadcast (and converted from fp16) per element. Counted on
sm_90 that is 10.2 instructions per key or value element at int2, so int2 decode at 32K was bound by its
instructions and slower than bf16 although it reads a fifth of the bytes (docs/kernels.md, session 9).

This kernel reads the packed codes as int32 words (4 channels x 8/BITS tokens each) and never shifts a code down:
a code at bit p of its word is masked in place and OR-ed into the mantissa of 2^23, so the float minus 2^23 is
code * 2^p exactly (kernels/int_float.py), and 2^-p is folded into the scale, which is computed once per page
(keys) or per token and channel group (values) rather than per element. The bytes 2 and 3 of a word come from the
word shifted by 16, so every code sits below bit 16. What is left per element is one LOP3, one FADD and one FFMA,
and the conversion to the MMA's bf16.

Rows are (query token, head) pairs as in paged_attention (a decode step: the GROUP query heads of one KV head);
keys are read in tiles of NUM_PAGES whole pages, and long key ranges are split over programs whose partial results
paged_attention merges (flash-decoding). Same arguments, results and reference (naive_paged_attention).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _codes(words, K: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr):
    """The code of token-in-byte K in byte B of every (already half-shifted) word as fp32, exactly, without moving
    it: masked in place at bit p = BITS K + 8 B and OR-ed into the mantissa of a float whose exponent makes that
    bit weigh 1 (2^(23 - p), biased 150 - p), so the float minus 2^(23 - p) is the code (one LOP3, one FADD)."""
    p: tl.constexpr = BITS * K + 8 * B
    mask: tl.constexpr = ((1 << BITS) - 1) << p
    magic_bits: tl.constexpr = (150 - p) << 23
    magic: tl.constexpr = float(1 << (23 - p))
    return ((words & mask) | magic_bits).to(tl.float32, bitcast=True) - magic


@triton.jit
def _key_part(words, s, z, K: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr, T: tl.constexpr,
              W: tl.constexpr):
    """Keys [T, W] of token-in-byte K and channels 4 w + 2 h + B (words already shifted by 16 h): words [P, R, W],
    s and z [P, 1, W] fp32, the page's per-channel scale and zero."""
    return tl.reshape(_codes(words, K, B, BITS) * s + z, (T, W))


@triton.jit
def _value_part(words, s, z, K: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr, T: tl.constexpr,
                W: tl.constexpr):
    """Values [T, W] of token-in-byte K and channels 4 w + 2 h + B: words [P, R, G, W / G], s and z [P, R, G, 1]
    fp32, each token's scale and zero per channel group."""
    return tl.reshape(_codes(words, K, B, BITS) * s + z, (T, W))


@triton.jit
def _page_scales(ptr, pages, m_pages, stride_p, o_w, C: tl.constexpr):
    """A key scale or zero [P, 1, W] fp32 of channels 4 w + C of each page."""
    p_s = pages[:, None] * stride_p + (4 * o_w + C)[None, :]
    return tl.load(ptr + p_s, mask=m_pages[:, None], other=0).to(tl.float32)[:, None, :]


@triton.jit
def _rows_of(ptr, o_t, o_m, m_m, o_w, stride_t, stride_h, C: tl.constexpr):
    """Rows [BLOCK_M, W] (token o_t, head o_m) of channels 4 w + C."""
    p = ptr + o_t[:, None].to(tl.int64) * stride_t + o_m[:, None] * stride_h + (4 * o_w + C)[None, :]
    return tl.load(p, mask=m_m[:, None], other=0)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, ROUND: tl.constexpr):
    if ROUND:
        # Round the dequantized tile to the model dtype, as a dense dequantized prefix would be.
        b = b.to(a.dtype)
    return tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)


# NUM_SPLITS is no specialisation key (as in paged_attention_fwd_kernel: the split count follows the batch).
@triton.jit(do_not_specialize=["NUM_SPLITS"])
def kivi_decode_fwd_kernel(
    q, o, lse, q_pos, q_offsets, kv_table, kv_start, kv_lens,
    k_words, v_words, k_scale, k_zero, v_scale, v_zero, sm_scale,
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_table,
    stride_kp, stride_kr, stride_kh, stride_ksp, stride_ksh, stride_vsp, stride_vsh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS,
    NUM_PAGES: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr, GROUP_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_TILES: tl.constexpr,
):
    """Rows as paged_attention_fwd_kernel's; the head's channels taken as four interleaved sets 4 w + c (c = 2 h +
    b: byte b of half h of a word), each its own [.., W] operand, and a tile's tokens as PER_BYTE sub-tiles of
    T = NUM_PAGES * ROWS keys (token-in-byte k), each one online-softmax step: no tile is ever reshaped across
    its packed layout."""
    i_b, i_m, i_hs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, i_s = i_hs // NUM_SPLITS, i_hs % NUM_SPLITS
    PER_BYTE: tl.constexpr = 8 // BITS
    ROWS: tl.constexpr = PAGE // PER_BYTE
    W: tl.constexpr = HEAD_DIM // 4
    T: tl.constexpr = NUM_PAGES * ROWS
    G: tl.constexpr = HEAD_DIM // GROUP_D
    BLOCK_N: tl.constexpr = NUM_PAGES * PAGE
    q_lo, q_hi = tl.load(q_offsets + i_b), tl.load(q_offsets + i_b + 1)
    if i_m * BLOCK_M >= (q_hi - q_lo) * GROUP:
        return
    # Row r of this tile is token q_lo + r // GROUP, query head i_h * GROUP + r % GROUP.
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_t = q_lo + o_m // GROUP
    o_hq = i_h * GROUP + o_m % GROUP
    m_m = o_t < q_hi
    o_w = tl.arange(0, W)
    q0 = _rows_of(q, o_t, o_hq, m_m, o_w, stride_qt, stride_qh, 0)
    q1 = _rows_of(q, o_t, o_hq, m_m, o_w, stride_qt, stride_qh, 1)
    q2 = _rows_of(q, o_t, o_hq, m_m, o_w, stride_qt, stride_qh, 2)
    q3 = _rows_of(q, o_t, o_hq, m_m, o_w, stride_qt, stride_qh, 3)
    if DOT_FP32:
        q0, q1, q2, q3 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
    b_pos = tl.load(q_pos + o_t, mask=m_m, other=0).to(tl.int32)
    kv_lo, n_keys = tl.load(kv_start + i_b), tl.load(kv_lens + i_b)
    # This split's key range (whole tiles), cut at the last key any row of the tile may see.
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * per_split
    hi = tl.minimum(tl.minimum(n_keys, lo + per_split), tl.max(b_pos) - kv_lo + 1)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, W], tl.float32)
    acc1 = tl.zeros([BLOCK_M, W], tl.float32)
    acc2 = tl.zeros([BLOCK_M, W], tl.float32)
    acc3 = tl.zeros([BLOCK_M, W], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    k_head, v_head = k_words + i_h * stride_kh, v_words + i_h * stride_kh
    k_scale, k_zero = k_scale + i_h * stride_ksh, k_zero + i_h * stride_ksh
    v_scale, v_zero = v_scale + i_h * stride_vsh, v_zero + i_h * stride_vsh
    o_r = tl.arange(0, ROWS)
    o_g = tl.arange(0, G)
    o_gw = tl.arange(0, W // G)
    o_row = tl.arange(0, T)
    # Key j0 + first[t] + k is token-in-byte k of packed row t of the tile.
    first = (o_row // ROWS) * PAGE + (o_row % ROWS) * PER_BYTE
    for j0 in range(lo, hi, BLOCK_N):
        o_pg = j0 // PAGE + tl.arange(0, NUM_PAGES)
        m_pg = o_pg * PAGE < hi
        pages = tl.load(kv_table + i_b.to(tl.int64) * stride_table + o_pg, mask=m_pg, other=0).to(tl.int64)
        row_base = pages[:, None] * stride_kp + o_r[None, :] * stride_kr  # [P, R]
        kw = tl.load(k_head + row_base[:, :, None] + o_w[None, None, :], mask=m_pg[:, None, None], other=0)
        kw_hi = kw >> 16
        p_vw = v_head + row_base[:, :, None, None] + (o_g[:, None] * (W // G) + o_gw[None, :])[None, None, :, :]
        vw = tl.load(p_vw, mask=m_pg[:, None, None, None], other=0)
        vw_hi = vw >> 16
        for k in tl.static_range(PER_BYTE):
            # Reloaded (from L1) for every sub-tile rather than held: eight [P, W] tensors live across the
            # sub-tiles spilled registers.
            ks0 = _page_scales(k_scale, pages, m_pg, stride_ksp, o_w, 0)
            ks1 = _page_scales(k_scale, pages, m_pg, stride_ksp, o_w, 1)
            ks2 = _page_scales(k_scale, pages, m_pg, stride_ksp, o_w, 2)
            ks3 = _page_scales(k_scale, pages, m_pg, stride_ksp, o_w, 3)
            kz0 = _page_scales(k_zero, pages, m_pg, stride_ksp, o_w, 0)
            kz1 = _page_scales(k_zero, pages, m_pg, stride_ksp, o_w, 1)
            kz2 = _page_scales(k_zero, pages, m_pg, stride_ksp, o_w, 2)
            kz3 = _page_scales(k_zero, pages, m_pg, stride_ksp, o_w, 3)
            b_s = tl.zeros([BLOCK_M, T], tl.float32)
            b_s = _dot(q0, tl.trans(_key_part(kw, ks0, kz0, k, 0, BITS, T, W)), b_s, DOT_PRECISION, ROUND_TILES)
            b_s = _dot(q1, tl.trans(_key_part(kw, ks1, kz1, k, 1, BITS, T, W)), b_s, DOT_PRECISION, ROUND_TILES)
            b_s = _dot(q2, tl.trans(_key_part(kw_hi, ks2, kz2, k, 0, BITS, T, W)), b_s, DOT_PRECISION, ROUND_TILES)
            b_s = _dot(q3, tl.trans(_key_part(kw_hi, ks3, kz3, k, 1, BITS, T, W)), b_s, DOT_PRECISION, ROUND_TILES)
            o_j = j0 + first + k
            visible = ((kv_lo + o_j)[None, :] <= b_pos[:, None]) & (o_j < hi)[None, :]
            b_s = tl.where(visible, b_s * qk_scale, float("-inf"))
            m_new = tl.maximum(b_m, tl.max(b_s, 1))
            # Rows that have seen no key yet keep m = -inf; subtract 0 there so exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = tl.exp2(b_s - m_safe[:, None])
            alpha = tl.exp2(b_m - m_safe)
            b_l = b_l * alpha + tl.sum(b_p, 1)
            b_m = m_new
            b_p = b_p.to(q0.dtype)
            # Token (row t, k)'s value scale and zero per channel group: slot page * PAGE + first_in_page + k.
            p_vs = ((pages[:, None] * PAGE + o_r[None, :] * PER_BYTE + k) * stride_vsp)[:, :, None] + o_g[None, None, :]
            m_vs = m_pg[:, None, None]
            vs = tl.load(v_scale + p_vs, mask=m_vs, other=0).to(tl.float32)[:, :, :, None]
            vz = tl.load(v_zero + p_vs, mask=m_vs, other=0).to(tl.float32)[:, :, :, None]
            acc0 = _dot(b_p, _value_part(vw, vs, vz, k, 0, BITS, T, W), acc0 * alpha[:, None], DOT_PRECISION,
                        ROUND_TILES)
            acc1 = _dot(b_p, _value_part(vw, vs, vz, k, 1, BITS, T, W), acc1 * alpha[:, None], DOT_PRECISION,
                        ROUND_TILES)
            acc2 = _dot(b_p, _value_part(vw_hi, vs, vz, k, 0, BITS, T, W), acc2 * alpha[:, None], DOT_PRECISION,
                        ROUND_TILES)
            acc3 = _dot(b_p, _value_part(vw_hi, vs, vz, k, 1, BITS, T, W), acc3 * alpha[:, None], DOT_PRECISION,
                        ROUND_TILES)
    seen = b_l > 0
    inv_l = tl.where(seen, 1.0 / tl.where(seen, b_l, 1.0), 0.0)[:, None]
    b_lse = tl.where(seen, (b_m + tl.log2(tl.where(seen, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    p_o = o + i_s * stride_os
    tl.store(p_o + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh + (4 * o_w)[None, :],
             (acc0 * inv_l).to(o.dtype.element_ty), mask=m_m[:, None])
    tl.store(p_o + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh + (4 * o_w + 1)[None, :],
             (acc1 * inv_l).to(o.dtype.element_ty), mask=m_m[:, None])
    tl.store(p_o + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh + (4 * o_w + 2)[None, :],
             (acc2 * inv_l).to(o.dtype.element_ty), mask=m_m[:, None])
    tl.store(p_o + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh + (4 * o_w + 3)[None, :],
             (acc3 * inv_l).to(o.dtype.element_ty), mask=m_m[:, None])
    tl.store(lse + i_s * stride_ls + o_t.to(tl.int64) * stride_lt + o_hq, b_lse, mask=m_m)
