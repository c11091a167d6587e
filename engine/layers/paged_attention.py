"""GPU attention of one mixed batch straight from the paged KV pool (no dense copy of any prefix).

Every sequence's closed pages are read by the paged kernel with dequantization fused; for KIVI the
open page (the full-precision residual window, positions closed..end-1) is one more pass. A KIVI chunk long
enough (kernels/paged_kv.py BLOCKWISE_MIN_ROWS) reads its prefix in blocks instead: each block of pages is
dequantized once into a dense workspace that the dense kernel reads, where the fused loads would dequantize
the whole prefix again in every query tile. The passes chain: each continues the online softmax of the one
before (paged_attention's prev), in an fp32 accumulator, and the last writes the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from headroom.engine.runtime.forward_batch import POOL_BLOCKS, POOL_INDEX, WINDOW_INDEX, ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.kernels import dense_attention, ops
from headroom.kernels.host_copy import to_device
from headroom.kernels.paged_kv import PagedKV, page_table, plan_prefix_blocks

# Spans of at least this many rows over a bf16 pool take the dense path (cuDNN; kernels/dense_attention.py): below
# it the paged kernel's share of a pass is small, and cuDNN's fixed cost is not worth a launch of its own.
DENSE_MIN_ROWS = 2048
# ForwardBatch cache keys: the paged kernel's key counts with the long spans' zeroed; a long span's prefix index.
DENSE_OTHERS = "dense_attention.others"
DENSE_PREFIX = "dense_attention.prefix"

# One pass over a key range: (prev (out, lse) or None, out, out_lse) -> (out, out_lse).
_Pass = Callable[[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
    chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [N, Hq, D] of the batch's flattened rows (K/V already stored) -> attention output [N, Hq, D].
    chunk_kv: the pass's own K/V [N, Hkv, D] (as stored); with them, long spans of a bf16 pool take the dense path
    (_long_span_attention)."""
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

    def pool_pass(lens: torch.Tensor) -> _Pass:
        return lambda prev, out, lse: ops.paged_attention(
            q, positions, offsets, table, zeros, lens, kv, scale, max_q_len=max_q_len, prev=prev, out=out, out_lse=lse)

    if not kv_pool.is_kivi:
        long = [i for i, s in enumerate(spans) if s.length >= DENSE_MIN_ROWS]
        if chunk_kv is None or batch.is_static or kv.kind != "dense" or not long \
                or not dense_attention.available(q, kv.num_kv_heads):
            return _chain([pool_pass(closed_t)], q)
        if len(long) == len(spans):
            out = torch.empty_like(q)
        else:
            # The other spans through the paged kernel; the long ones see no key there and are written below.
            others = batch.cached(DENSE_OTHERS, lambda: _int32([0 if i in long else n for i, n in enumerate(closed_keys())],
                                                               device))
            out = _chain([pool_pass(others)], q)
        for i in long:
            prefix = batch.cached(f"{DENSE_PREFIX}.{i}", lambda i=i: _DensePrefix.of(spans[i], device))
            _long_span_attention(q, positions, chunk_kv, spans[i], kv, scale, out, prefix)
        return out

    def window_index() -> tuple[torch.Tensor, torch.Tensor] | None:
        # Rows of the flattened window buffer [rows x page, H, D] holding each sequence's open page; every
        # layer's windows hold the same positions, so one table serves the pass.
        lens = [s.end % page for s in spans]
        if not any(lens):
            return None
        rows = [kv_pool.residual_row(s.seq) * page for s in spans]
        return page_table([list(range(r, r + n)) for r, n in zip(rows, lens, strict=True)], 1, device), _int32(lens, device)

    group = q.shape[1] // kv.num_kv_heads
    blocks = None if batch.is_static else batch.cached(
        POOL_BLOCKS, lambda: _prefix_blocks(batch, closed_keys(), kv, group, device))
    passes: list[_Pass] = []
    if blocks is None:
        passes.append(pool_pass(closed_t))
    else:
        if blocks.direct_lens is not None:
            passes.append(pool_pass(blocks.direct_lens))
        passes += _block_passes(q, positions, offsets, table, kv, scale, max_q_len, blocks)
    index = batch.cached(WINDOW_INDEX, window_index)
    if index is not None:
        window_table, window_lens = index
        window = PagedKV("dense", kv_pool.residual_k[layer].flatten(0, 1), kv_pool.residual_v[layer].flatten(0, 1))
        passes.append(lambda prev, out, lse: ops.paged_attention(
            q, positions, offsets, window_table, closed_t, window_lens, window, scale, max_q_len=max_q_len,
            prev=prev, out=out, out_lse=lse))
    return _chain(passes, q)


@dataclass(frozen=True)
class _DensePrefix:
    """Device side of a long span's prefix, the same in every layer of the pass (built once, ForwardBatch-cached):
    the pool rows of each whole PREFIX_BLOCK, and the paged kernel's table and bounds over the partial block."""

    blocks: list[torch.Tensor]
    partial: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, span, device: torch.device) -> _DensePrefix:
        block = dense_attention.PREFIX_BLOCK
        whole = span.start - span.start % block
        slots = span.seq.kv_slots
        blocks = [to_device(slots[first : first + block], torch.long, device) for first in range(0, whole, block)]
        partial = None if whole == span.start else (
            page_table([slots[whole : span.start]], 1, device), _int32([0, span.length], device),
            _int32([whole], device), _int32([span.start - whole], device))
        return cls(blocks, partial)


def _long_span_attention(q: torch.Tensor, positions: torch.Tensor, chunk_kv: tuple[torch.Tensor, torch.Tensor], span,
                         kv: PagedKV, scale: float, out: torch.Tensor, prefix: _DensePrefix) -> None:
    """One long span's rows of out (kernels/dense_attention.py says why): its causal block over its own K/V and
    its prefix in full PREFIX_BLOCKs through cuDNN, the prefix's last partial block through the paged kernel,
    merged in an fp32 accumulator (dense_attention.merge), the last merge written straight into out's rows."""
    rows = slice(span.offset, span.offset + span.length)
    k, v = chunk_kv
    q_span, target = q[rows], out[rows]
    # cuDNN reads [H, L, D] views of row-major [L, H, D] tensors; v is a strided view into the fused projection.
    diagonal, lse = dense_attention.dense_attention(q_span, k[rows].contiguous(), v[rows].contiguous(), True, scale)
    if span.start == 0:
        target.copy_(diagonal)
        return
    # The running result: cuDNN's bf16 diagonal, then an fp32 accumulator; the last merge writes out's rows.
    acc = diagonal
    for n, index in enumerate(prefix.blocks):
        part, part_lse = dense_attention.dense_attention(q_span, kv.k[index], kv.v[index], False, scale)
        last = n == len(prefix.blocks) - 1 and prefix.partial is None
        into = target if last else acc if acc.dtype == torch.float32 else torch.empty_like(acc, dtype=torch.float32)
        dense_attention.merge(acc, lse, part, part_lse, into, lse)
        acc = into
    if prefix.partial is not None:
        # The paged kernel continues the result over the partial block's keys (all before every row), reading and
        # writing fp32 as it always has: the variant warm-up compiled, none new to compile while serving.
        if acc.dtype != torch.float32:
            acc = acc.float().contiguous()
        table, offsets, first, count = prefix.partial
        ops.paged_attention(q_span, positions[rows], offsets, table, first, count, kv, scale, max_q_len=span.length,
                            prev=(acc, lse), out=acc, out_lse=lse)
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


def _chain(passes: list[_Pass], q: torch.Tensor) -> torch.Tensor:
    """Run the passes in order, each continuing the one before; all but the last write an fp32 accumulator (so
    the chain rounds once), the last writes the output in q's dtype."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    acc = q.new_empty(q.shape, dtype=torch.float32) if len(passes) > 1 else out
    prev = None
    for i, run in enumerate(passes):
        last = i == len(passes) - 1
        prev = run(prev, out if last else acc, lse)
    return out
