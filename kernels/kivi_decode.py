"""Decode over a KIVI pool's closed pages with the head split into chunks: a variant of paged_attention_fwd_kernel's
whole-page KIVI path for decode launches (16 query rows a program), off until the H200 measures it
(paged_attention.DECODE_TUNING's d_chunks; bench/engine_speed.py's decode tile sweep).

Why: the general kernel dequantizes a whole [64 keys, 256 channels] key tile and then a value tile in fp32
registers, 128 a thread each at 4 warps. It compiles to 246 registers a thread for the H200 (bench/kernel_sass.py
kivi), so a multiprocessor holds two programs, eight warps; at batch 8 over 32K keys a layer takes 0.405 ms
(bench/results/session12/call2) where its instructions alone would issue in ~0.17 ms: warps stalled on latencies
with too few others to switch to. Here a tile is read a chunk of channels at a time (CHUNKS of them): the scores
are the sum of the chunks' q.k dots, and each chunk of the output keeps its own accumulator, so a dequantized
chunk is dead after its dot and a thread holds one chunk of a tile at a time (168 registers at 2 chunks, Triton
3.6: bench/results/session15). Same loads, same arithmetic per element; the difference is registers, hence
programs a multiprocessor.

The result equals paged_attention_fwd_kernel's up to the order of the q.k sums (a chunk's dot, then the chunks
added). Reference: paged_kv.naive_paged_attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.paged_attention import (
    MAGIC_EXPONENT,
    UNSPECIALISED,
    _load_kivi_pages,
    _program,
    _rows_and_keys,
)
from headroom.kernels.paged_kv import PagedKV
from headroom.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _q_chunk(q, o_t, o_hq, m_m, stride_qt, stride_qh, D0: tl.constexpr, DC: tl.constexpr, HEAD_DIM: tl.constexpr,
             DOT_FP32: tl.constexpr):
    """Channels D0 .. D0 + DC - 1 of the tile's query rows."""
    o_c = D0 + tl.arange(0, DC)
    p_q = q + o_t[:, None].to(tl.int64) * stride_qt + o_hq[:, None] * stride_qh + o_c[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & (o_c < HEAD_DIM)[None, :], other=0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    return b_q


@triton.jit
def _chunk_scores(b_q, k, k_scale, k_zero, pages, m_pg, stride_kp, stride_kr, stride_ksp, magic, D0: tl.constexpr,
                  DC: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr, GROUP_D: tl.constexpr,
                  NUM_PAGES: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q.k over channels D0 .. D0 + DC - 1 of the tile's keys, [BLOCK_M, BLOCK_N] fp32 (keys rounded to q's dtype,
    as a dense dequantized prefix would be)."""
    o_c = D0 + tl.arange(0, DC)
    b_k = _load_kivi_pages(k, k_scale, k_zero, pages, m_pg, o_c, o_c < HEAD_DIM, stride_kp, stride_kr, stride_ksp,
                           BITS, PAGE, True, GROUP_D, NUM_PAGES, DC, HEAD_DIM, D0, magic)
    return tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)), input_precision=DOT_PRECISION)


@triton.jit
def _chunk_values(b_p, v, v_scale, v_zero, pages, m_pg, stride_kp, stride_kr, stride_vsp, magic, D0: tl.constexpr,
                  DC: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr, GROUP_D: tl.constexpr,
                  NUM_PAGES: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """p.v over channels D0 .. D0 + DC - 1 of the tile's values, [BLOCK_M, DC] fp32 (b_p in the dot's dtype)."""
    o_c = D0 + tl.arange(0, DC)
    b_v = _load_kivi_pages(v, v_scale, v_zero, pages, m_pg, o_c, o_c < HEAD_DIM, stride_kp, stride_kr, stride_vsp,
                           BITS, PAGE, False, GROUP_D, NUM_PAGES, DC, HEAD_DIM, D0, magic)
    return tl.dot(b_p, b_v.to(b_p.dtype), input_precision=DOT_PRECISION)


@triton.jit
def _store_chunk(o, i_s, o_t, o_hq, m_m, acc, seen, den, stride_os, stride_ot, stride_oh, D0: tl.constexpr,
                 DC: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Channels D0 .. D0 + DC - 1 of the normalised output (0 for a row that saw no key)."""
    o_c = D0 + tl.arange(0, DC)
    p_o = o + i_s * stride_os + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh + o_c[None, :]
    b_o = tl.where(seen[:, None], acc / den[:, None], 0.0)
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_m[:, None] & (o_c < HEAD_DIM)[None, :])


# The same arguments as paged_attention_fwd_kernel's are no specialisation keys.
@triton.jit(do_not_specialize=UNSPECIALISED)
def kivi_decode_fwd_kernel(
    q, o, lse, q_pos, q_offsets, kv_table, kv_start, kv_lens, k, v, k_scale, k_zero, v_scale, v_zero, sm_scale,
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_table,
    stride_kp, stride_kr, stride_kh, stride_ksp, stride_ksh, stride_vsp, stride_vsh, magic_exponent,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS,
    BLOCK_N: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr, GROUP_D: tl.constexpr, CHUNKS: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, MAGIC_IN_REGISTER: tl.constexpr,
):
    """paged_attention_fwd_kernel's program for a KIVI pool's whole-page tiles without a continued range (prev),
    the head in CHUNKS chunks of DC = BLOCK_D / CHUNKS channels (1, 2 or 4; DC a multiple of the value groups)."""
    pdl_enter(PDL)
    magic = MAGIC_EXPONENT
    if MAGIC_IN_REGISTER:
        magic = magic_exponent
    i_b, i_m, i_h, i_s, q_lo, q_hi = _program(q_offsets, NUM_SPLITS)
    if i_m * BLOCK_M >= (q_hi - q_lo) * GROUP:
        return
    o_t, o_hq, m_m, b_pos, kv_lo, lo, hi = _rows_and_keys(q_pos, kv_start, kv_lens, i_b, i_m, i_h, i_s, q_lo, q_hi,
                                                         NUM_SPLITS, GROUP, BLOCK_M, BLOCK_N)
    DC: tl.constexpr = BLOCK_D // CHUNKS
    NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
    # Unused chunks (CHUNKS < 4) keep a placeholder the compiler drops.
    q0 = _q_chunk(q, o_t, o_hq, m_m, stride_qt, stride_qh, 0, DC, HEAD_DIM, DOT_FP32)
    q1, q2, q3 = q0, q0, q0
    if CHUNKS > 1:
        q1 = _q_chunk(q, o_t, o_hq, m_m, stride_qt, stride_qh, DC, DC, HEAD_DIM, DOT_FP32)
    if CHUNKS > 2:
        q2 = _q_chunk(q, o_t, o_hq, m_m, stride_qt, stride_qh, 2 * DC, DC, HEAD_DIM, DOT_FP32)
        q3 = _q_chunk(q, o_t, o_hq, m_m, stride_qt, stride_qh, 3 * DC, DC, HEAD_DIM, DOT_FP32)
    acc0 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    k_head, ks_head, kz_head = k + i_h * stride_kh, k_scale + i_h * stride_ksh, k_zero + i_h * stride_ksh
    v_head, vs_head, vz_head = v + i_h * stride_kh, v_scale + i_h * stride_vsh, v_zero + i_h * stride_vsh
    for j0 in range(lo, hi, BLOCK_N):
        o_j = j0 + tl.arange(0, BLOCK_N)
        # Tiles are page-aligned (splits are whole tiles): BLOCK_N // PAGE whole pages, all closed; keys past hi
        # inside them are real data, masked out of the scores below.
        o_pg = j0 // PAGE + tl.arange(0, NUM_PAGES)
        m_pg = o_pg * PAGE < hi
        pages = tl.load(kv_table + i_b.to(tl.int64) * stride_table + o_pg, mask=m_pg, other=0).to(tl.int64)
        b_s = _chunk_scores(q0, k_head, ks_head, kz_head, pages, m_pg, stride_kp, stride_kr, stride_ksp, magic, 0, DC, BITS,
                            PAGE, GROUP_D, NUM_PAGES, HEAD_DIM, DOT_PRECISION)
        if CHUNKS > 1:
            b_s += _chunk_scores(q1, k_head, ks_head, kz_head, pages, m_pg, stride_kp, stride_kr, stride_ksp, magic, DC, DC,
                                 BITS, PAGE, GROUP_D, NUM_PAGES, HEAD_DIM, DOT_PRECISION)
        if CHUNKS > 2:
            b_s += _chunk_scores(q2, k_head, ks_head, kz_head, pages, m_pg, stride_kp, stride_kr, stride_ksp, magic, 2 * DC,
                                 DC, BITS, PAGE, GROUP_D, NUM_PAGES, HEAD_DIM, DOT_PRECISION)
            b_s += _chunk_scores(q3, k_head, ks_head, kz_head, pages, m_pg, stride_kp, stride_kr, stride_ksp, magic, 3 * DC,
                                 DC, BITS, PAGE, GROUP_D, NUM_PAGES, HEAD_DIM, DOT_PRECISION)
        visible = ((kv_lo + o_j)[None, :] <= b_pos[:, None]) & (o_j < hi)[None, :]
        b_s = tl.where(visible, b_s * qk_scale, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.exp2(b_s - m_safe[:, None])
        alpha = tl.exp2(b_m - m_safe)
        p_dot = b_p.to(q0.dtype)
        acc0 = acc0 * alpha[:, None] + _chunk_values(p_dot, v_head, vs_head, vz_head, pages, m_pg, stride_kp,
                                                     stride_kr, stride_vsp, magic, 0, DC, BITS, PAGE, GROUP_D, NUM_PAGES,
                                                     HEAD_DIM, DOT_PRECISION)
        if CHUNKS > 1:
            acc1 = acc1 * alpha[:, None] + _chunk_values(p_dot, v_head, vs_head, vz_head, pages, m_pg, stride_kp,
                                                         stride_kr, stride_vsp, magic, DC, DC, BITS, PAGE, GROUP_D,
                                                         NUM_PAGES, HEAD_DIM, DOT_PRECISION)
        if CHUNKS > 2:
            acc2 = acc2 * alpha[:, None] + _chunk_values(p_dot, v_head, vs_head, vz_head, pages, m_pg, stride_kp,
                                                         stride_kr, stride_vsp, magic, 2 * DC, DC, BITS, PAGE, GROUP_D,
                                                         NUM_PAGES, HEAD_DIM, DOT_PRECISION)
            acc3 = acc3 * alpha[:, None] + _chunk_values(p_dot, v_head, vs_head, vz_head, pages, m_pg, stride_kp,
                                                         stride_kr, stride_vsp, magic, 3 * DC, DC, BITS, PAGE, GROUP_D,
                                                         NUM_PAGES, HEAD_DIM, DOT_PRECISION)
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_m = m_new
    seen = b_l > 0
    den = tl.where(seen, b_l, 1.0)
    _store_chunk(o, i_s, o_t, o_hq, m_m, acc0, seen, den, stride_os, stride_ot, stride_oh, 0, DC, HEAD_DIM)
    if CHUNKS > 1:
        _store_chunk(o, i_s, o_t, o_hq, m_m, acc1, seen, den, stride_os, stride_ot, stride_oh, DC, DC, HEAD_DIM)
    if CHUNKS > 2:
        _store_chunk(o, i_s, o_t, o_hq, m_m, acc2, seen, den, stride_os, stride_ot, stride_oh, 2 * DC, DC, HEAD_DIM)
        _store_chunk(o, i_s, o_t, o_hq, m_m, acc3, seen, den, stride_os, stride_ot, stride_oh, 3 * DC, DC, HEAD_DIM)
    b_lse = tl.where(seen, (b_m + tl.log2(tl.where(seen, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse + i_s * stride_ls + o_t.to(tl.int64) * stride_lt + o_hq, b_lse, mask=m_m)


def chunks_supported(chunks: int, head_dim: int, value_group: int) -> bool:
    """Whether kivi_decode_fwd_kernel runs a head of head_dim channels (a power of 2) in `chunks` chunks: 1, 2 or 4
    (one q slice and one accumulator each, named in the kernel), each at least 16 channels (a dot's smallest side)
    and a whole number of value groups (the scales' broadcast)."""
    if chunks not in (1, 2, 4) or head_dim != triton.next_power_of_2(head_dim) or head_dim % chunks:
        return False
    width = head_dim // chunks
    return width >= 16 and width % max(value_group, 1) == 0


def kivi_decode(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q_positions: torch.Tensor,
                q_offsets: torch.Tensor, kv_table: torch.Tensor, kv_start: torch.Tensor, kv_lens: torch.Tensor,
                kv: PagedKV, scale: float, grid: tuple[int, int, int], block_m: int, block_n: int, chunks: int,
                num_warps: int, num_stages: int, magic_register: bool = False, max_registers: int | None = None) -> None:
    """paged_attention_fwd's launch over a KIVI pool's whole pages, the head in `chunks` chunks: out [S, N, Hq, D]
    and lse [S, N, Hq] per split (S = grid's splits), as paged_attention_fwd_kernel writes them. magic_register:
    paged_attention's MAGIC_IN_REGISTER; max_registers: a cap for ptxas (Triton's maxnreg: four chunks compile to
    255 registers, 168 under that cap without a spill in the loop; bench/kernel_sass.py kivi_chunks)."""
    head_dim = q.shape[-1]
    if not chunks_supported(chunks, head_dim, kv.value_group):
        raise ValueError(f"d_chunks={chunks} does not cut a head of {head_dim} channels into 1, 2 or 4 chunks of at "
                         f"least 16 channels and whole value groups of {kv.value_group}")
    if kv.kind != "kivi" or kv.k_scale is None or kv.k_zero is None or kv.v_scale is None or kv.v_zero is None:
        raise ValueError(f"kivi_decode reads a KIVI pool, got {kv.kind}")
    dot_fp32 = q.dtype == torch.float32 or not q.is_cuda
    kivi_decode_fwd_kernel[grid](
        q, out, lse, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv.k, kv.v,
        kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        kv_table.stride(0), kv.k.stride(0), kv.k.stride(1), kv.k.stride(-2),
        kv.k_scale.stride(0), kv.k_scale.stride(1), kv.v_scale.stride(0), kv.v_scale.stride(1), MAGIC_EXPONENT.value,
        GROUP=q.shape[1] // kv.num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m,
        NUM_SPLITS=grid[2] // kv.num_kv_heads, BLOCK_N=block_n, BITS=kv.bits, PAGE=kv.page_tokens,
        GROUP_D=max(kv.value_group, 1), CHUNKS=chunks, DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        MAGIC_IN_REGISTER=magic_register, num_warps=num_warps, num_stages=num_stages,
        **({"maxnreg": max_registers} if max_registers else {}), **pdl_launch(q.device),
    )
