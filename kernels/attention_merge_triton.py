"""The log-sum-exp merge of split-K decode partials in one launch (reference: attention_merge.py's
merge_attention_states, about fifteen torch kernels per attention layer and step). One program per
(token, head) row and MERGE_CHANNELS of its channels reads its S partial outputs and lses and writes the merged
channels (and, the row's first program, the lse) in place (a KIVI decode step's residual windows arrive as one
more split: kernels/paged_attention.py's WINDOW)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.gates_triton import sigmoid_gate
from headroom.kernels.pdl import pdl_enter, pdl_launch

# The splits are read SPLIT_CHUNK at a time whatever their number: one compiled variant for any split count (a tile
# of next_power_of_2(splits) made one for each power of two, and serving met counts the warm-up had not: 64, 32 and
# 16 splits of an int2 pool's short prompts, session 15's review). num_splits, and the lses' split stride (the pass's
# tokens times the heads), are no specialisation keys for the same reason. 32: a graphed decode step over a bf16 pool
# splits 32 ways at batch 1, so its merge is one chunk, one round trip to L2 (_splits_merged).
SPLIT_CHUNK = 32
# Rows of more splits than SPLIT_CHUNK are read WIDE_SPLIT_CHUNK at a time (a second compiled variant, met by an
# int2 server's warm-up: bench/results/session27/variant_coverage_wide128.json). An int2 pool's batch-1 step merges
# 65 splits (64 and its window): three dependent chunks of 32 took 4.63 / 4.66 us a launch, one of 128 2.45 / 2.46
# (H100, two runs, bench/results/session28), eight launches a step. Every row read 128 at a time (SPLIT_CHUNK 128)
# lost at batch 8 and 16 (3.46 -> 4.26 and 4.36 -> 7.44 us: the masked rows cost instructions), hence two chunks.
WIDE_SPLIT_CHUNK = 128
# Channels a program merges. A graphed batch-1 step has 16 rows (one token's query heads): one program a row was 16
# programs on 132 multiprocessors, each reading every split's 256 channels in dependent chunks (3.7 us a launch over a
# bf16 pool's 32 splits, 12.1 us over an int2 pool's 65 before the one-pass merge; H200, session 20). A row's
# channels in programs of 32 make that 128 programs of 32 x 32 fp32 a chunk. Each program takes the row's lses
# again (S floats, against S x 32 of parts); the width is fixed so that the kernel compiles one variant per head
# size whatever the batch.
MERGE_CHANNELS = 32


@triton.jit
def _splits_merged(p_parts, p_lse, num_splits, stride_ps, stride_ls, o_d, m_d, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """A row's splits merged in one pass, BLOCK_S at a time, each chunk's lses and parts loaded together: (the
    parts weighted by exp(lse - shift) summed [BLOCK_D], the weights' sum, shift), shift the largest lse (0 if no
    split saw a key: every weight is then exp(-inf) = 0, not NaN). The sums so far are rescaled when a chunk raises
    the largest lse; with at most BLOCK_S splits there is one chunk and the weights are exp(lse - the largest lse),
    as a pass for the largest lse and a second for the sums gave them (that pass was a round trip to L2 more)."""
    o_s = tl.arange(0, BLOCK_S)
    top = float("-inf")
    shift = 0.0
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        m_s = s0 + o_s < num_splits
        b_lse = tl.load(p_lse + (s0 + o_s) * stride_ls, mask=m_s, other=float("-inf"))
        b_part = tl.load(p_parts + (s0 + o_s)[:, None] * stride_ps + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                         other=0)
        new_top = tl.maximum(top, tl.max(b_lse, 0))
        new_shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        # (nothing summed while no split has seen a key: its sums are 0, whatever exp(shift - new_shift) would be)
        scale = tl.where(top == float("-inf"), 0.0, tl.exp(shift - new_shift))
        b_w = tl.exp(b_lse - new_shift)
        acc = acc * scale + b_part * b_w[:, None]
        total = total * scale + b_w
        top, shift = new_top, new_shift
    return tl.sum(acc, 0), tl.sum(total, 0), shift


@triton.jit
def _store_merged(out, out_lse, acc, sum_w, shift, i_t, i_h, stride_ot, stride_oh, stride_olt, o_d, m_d, gate, stride_gt,
                  stride_gh, GATE: tl.constexpr, STORE_LSE):
    """The merged channels o_d into out (GATE: times sigmoid of the gate's, as sigmoid_mul would make of the stored
    row: the row rounded to out's dtype first), and with STORE_LSE the row's lse into out_lse (never gated)."""
    merged = acc / tl.maximum(sum_w, 1e-30)
    if GATE:
        b_g = tl.load(gate + i_t * stride_gt + i_h * stride_gh + o_d, mask=m_d, other=0).to(tl.float32)
        merged = sigmoid_gate(merged.to(out.dtype.element_ty).to(tl.float32), b_g, out)
    tl.store(out + i_t * stride_ot + i_h * stride_oh + o_d, merged.to(out.dtype.element_ty), mask=m_d)
    if STORE_LSE:
        tl.store(out_lse + i_t * stride_olt + i_h,
                 tl.where(sum_w > 0, shift + tl.log(tl.maximum(sum_w, 1e-30)), float("-inf")))


@triton.jit(do_not_specialize=["num_splits", "stride_ls"])
def merge_splits_fwd_kernel(
    parts, lses, out, out_lse, num_splits, num_heads, head_dim,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh, stride_olt, gate, stride_gt,
    stride_gh, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, GATE: tl.constexpr = False,
):
    """BLOCK_D channels (program_id 1) of one (token, head) row (program_id 0): each split's part weighted by
    exp(lse - the largest lse), BLOCK_S splits at a time (_splits_merged; GATE: stored times sigmoid(gate),
    _store_merged); the row's first program stores its lse."""
    pdl_enter(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    i_t, i_h = i_r // num_heads, i_r % num_heads
    o_d = i_c * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    acc, sum_w, shift = _splits_merged(parts + i_t * stride_pt + i_h * stride_ph, lses + i_t * stride_lt + i_h,
                                       num_splits, stride_ps, stride_ls, o_d, m_d, BLOCK_S, BLOCK_D)
    _store_merged(out, out_lse, acc, sum_w, shift, i_t, i_h, stride_ot, stride_oh, stride_olt, o_d, m_d, gate,
                  stride_gt, stride_gh, GATE, i_c == 0)


def merge_splits_into(parts: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor,
                      gate: torch.Tensor | None = None) -> None:
    """parts [S, N, H, D] fp32 (each normalised over its own keys), lses [S, N, H] fp32 (natural log, -inf: no
    key) -> writes out [N, H, D] (its dtype) and out_lse [N, H] fp32 as merge_attention_states returns them.
    gate [N, H, D] (Qwen3.5's attention output gate; rows and heads may be strided): out is then the merged rows
    times sigmoid(gate), what sigmoid_mul makes of them, without a launch of its own."""
    num_splits, tokens, heads, dim = parts.shape
    if lses.shape != parts.shape[:3] or out.shape != parts.shape[1:] or out_lse.shape != parts.shape[1:3] \
            or (gate is not None and gate.shape != out.shape):
        raise ValueError(f"merge: parts {tuple(parts.shape)}, lses {tuple(lses.shape)}, out {tuple(out.shape)}, "
                         f"out_lse {tuple(out_lse.shape)}, gate {None if gate is None else tuple(gate.shape)}")
    if any(t.stride(-1) != 1 for t in (parts, lses, out, out_lse) + ((gate,) if gate is not None else ())):
        raise ValueError("merge: every last dimension must be contiguous")
    if tokens * heads == 0:
        return
    block_d = min(MERGE_CHANNELS, triton.next_power_of_2(dim))
    merge_splits_fwd_kernel[(tokens * heads, triton.cdiv(dim, block_d))](
        parts, lses, out, out_lse, num_splits, heads, dim,
        parts.stride(0), parts.stride(1), parts.stride(2), lses.stride(0), lses.stride(1),
        out.stride(0), out.stride(1), out_lse.stride(0), gate if gate is not None else out,
        gate.stride(0) if gate is not None else 0, gate.stride(1) if gate is not None else 0,
        BLOCK_S=SPLIT_CHUNK if num_splits <= SPLIT_CHUNK else WIDE_SPLIT_CHUNK, BLOCK_D=block_d, GATE=gate is not None,
        # (a chunk of 32 splits x 32 channels is 8 fp32 a thread at 4 warps, for the parts and the sums each)
        num_warps=4, **pdl_launch(parts.device),
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
