"""GPU attention of one mixed batch straight from the paged KV pool (no dense copy of any prefix).

Every sequence's closed pages are read by the paged kernel with dequantization fused; for KIVI the
open page (the full-precision residual window, positions closed..end-1) is one more pass, or in a graphed decode
step part of the pool pass's split merge (kernels/paged_kv.py KeyWindow). A KIVI chunk long
enough (kernels/paged_kv.py BLOCKWISE_MIN_ROWS) reads its prefix in blocks instead: each block of pages is
dequantized once into a dense workspace that the dense kernel reads, where the fused loads would dequantize
the whole prefix again in every query tile. The passes chain: each continues the online softmax of the one
before (paged_attention's prev), in an fp32 accumulator, and the last writes the output.

Long spans (DENSE_MIN_ROWS) go through cuDNN's fused attention instead (kernels/dense_attention.py says why): a
bf16 pool's straight from its rows, a KIVI pool's from the same dequantized workspace, one block of keys at a time
(_long_kivi_span_attention), so a long KIVI prefill runs its attention at cuDNN's rate, not the paged kernel's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from headroom.engine.runtime.forward_batch import POOL_BLOCKS, POOL_INDEX, WINDOW_INDEX, ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.kernels import dense_attention, ops, paged_kv
from headroom.kernels.host_copy import to_device
from headroom.kernels.paged_kv import PagedKV, blockwise_supported, page_table, plan_prefix_blocks

# Spans of at least this many rows over a bf16 pool take the dense path (cuDNN; kernels/dense_attention.py): below
# it the paged kernel's share of a pass is small, and cuDNN's fixed cost is not worth a launch of its own.
DENSE_MIN_ROWS = 2048
# Whether long spans take the dense path at all (on since session 19). Off before: on the H200 (session 13,
# bench/results/session13/) the layer's dense path gave outputs that differ between two identical calls by up to 0.1-0.7 at single elements, over a bf16
# and a KIVI pool alike (an 8,192-token chunk after 24,576 cached tokens, the span alone in its pass, with PDL on and
# off), where the paged passes are repeatable and match fp32 there, and where cuDNN's attention alone at the same
# shapes is exact and repeatable. Session 16 found the cause (bench/results/session16, call 3's dense_pieces): the
# pieces merged again outside the layer by merge_two in fp32 match the paged passes, by the in-place Triton pair merge
# they do not, differently each run: the merge's warps could store the new lse before other warps had loaded the old
# (kernels/attention_merge_triton.py now puts a barrier between). Session 19 on the H200 (bench/results/session19/):
# with the barrier the layer's merged span is within bf16 rounding of the paged passes (0.016 on a bf16 pool, 0.008 on
# int2) and the same in every run, every piece equal to its re-run; and prefill through the LLM API took 32K tokens at
# 54,614 tok/s against 51,972 without it (128K 35,013 against 30,362; int2 32K 54,545 against 51,775), 8K unchanged.
# HEADROOM_DENSE_ATTENTION=0 takes the paged kernel for every span.
DENSE_ATTENTION = os.environ.get("HEADROOM_DENSE_ATTENTION", "1") == "1"
# Whether a graphed KIVI decode step attends its residual windows inside the pool pass (session 17, one launch a
# layer fewer; since session 20 as one more split of the pool's launch, merged with the others: kernels/
# paged_attention.py's WINDOW) or in a pass of their own continuing it; HEADROOM_WINDOW_MERGE=0 takes the pass.
WINDOW_MERGE = os.environ.get("HEADROOM_WINDOW_MERGE", "1") == "1"
# ForwardBatch cache keys: the paged kernel's key counts with the long spans' zeroed; a long span's prefix index.
DENSE_OTHERS = "dense_attention.others"
DENSE_PREFIX = "dense_attention.prefix"
# ForwardBatch cache key: the long KIVI spans on the dense path, span index -> _KiviDenseSpan.
KIVI_DENSE = "dense_attention.kivi"

# One pass over a key range: (prev (out, lse) or None, out, out_lse) -> (out, out_lse).
_Pass = Callable[[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# One cuDNN call over a key range of a long span: () -> (out, lse).
_Piece = Callable[[], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PrefixBlockIndex:
    """Device side of a PrefixBlocks plan: the direct pass's key counts (None when every sequence takes the block
    path), each sequence's workspace row and slots [B, block_tokens], and per block its key counts and the
    absolute position of its first key."""

    direct_lens: torch.Tensor | None
    block_tokens: int
    workspace_rows: int
    ws_rows: torch.Tensor
    ws_table: torch.Tensor
    lens: list[torch.Tensor]
    starts: list[torch.Tensor]


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.int32, device)


def _prefix_blocks(batch: ForwardBatch, closed: list[int], kv: PagedKV, group: int, device) -> PrefixBlockIndex | None:
    plan = plan_prefix_blocks([s.length for s in batch.spans], closed, group, kv.page_tokens, kv.head_dim, kv.value_group)
    if plan is None:
        return None
    block = plan.block_tokens
    ws_rows = _int32(plan.ws_rows, device)
    ws_table = (ws_rows[:, None] * block + torch.arange(block, device=device, dtype=torch.int32)[None]).contiguous()
    return PrefixBlockIndex(
        _int32(plan.direct_lens, device) if any(plan.direct_lens) else None, block, max(plan.ws_rows) + 1,
        ws_rows, ws_table, [_int32(lens, device) for lens in plan.block_lens],
        [_int32([i * block] * len(closed), device) for i in range(len(plan.block_lens))],
    )


def paged_attention_over_pool(
    q: torch.Tensor, batch: ForwardBatch, kv_pool: KVPool, layer: int, scale: float,
    chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D] of the batch's flattened rows (K/V already stored) -> attention output [N, Hq, D].
    chunk_kv: the pass's own K/V [N, Hkv, D] (as stored); with them, long spans of a bf16 pool take the dense path
    (_long_span_attention). gate [N, Hq, D] (Qwen3.5's output gate), graphed decode steps only: the output comes
    back times sigmoid(gate), gated by the launch's split merge where the step attends in one launch (a launch
    less a layer), else by sigmoid_mul."""
    if gate is not None and not batch.is_static:
        raise ValueError("paged_attention_over_pool: the output gate rides along in graphed decode steps only")
    spans, device, page = batch.spans, q.device, kv_pool.page_tokens

    def closed_keys() -> list[int]:
        # KIVI pool keys end at each sequence's last whole page; the rest is its residual window.
        return [s.end - s.end % page if kv_pool.is_kivi else s.end for s in spans]

    def pool_index() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        closed = closed_keys()
        table = page_table([s.seq.kv_slots[:c] for s, c in zip(spans, closed, strict=True)], page, device)
        offsets = _int32([0] + [s.offset + s.length for s in spans], device)
        max_q_len = max(s.length for s in spans)
        return table, offsets, _int32([0] * len(spans), device), _int32(closed, device), max_q_len

    table, offsets, zeros, closed_t, max_q_len = batch.cached(POOL_INDEX, pool_index)
    kv = PagedKV.from_store(kv_pool.layers[layer], kv_pool.kv_dtype, kv_pool.bits, page, kv_pool.value_group)
    positions = batch.positions

    def pool_pass(lens: torch.Tensor, gated: torch.Tensor | None = None) -> _Pass:
        return lambda prev, out, lse: ops.paged_attention(
            q, positions, offsets, table, zeros, lens, kv, scale, max_q_len=max_q_len, prev=prev, out=out, out_lse=lse,
            gate=gated)

    if not kv_pool.is_kivi:
        long = [i for i, s in enumerate(spans) if s.length >= DENSE_MIN_ROWS]
        if not DENSE_ATTENTION or chunk_kv is None or batch.is_static or kv.kind != "dense" or not long \
                or not dense_attention.available(q, kv.num_kv_heads):
            # (one pass writing q's dtype: a gate goes into its launch)
            return _chain([pool_pass(closed_t, gate)], q)
        if len(long) == len(spans):
            out = torch.empty_like(q)
        else:
            # The other spans through the paged kernel; the long ones see no key there and are written below.
            others = batch.cached(DENSE_OTHERS, lambda: _int32([0 if i in long else n for i, n in enumerate(closed_keys())],
                                                               device))
            out = _chain([pool_pass(others)], q)
        for i in long:
            prefix = batch.cached(f"{DENSE_PREFIX}.{i}", lambda i=i: _DensePrefix.of(spans[i], device))
            _long_span_attention(q, chunk_kv, spans[i], kv, scale, out, prefix)
        return out

    group = q.shape[1] // kv.num_kv_heads
    # Long spans on the dense path (_long_kivi_span_attention); the paged passes below see none of their keys.
    dense = {} if batch.is_static else batch.cached(KIVI_DENSE, lambda: _kivi_dense_spans(q, batch, kv, kv_pool, device))

    def paged_passes() -> torch.Tensor:
        # (A function of its own: the block path's workspace is freed before the dense spans allocate theirs, so
        # the two never hold the plan's dequant_transient twice.)
        def window_index() -> tuple[torch.Tensor, torch.Tensor] | None:
            # Rows of the flattened window buffer [rows x page, H, D] holding each sequence's open page; every
            # layer's windows hold the same positions, so one table serves the pass.
            lens = [0 if i in dense else s.end % page for i, s in enumerate(spans)]
            if not any(lens):
                return None
            rows = [kv_pool.residual_row(s.seq) * page for s in spans]
            return page_table([list(range(r, r + n)) for r, n in zip(rows, lens, strict=True)], 1, device), _int32(lens, device)

        def others_closed() -> list[int]:
            # closed_keys() with the dense spans' zeroed; built inside the ForwardBatch-cached indexes only (once
            # a pass, not in every layer)
            return [0 if i in dense else n for i, n in enumerate(closed_keys())]

        direct = batch.cached(DENSE_OTHERS, lambda: _int32(others_closed(), device)) if dense else closed_t
        blocks = None if batch.is_static else batch.cached(
            POOL_BLOCKS, lambda: _prefix_blocks(batch, others_closed(), kv, group, device))
        passes: list[_Pass] = []
        if blocks is None:
            passes.append(pool_pass(direct))
        else:
            if blocks.direct_lens is not None:
                passes.append(pool_pass(blocks.direct_lens))
            passes += _block_passes(q, positions, offsets, table, kv, scale, max_q_len, blocks)
        index = batch.cached(WINDOW_INDEX, window_index)
        if index is not None:
            window_table, window_lens = index
            window = PagedKV("dense", kv_pool.residual_k[layer].flatten(0, 1), kv_pool.residual_v[layer].flatten(0, 1))
            if WINDOW_MERGE and batch.is_static and blocks is None:
                # A graphed decode step (one row a sequence): the pool's launch attends the windows too (one more
                # split), two launches a layer as over a bf16 pool, not three.
                keys = paged_kv.KeyWindow(window, window_table, closed_t, window_lens)
                return _chain([lambda prev, out, lse: ops.paged_attention(
                    q, positions, offsets, table, zeros, direct, kv, scale, max_q_len=max_q_len, out=out, out_lse=lse,
                    window=keys, gate=gate)], q)
            passes.append(lambda prev, out, lse: ops.paged_attention(
                q, positions, offsets, window_table, closed_t, window_lens, window, scale, max_q_len=max_q_len,
                prev=prev, out=out, out_lse=lse))
        if gate is not None and len(passes) == 1:
            # a graphed step without windows (blocks is None): the pool's one launch, gated
            return _chain([pool_pass(direct, gate)], q)
        # An eager pass's launches all write fp32, the last one too (copied out after it): which pass came last (the
        # window's, or the pool's when no chunk ends mid-page) and what came before it (a direct pass, in mixed
        # batches) chose the output's dtype, a specialisation key, and serving met combinations the warm-up's passes
        # never compiled (session 15's review: int2 prompts of 32-128 tokens, and mixed batches). (A graphed step
        # returned above: its split merge writes the output in q's dtype, a variant compiled at capture.)
        out = _chain(passes, q, last_in_fp32=not batch.is_static)
        # (a graphed step's pool and window passes apart, WINDOW_MERGE off: gated after them)
        return out if gate is None else ops.sigmoid_mul(out.reshape(out.shape[0], -1), gate).view(out.shape)

    # (The long spans' rows of a paged pass's output are left as it wrote them, none of their keys seen, and are
    # written below.)
    out = torch.empty_like(q) if len(dense) == len(spans) else paged_passes()
    if dense:
        window = (kv_pool.residual_k[layer], kv_pool.residual_v[layer])
        shape = (max(d.plan.workspace_tokens for d in dense.values()), kv.num_kv_heads, kv.head_dim)
        workspace = (q.new_empty(shape), q.new_empty(shape))
        for i, span_index in dense.items():
            _long_kivi_span_attention(q, spans[i], kv, window, workspace, scale, out, span_index)
    return out


@dataclass(frozen=True)
class KiviDensePlan:
    """The key ranges of a long chunk of a KIVI pool on the dense path (plan_kivi_dense), each made dense in the
    workspace just before it is read: its closed pages dequantized (the range rounded out to whole pages), and for
    the chunk's own keys its open page's `window` keys copied in after them. own (first key, keys): the chunk's
    keys, cuDNN's causal square; blocks: the first keys of the whole PREFIX_BLOCKs before the chunk, cuDNN's too;
    rest (first key, keys): the prefix keys after the last whole block, for the paged kernel over the workspace."""

    own: tuple[int, int]
    blocks: tuple[int, ...]
    rest: tuple[int, int] | None
    window: int
    workspace_tokens: int


def plan_kivi_dense(start: int, end: int, page: int, block: int, workspace_limit: int) -> KiviDensePlan | None:
    """The dense path's ranges for a chunk of keys start..end-1 (start cached; a KIVI pool of `page`-token pages,
    cuDNN prefix blocks of `block` keys) in a workspace of at most workspace_limit tokens (the plan's
    dequant_transient); None where a range would not fit it, or where blocks are not whole pages."""
    if block % page:
        return None
    whole = start - start % block
    rest = (whole, start - whole) if start > whole else None
    # Workspace tokens of each range: the own keys from their first page on; the rest's pages whole.
    workspace = max(end - (start - start % page), block if whole else 0,
                    -(-start // page) * page - whole if rest else 0)
    if workspace > workspace_limit:
        return None
    return KiviDensePlan((start, end - start), tuple(range(0, whole, block)), rest, end % page, workspace)


@dataclass(frozen=True)
class _DequantRange:
    """One range of a _KiviDenseSpan in the workspace: its first key (a page's first), the closed keys dequantized
    (whole pages) as a count and as dequantize_block's block_lens [1]."""

    first: int
    closed_keys: int
    lens: torch.Tensor


@dataclass(frozen=True)
class _KiviDenseSpan:
    """Device side of a long KIVI span's plan, the same in every layer of the pass (ForwardBatch-cached): its closed
    pages [1, pages]; each range's dequantization (_DequantRange: own, the blocks', the rest's); the span's window
    row; the rest's key count [1], first key [1] and workspace slot table (_block_wide_table), the query offsets
    [0, L] and positions (_span_positions)."""

    plan: KiviDensePlan
    pages: torch.Tensor
    own: _DequantRange
    blocks: list[_DequantRange]
    rest: tuple[_DequantRange, torch.Tensor, torch.Tensor, torch.Tensor] | None
    window_row: int
    offsets: torch.Tensor
    zero: torch.Tensor
    positions: torch.Tensor


def _kivi_dense_spans(q: torch.Tensor, batch: ForwardBatch, kv: PagedKV, kv_pool: KVPool,
                      device: torch.device) -> dict[int, _KiviDenseSpan]:
    """The batch's spans that take the dense path over a KIVI pool, by index: long enough (DENSE_MIN_ROWS), cuDNN
    available at this head geometry, pages dequantize_block tiles, and a plan (plan_kivi_dense)."""
    page = kv.page_tokens
    if not DENSE_ATTENTION or kv.kind != "kivi" or not blockwise_supported(kv.head_dim, page, kv.value_group) \
            or not any(s.length >= DENSE_MIN_ROWS for s in batch.spans) \
            or not dense_attention.available(q, kv.num_kv_heads):
        return {}
    found = {}
    lens: dict[int, torch.Tensor] = {}

    def dequant(first: int, end: int, closed: int) -> _DequantRange:
        lo = first - first % page
        keys = max(0, min(-(-end // page) * page, closed) - lo)
        if keys not in lens:
            lens[keys] = _int32([keys], device)
        return _DequantRange(lo, keys, lens[keys])

    for i, span in enumerate(batch.spans):
        plan = None if span.length < DENSE_MIN_ROWS else plan_kivi_dense(
            span.start, span.end, page, dense_attention.PREFIX_BLOCK, paged_kv.BLOCKWISE_WORKSPACE_TOKENS)
        if plan is None:
            continue
        closed = span.end - plan.window
        rest = None
        if plan.rest is not None:
            first, count = plan.rest
            rest = (dequant(first, first + count, closed), _int32([count], device), _int32([first], device),
                    _block_wide_table(list(range(count)), device))
        found[i] = _KiviDenseSpan(
            plan, page_table([span.seq.kv_slots[:closed]], page, device), dequant(span.start, span.end, closed),
            [dequant(first, first + dense_attention.PREFIX_BLOCK, closed) for first in plan.blocks], rest,
            kv_pool.residual_row(span.seq) if plan.window else -1, _int32([0, span.length], device),
            _int32([0], device), _span_positions(span, device))
    return found


def _long_kivi_span_attention(q: torch.Tensor, span, kv: PagedKV,
                              window: tuple[torch.Tensor, torch.Tensor], workspace: tuple[torch.Tensor, torch.Tensor],
                              scale: float, out: torch.Tensor, index: _KiviDenseSpan) -> None:
    """One long span's rows of out over a KIVI pool: each range of its plan made dense in the workspace (k_ws, v_ws
    [slots, H, D]) and read there, by cuDNN (its own keys, the whole prefix blocks) or the paged kernel (the rest),
    merged as a bf16 pool's long span is (_merge_pieces). window: the layer's residual K and V [rows, page, H, D].
    Equal to the paged passes' attention over the same dequantized keys, up to the order of the sums."""
    rows = slice(span.offset, span.offset + span.length)
    q_span = q[rows]
    k_ws, v_ws = workspace

    def dense(where: _DequantRange, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys first..first+count-1 as [count, H, D] views of the workspace."""
        if where.closed_keys:
            ops.dequantize_block(kv, index.pages, where.lens, index.zero, where.first, where.closed_keys, k_ws, v_ws)
        opened = first + count - where.first - where.closed_keys
        if opened > 0:
            # The chunk's newest keys, in its open page: as they are (KIVI's residual window), after the closed ones.
            for buffer, source in ((k_ws, window[0]), (v_ws, window[1])):
                buffer[where.closed_keys : where.closed_keys + opened].copy_(source[index.window_row, :opened])
        skip = first - where.first
        return k_ws[skip : skip + count], v_ws[skip : skip + count]

    def piece(where: _DequantRange, first: int, count: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return dense_attention.dense_attention(q_span, *dense(where, first, count), causal, scale)

    pieces: list[_Piece] = [partial(piece, index.own, *index.plan.own, True)]
    pieces += [partial(piece, where, where.first, dense_attention.PREFIX_BLOCK, False) for where in index.blocks]
    continuations: list[_Pass] = []
    if index.rest is not None:
        where, count, first, ws_table = index.rest

        def rest(prev, acc, lse):
            dense(where, where.first, where.closed_keys)
            return ops.paged_attention(q_span, index.positions, index.offsets, ws_table, first, count,
                                       PagedKV("dense", k_ws, v_ws), scale, max_q_len=span.length, prev=prev, out=acc,
                                       out_lse=lse)
        continuations.append(rest)
    _merge_pieces(out[rows], pieces, continuations)


@dataclass(frozen=True)
class _DensePrefix:
    """Device side of a long span's prefix, the same in every layer of the pass (built once, ForwardBatch-cached):
    the pool rows of each whole PREFIX_BLOCK, and the paged kernel's table and bounds over the partial block."""

    blocks: list[torch.Tensor]
    partial: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, span, device: torch.device) -> _DensePrefix:
        block = dense_attention.PREFIX_BLOCK
        whole = span.start - span.start % block
        slots = span.seq.kv_slots
        blocks = [to_device(slots[first : first + block], torch.long, device) for first in range(0, whole, block)]
        partial = None if whole == span.start else (
            _block_wide_table(slots[whole : span.start], device), _int32([0, span.length], device),
            _int32([whole], device), _int32([span.start - whole], device), _span_positions(span, device))
        return cls(blocks, partial)


def _block_wide_table(slots: list[int], device: torch.device) -> torch.Tensor:
    """A one-row slot table [1, PREFIX_BLOCK] for the paged kernel over fewer keys (a prefix's partial block, a
    KIVI span's rest), zero-padded: the kernel specialises on its row stride being a multiple of 16, so a table as
    wide as the keys would compile a second variant while serving for the widths the warm-up did not meet."""
    return page_table([slots + [0] * (dense_attention.PREFIX_BLOCK - len(slots))], 1, device)


def _span_positions(span, device: torch.device) -> torch.Tensor:
    """A long span's query positions (start..end-1, int64 as the pass's) in a tensor of their own: a view at the
    span's row offset into the pass's positions starts 16-byte aligned or not by the offset's parity, another
    specialisation of the paged kernel."""
    return torch.arange(span.start, span.end, device=device, dtype=torch.long)


def _long_span_attention(q: torch.Tensor, chunk_kv: tuple[torch.Tensor, torch.Tensor], span,
                         kv: PagedKV, scale: float, out: torch.Tensor, prefix: _DensePrefix) -> None:
    """One long span's rows of out (kernels/dense_attention.py says why): its causal block over its own K/V and
    its prefix in full PREFIX_BLOCKs through cuDNN, the prefix's last partial block through the paged kernel
    (_merge_pieces)."""
    rows = slice(span.offset, span.offset + span.length)
    k, v = chunk_kv
    q_span = q[rows]
    # cuDNN reads [H, L, D] views of row-major [L, H, D] tensors; v is a strided view into the fused projection.
    pieces: list[_Piece] = [partial(dense_attention.dense_attention, q_span, k[rows].contiguous(), v[rows].contiguous(),
                                    True, scale)]
    pieces += [partial(dense_attention.dense_attention, q_span, kv.k[index], kv.v[index], False, scale)
               for index in prefix.blocks]
    continuations: list[_Pass] = []
    if prefix.partial is not None:
        table, offsets, first, count, span_positions = prefix.partial
        continuations.append(lambda prev, acc, lse: ops.paged_attention(
            q_span, span_positions, offsets, table, first, count, kv, scale, max_q_len=span.length, prev=prev,
            out=acc, out_lse=lse))
    _merge_pieces(out[rows], pieces, continuations)


def _merge_pieces(target: torch.Tensor, pieces: list[_Piece], continuations: list[_Pass]) -> None:
    """target (a span's rows of the output) = attention over the union of disjoint key ranges: the pieces (cuDNN
    calls, each returning its (out, lse)) merged in an fp32 accumulator (dense_attention.merge; a last merge writes
    target straight), then the continuations (paged passes over the keys left, each continuing the accumulator in
    place). The paged kernel reads and writes fp32 there as it always has (the variant warm-up compiled, none new
    to compile while serving), and target takes the result once."""
    acc, lse = pieces[0]()
    for n, piece in enumerate(pieces[1:], start=1):
        part, part_lse = piece()
        last = n == len(pieces) - 1 and not continuations
        into = target if last else acc if acc.dtype == torch.float32 else torch.empty_like(acc, dtype=torch.float32)
        dense_attention.merge(acc, lse, part, part_lse, into, lse)
        acc = into
    if not continuations:
        if len(pieces) == 1:
            target.copy_(acc)
        return
    if acc.dtype != torch.float32:
        acc = acc.float().contiguous()
    for run in continuations:
        acc, lse = run((acc, lse), acc, lse)
    target.copy_(acc)


def _block_passes(q, positions, offsets, table, kv: PagedKV, scale: float, max_q_len: int,
                  blocks: PrefixBlockIndex) -> list[_Pass]:
    """One pass per key block: dequantize its pages into the workspace (allocated here, O(block), reused by
    every block of this layer), then the dense kernel over it."""
    block = blocks.block_tokens
    shape = (blocks.workspace_rows * block, kv.num_kv_heads, kv.head_dim)
    k_ws, v_ws = q.new_empty(shape), q.new_empty(shape)
    dense = PagedKV("dense", k_ws, v_ws)

    def run(i: int) -> _Pass:
        def block_pass(prev, out, lse):
            ops.dequantize_block(kv, table, blocks.lens[i], blocks.ws_rows, i * block, block, k_ws, v_ws)
            return ops.paged_attention(q, positions, offsets, blocks.ws_table, blocks.starts[i], blocks.lens[i], dense,
                                       scale, max_q_len=max_q_len, prev=prev, out=out, out_lse=lse)
        return block_pass

    return [run(i) for i in range(len(blocks.lens))]


def _chain(passes: list[_Pass], q: torch.Tensor, last_in_fp32: bool = False) -> torch.Tensor:
    """Run the passes in order, each continuing the one before; all but the last write an fp32 accumulator (so
    the chain rounds once), the last writes the output in q's dtype, or (last_in_fp32) the accumulator too, copied
    to the output after it: the same rounding, and the last pass's kernels then write fp32 whatever the chain."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    acc = q.new_empty(q.shape, dtype=torch.float32) if len(passes) > 1 or last_in_fp32 else out
    prev = None
    for i, run in enumerate(passes):
        last = i == len(passes) - 1 and not last_in_fp32
        prev = run(prev, out if last else acc, lse)
    if last_in_fp32:
        out.copy_(acc)
    return out
