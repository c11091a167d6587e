"""GPU attention of one mixed batch straight from the paged KV pool (no dense copy of any prefix).

Every sequence's closed pages are read by the paged kernel with dequantization fused; for KIVI the
open page (the full-precision residual window, positions closed..end-1) is a second, small pass, and
the two are merged by log-sum-exp.
"""

from __future__ import annotations

import torch
from headroom.engine.runtime.forward_batch import POOL_INDEX, WINDOW_INDEX, ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.kernels import ops
from headroom.kernels.host_copy import to_device
from headroom.kernels.paged_kv import PagedKV, page_table


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.int32, device)


def paged_attention_over_pool(
    q: torch.Tensor, batch: ForwardBatch, kv_pool: KVPool, layer: int, scale: float
) -> torch.Tensor:
    """q [N, Hq, D] of the batch's flattened rows (K/V already stored) -> attention output [N, Hq, D]."""
    spans, device, page = batch.spans, q.device, kv_pool.page_tokens

    def pool_index() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        # KIVI pool keys end at each sequence's last whole page; the rest is its residual window.
        closed = [s.end - s.end % page if kv_pool.is_kivi else s.end for s in spans]
        table = page_table([s.seq.kv_slots[:c] for s, c in zip(spans, closed, strict=True)], page, device)
        offsets = _int32([0] + [s.offset + s.length for s in spans], device)
        max_q_len = max(s.length for s in spans)
        return table, offsets, _int32([0] * len(spans), device), _int32(closed, device), max_q_len

    table, offsets, zeros, closed_t, max_q_len = batch.cached(POOL_INDEX, pool_index)
    kv = PagedKV.from_store(kv_pool.layers[layer], kv_pool.kv_dtype, kv_pool.bits, page, kv_pool.value_group)
    out, lse = ops.paged_attention(
        q, batch.positions, offsets, table, zeros, closed_t, kv, scale, max_q_len=max_q_len
    )
    if not kv_pool.is_kivi:
        return out

    def window_index() -> tuple[torch.Tensor, torch.Tensor] | None:
        # Rows of the flattened window buffer [rows x page, H, D] holding each sequence's open page; every
        # layer's windows hold the same positions, so one table serves the pass.
        lens = [s.end % page for s in spans]
        if not any(lens):
            return None
        rows = [kv_pool.residual_row(s.seq) * page for s in spans]
        return page_table([list(range(r, r + n)) for r, n in zip(rows, lens, strict=True)], 1, device), _int32(lens, device)

    index = batch.cached(WINDOW_INDEX, window_index)
    if index is None:
        return out
    window_table, window_lens = index
    window = PagedKV("dense", kv_pool.residual_k[layer].flatten(0, 1), kv_pool.residual_v[layer].flatten(0, 1))
    out_window, lse_window = ops.paged_attention(
        q, batch.positions, offsets, window_table, closed_t, window_lens, window, scale, max_q_len=max_q_len,
    )
    merged, _ = ops.merge_two(out, lse, out_window, lse_window)
    return merged
