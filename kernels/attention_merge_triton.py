"""The log-sum-exp merge of split-K decode partials in one launch (reference: attention_merge.py's
merge_attention_states, about fifteen torch kernels per attention layer and step). One program per
(token, head) row reads its S partial outputs and lses and writes the merged row and lse in place. Its window
variant attends the row's residual-window keys too, as one more part (a KIVI decode step's open pages)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.paged_kv import KeyWindow
from headroom.kernels.pdl import pdl_enter, pdl_launch

# The splits are read SPLIT_CHUNK at a time whatever their number: one compiled variant for any split count (a tile
# of next_power_of_2(splits) made one for each power of two, and serving met counts the warm-up had not: 64, 32 and
# 16 splits of an int2 pool's short prompts, session 15's review). num_splits, and the lses' split stride (the pass's
# tokens times the heads), are no specialisation keys for the same reason.
SPLIT_CHUNK = 16


@triton.jit
def _splits_top(p_lse, num_splits, stride_ls, BLOCK_S: tl.constexpr):
    """The largest lse over a row's splits (-inf if none saw a key)."""
    o_s = tl.arange(0, BLOCK_S)
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        top = tl.maximum(top, tl.load(p_lse + (s0 + o_s) * stride_ls, mask=s0 + o_s < num_splits, other=float("-inf")))
    return tl.max(top, 0)


@triton.jit
def _splits_sum(p_parts, p_lse, num_splits, shift, stride_ps, stride_ls, o_d, m_d, BLOCK_S: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """A row's splits weighted by exp(lse - shift): (sum of the weighted parts [BLOCK_D], sum of the weights)."""
    o_s = tl.arange(0, BLOCK_S)
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        m_s = s0 + o_s < num_splits
        b_w = tl.exp(tl.load(p_lse + (s0 + o_s) * stride_ls, mask=m_s, other=float("-inf")) - shift)
        acc += tl.load(p_parts + (s0 + o_s)[:, None] * stride_ps + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                       other=0) * b_w[:, None]
        total += b_w
    return tl.sum(acc, 0), tl.sum(total, 0)


@triton.jit
def _store_merged(out, out_lse, acc, sum_w, shift, i_t, i_h, stride_ot, stride_oh, stride_olt, o_d, m_d):
    merged = acc / tl.maximum(sum_w, 1e-30)
    tl.store(out + i_t * stride_ot + i_h * stride_oh + o_d, merged.to(out.dtype.element_ty), mask=m_d)
    tl.store(out_lse + i_t * stride_olt + i_h,
             tl.where(sum_w > 0, shift + tl.log(tl.maximum(sum_w, 1e-30)), float("-inf")))


@triton.jit(do_not_specialize=["num_splits", "stride_ls"])
def merge_splits_fwd_kernel(
    parts, lses, out, out_lse, num_splits, num_heads, head_dim,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh, stride_olt,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """One (token, head) row: the largest lse over the splits, then each split's part weighted by exp(lse - it),
    BLOCK_S splits at a time."""
    pdl_enter(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_t, i_h = i_r // num_heads, i_r % num_heads
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    p_lse = lses + i_t * stride_lt + i_h
    top_all = _splits_top(p_lse, num_splits, stride_ls, BLOCK_S)
    # A row with no key in any split: shift by 0 so that every weight is exp(-inf) = 0, not NaN.
    shift = tl.where(top_all == float("-inf"), 0.0, top_all)
    acc, sum_w = _splits_sum(parts + i_t * stride_pt + i_h * stride_ph, p_lse, num_splits, shift, stride_ps, stride_ls,
                             o_d, m_d, BLOCK_S, BLOCK_D)
    _store_merged(out, out_lse, acc, sum_w, shift, i_t, i_h, stride_ot, stride_oh, stride_olt, o_d, m_d)


@triton.jit
def _window_row(q, q_pos, w_table, w_start, w_lens, w_k, w_v, sm_scale, i_t, i_h, stride_qt, stride_qh, stride_wt,
                stride_ks, stride_kh, stride_vs, stride_vh, o_d, m_d, GROUP: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Attention of query row (i_t, head i_h) over its window keys (those at positions <= its own), on the CUDA
    cores in fp32 (a window is at most a page of keys): (output normalised over them [BLOCK_D], lse; 0 and -inf
    for none)."""
    b_q = tl.load(q + i_t * stride_qt + i_h * stride_qh + o_d, mask=m_d, other=0).to(tl.float32)
    i_kh = i_h // GROUP
    first = tl.load(w_start + i_t)
    seen = tl.minimum(tl.load(w_lens + i_t), tl.load(q_pos + i_t).to(tl.int32) - first + 1)
    qk_scale = sm_scale * 1.4426950408889634
    b_m = tl.max(tl.full([BLOCK_W], float("-inf"), tl.float32), 0)
    b_l = tl.sum(tl.zeros([BLOCK_W], tl.float32), 0)
    b_acc = tl.zeros([BLOCK_D], tl.float32)
    for j0 in range(0, seen, BLOCK_W):
        o_j = j0 + tl.arange(0, BLOCK_W)
        m_j = o_j < seen
        slots = tl.load(w_table + i_t * stride_wt + o_j, mask=m_j, other=0).to(tl.int64)
        m_tile = m_j[:, None] & m_d[None, :]
        b_k = tl.load(w_k + slots[:, None] * stride_ks + i_kh * stride_kh + o_d[None, :], mask=m_tile, other=0)
        b_s = tl.where(m_j, tl.sum(b_k.to(tl.float32) * b_q[None, :], 1) * qk_scale, float("-inf"))
        # Every tile holds at least one visible key, so m_new is finite.
        m_new = tl.maximum(b_m, tl.max(b_s, 0))
        b_p = tl.exp2(b_s - m_new)
        alpha = tl.exp2(b_m - m_new)
        b_v = tl.load(w_v + slots[:, None] * stride_vs + i_kh * stride_vh + o_d[None, :], mask=m_tile, other=0)
        b_acc = b_acc * alpha + tl.sum(b_p[:, None] * b_v.to(tl.float32), 0)
        b_l = b_l * alpha + tl.sum(b_p, 0)
        b_m = m_new
    has = b_l > 0
    b_o = b_acc / tl.where(has, b_l, 1.0)
    b_lse = tl.where(has, (b_m + tl.log2(tl.where(has, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    return b_o, b_lse


@triton.jit(do_not_specialize=["num_splits", "stride_ls", "stride_wt"])
def merge_splits_window_fwd_kernel(
    parts, lses, out, out_lse, q, q_pos, w_table, w_start, w_lens, w_k, w_v, sm_scale, num_splits, num_heads,
    head_dim, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh, stride_olt,
    stride_qt, stride_qh, stride_wt, stride_ks, stride_kh, stride_vs, stride_vh,
    GROUP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """merge_splits_fwd_kernel's row with one more part: the row's attention over its window keys, computed here
    (_window_row). A graphed int2 decode step attended its residual windows in a launch of its own after the
    merge, a layer's third (session 16, H200: 0.067 ms of a 2.9 ms step at batch 1)."""
    pdl_enter(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_t, i_h = i_r // num_heads, i_r % num_heads
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    w_o, w_lse = _window_row(q, q_pos, w_table, w_start, w_lens, w_k, w_v, sm_scale, i_t, i_h, stride_qt, stride_qh,
                             stride_wt, stride_ks, stride_kh, stride_vs, stride_vh, o_d, m_d, GROUP, BLOCK_W, BLOCK_D)
    p_lse = lses + i_t * stride_lt + i_h
    top_all = tl.maximum(_splits_top(p_lse, num_splits, stride_ls, BLOCK_S), w_lse)
    shift = tl.where(top_all == float("-inf"), 0.0, top_all)
    acc, sum_w = _splits_sum(parts + i_t * stride_pt + i_h * stride_ph, p_lse, num_splits, shift, stride_ps, stride_ls,
                             o_d, m_d, BLOCK_S, BLOCK_D)
    w_weight = tl.exp(w_lse - shift)
    _store_merged(out, out_lse, acc + w_o * w_weight, sum_w + w_weight, shift, i_t, i_h, stride_ot, stride_oh,
                  stride_olt, o_d, m_d)


def merge_splits_into(parts: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    """parts [S, N, H, D] fp32 (each normalised over its own keys), lses [S, N, H] fp32 (natural log, -inf: no
    key) -> writes out [N, H, D] (its dtype) and out_lse [N, H] fp32 as merge_attention_states returns them."""
    num_splits, tokens, heads, dim = parts.shape
    if lses.shape != parts.shape[:3] or out.shape != parts.shape[1:] or out_lse.shape != parts.shape[1:3]:
        raise ValueError(f"merge: parts {tuple(parts.shape)}, lses {tuple(lses.shape)}, out {tuple(out.shape)}, "
                         f"out_lse {tuple(out_lse.shape)}")
    if any(t.stride(-1) != 1 for t in (parts, lses, out, out_lse)):
        raise ValueError("merge: every last dimension must be contiguous")
    if tokens * heads == 0:
        return
    merge_splits_fwd_kernel[(tokens * heads,)](
        parts, lses, out, out_lse, num_splits, heads, dim,
        parts.stride(0), parts.stride(1), parts.stride(2), lses.stride(0), lses.stride(1),
        out.stride(0), out.stride(1), out_lse.stride(0),
        BLOCK_S=SPLIT_CHUNK, BLOCK_D=triton.next_power_of_2(dim),
        **pdl_launch(parts.device),
    )


# Window keys a program scores at a time: a [32, 256] fp32 tile is 64 registers a thread at 4 warps.
WINDOW_CHUNK = 32


def merge_splits_window_into(parts: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor,
                             q: torch.Tensor, q_positions: torch.Tensor, window: KeyWindow, scale: float) -> None:
    """merge_splits_into with one more key range per row: row t's window keys (KeyWindow; those at positions up to
    q_positions[t]), attended here from q [N, Hq, D] at `scale`."""
    num_splits, tokens, heads, dim = parts.shape
    if lses.shape != parts.shape[:3] or out.shape != parts.shape[1:] or out_lse.shape != parts.shape[1:3] \
            or q.shape != out.shape or q_positions.shape != (tokens,):
        raise ValueError(f"merge with window: parts {tuple(parts.shape)}, lses {tuple(lses.shape)}, out "
                         f"{tuple(out.shape)}, out_lse {tuple(out_lse.shape)}, q {tuple(q.shape)}, positions "
                         f"{tuple(q_positions.shape)}")
    wk, wv = window.kv.k, window.kv.v
    window.check(q, wk.shape[1])
    if any(t.stride(-1) != 1 for t in (parts, lses, out, out_lse, q, wk, wv)):
        raise ValueError("merge with window: every last dimension must be contiguous")
    if tokens * heads == 0:
        return
    merge_splits_window_fwd_kernel[(tokens * heads,)](
        parts, lses, out, out_lse, q, q_positions, window.table, window.start, window.lens, wk, wv, scale,
        num_splits, heads, dim, parts.stride(0), parts.stride(1), parts.stride(2), lses.stride(0), lses.stride(1),
        out.stride(0), out.stride(1), out_lse.stride(0), q.stride(0), q.stride(1), window.table.stride(0),
        wk.stride(0), wk.stride(1), wv.stride(0), wv.stride(1),
        GROUP=heads // wk.shape[1], BLOCK_W=WINDOW_CHUNK, BLOCK_S=SPLIT_CHUNK, BLOCK_D=triton.next_power_of_2(dim),
        **pdl_launch(parts.device),
    )


# The row count follows the span: no specialisation on it (a span of 7,001 rows would compile another variant).
@triton.jit(do_not_specialize=["num_rows"])
def merge_pair_fwd_kernel(
    a, a_lse, b, b_lse, out, out_lse, num_rows, num_heads,
    stride_at, stride_ah, stride_alt, stride_bt, stride_bh, stride_blt, stride_ot, stride_oh, stride_olt,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_T tokens of one head; no other program touches its rows, and a barrier puts every load of the program
    before any of its stores, so out and out_lse may be a and a_lse (an in-place merge)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_t = o_t < num_rows
    la = tl.load(a_lse + o_t * stride_alt + i_h, mask=m_t, other=float("-inf"))
    lb = tl.load(b_lse + o_t * stride_blt + i_h, mask=m_t, other=float("-inf"))
    top = tl.maximum(la, lb)
    shift = tl.where(top == float("-inf"), 0.0, top)
    wa, wb = tl.exp(la - shift), tl.exp(lb - shift)
    total = wa + wb
    b_a = tl.load(a + o_t[:, None] * stride_at + i_h * stride_ah + o_d[None, :], mask=m_t[:, None], other=0).to(tl.float32)
    b_b = tl.load(b + o_t[:, None] * stride_bt + i_h * stride_bh + o_d[None, :], mask=m_t[:, None], other=0).to(tl.float32)
    # In place, the warps of a program hold copies of the same lse rows (and the layouts of a load and a store need
    # not match): without this barrier one warp could store its merged lse (or rows) before another warp has loaded
    # the old ones. On the H200 that made the dense path's merged spans differ from run to run by up to 0.84 while
    # every cuDNN piece was right and repeatable, and the same pieces merged in fp32 by merge_two matched the paged
    # passes (bench/results/session16, call 3's dense_pieces).
    tl.debug_barrier()
    inv = 1.0 / tl.maximum(total, 1e-30)
    merged = b_a * (wa * inv)[:, None] + b_b * (wb * inv)[:, None]
    tl.store(out + o_t[:, None] * stride_ot + i_h * stride_oh + o_d[None, :], merged.to(out.dtype.element_ty),
             mask=m_t[:, None])
    tl.store(out_lse + o_t * stride_olt + i_h,
             tl.where(total > 0, shift + tl.log(tl.maximum(total, 1e-30)), float("-inf")), mask=m_t)


# Tokens of one head a program merges: [16, 256] fp32 tiles keep a program's registers small while its loads stay
# whole 512-byte rows.
MERGE_PAIR_TOKENS = 16


def merge_pair_into(a: torch.Tensor, a_lse: torch.Tensor, b: torch.Tensor, b_lse: torch.Tensor, out: torch.Tensor,
                    out_lse: torch.Tensor) -> None:
    """Attention over two disjoint key ranges merged by their log-sum-exp, in one launch: a, b [N, H, D] (any float
    dtype, any row and head strides, last dimension contiguous), a_lse, b_lse [N, H] fp32 -> out [N, H, D] (its own
    dtype), out_lse [N, H] fp32. out / out_lse may be a / a_lse. Reference: attention_merge.merge_two."""
    tokens, heads, dim = a.shape
    if b.shape != a.shape or out.shape != a.shape or any(t.shape != (tokens, heads) for t in (a_lse, b_lse, out_lse)):
        raise ValueError(f"merge_pair: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}, lses "
                         f"{[tuple(t.shape) for t in (a_lse, b_lse, out_lse)]}")
    if any(t.stride(-1) != 1 for t in (a, b, out, a_lse, b_lse, out_lse)) or dim != triton.next_power_of_2(dim) \
            or any(t.dtype != torch.float32 for t in (a_lse, b_lse, out_lse)):
        raise ValueError("merge_pair: last dimensions contiguous, a power-of-two head size and fp32 lses")
    if tokens * heads == 0:
        return
    merge_pair_fwd_kernel[(triton.cdiv(tokens, MERGE_PAIR_TOKENS), heads)](
        a, a_lse, b, b_lse, out, out_lse, tokens, heads,
        a.stride(0), a.stride(1), a_lse.stride(0), b.stride(0), b.stride(1), b_lse.stride(0),
        out.stride(0), out.stride(1), out_lse.stride(0),
        BLOCK_T=MERGE_PAIR_TOKENS, BLOCK_D=dim,
    )
