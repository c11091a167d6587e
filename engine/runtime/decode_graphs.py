"""DecodeGraphs: CUDA graphs of decode-only passes (one new token per sequence), one graph per batch size.

Why: a decode step of a 32-layer hybrid model launches several hundred small kernels. Eagerly, the step
is bound by Python and launch overhead (44 ms at batch 1 on the H200, bench/results/gpu_engine_c.json)
while its GPU work is a few milliseconds. A graph replays the recorded launches in one call.

A graph reads every tensor at the address it was captured with. The per-pass index tensors the layers
ask ForwardBatch.cached() for are therefore given here as views of static buffers (ForwardBatch.is_static),
so the model code is the same in both modes. The KV slots of each running request live in a persistent
request-to-token table (the planner's `req_to_token_table` line): a request's slots are uploaded once,
when it first decodes through a graph, and each replay writes only the new token's slot.

Graphs are captured for every batch size 1..max_batch, exactly: padding a batch would need a scratch SSM
slot (about 50 MB for a 4B model) or would race in the in-place conv-state update of duplicated rows.
KIVI pools (int8/int4/int2) are graphed too: each running request's open page lives in a row of a static
window buffer (KVPool.residual_k/v), a replay writes each new token at its offset in the row, quantizes the
rows whose page that fills into the pool in the same pass (a kernel that skips the others), and attends over
the closed pages and the window rows with lengths taken from the positions on the device. Sparse MoE models
(Qwen3-Next) are not graphed: the router's choice gives data-dependent shapes.

Off the GPU (tests) the same static-buffer pass runs without capture, so everything but the capture
itself is checked on the CPU against the eager path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from headroom.engine.plan.engines.builtin import DECODE_GRAPH_MAX_BATCH
from headroom.engine.runtime.forward_batch import (
    GDN_BOUNDS,
    GDN_SLOTS,
    KIVI_WRITE,
    KV_WRITE_ROWS,
    LAST_ROWS,
    POOL_INDEX,
    WINDOW_INDEX,
    BatchItem,
    ForwardBatch,
    ItemSpan,
)
from headroom.engine.sequence import Sequence
from headroom.kernels.gdn_fla import wait_for_import
from headroom.kernels.host_copy import copy_into, to_device

if TYPE_CHECKING:
    from headroom.engine.runtime.model_runner import ModelRunner

# Rows of the static index buffer: one value per sequence of the pass.
_TOKEN, _POSITION, _WRITE_SLOT, _SSM_SLOT, _TABLE_ROW, _WINDOW_ROW = range(6)


@dataclass(frozen=True)
class CaptureReport:
    """What capture cost: batch sizes captured, seconds, and bytes the graphs' private memory pool holds."""

    batch_sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int
    # Device memory the capture took, torch's allocator and the driver's graph objects together.
    device_bytes: int = 0


@dataclass
class _TableRow:
    row: int
    uploaded: int  # positions 0..uploaded-1 of the request have their slot in the table
    # The request's num_shared_slots when uploaded: the radix cache re-points a shared prefix to the tree's
    # slots (CacheManager._publish, freeing the request's own), which always changes it.
    shared: int = 0


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, capture: bool | None = None):
        if runner.model_config.moe_layers:
            # The router's per-token expert choice gives data-dependent shapes, which a graph cannot record.
            raise ValueError("decode graphs cannot record a sparse MoE model (Qwen3-Next): set cuda_graph_max_batch=0")
        config = runner.config
        # The planner's graph reserve covers at most DECODE_GRAPH_MAX_BATCH graphs.
        limit = min(config.max_running_requests, config.max_total_tokens, DECODE_GRAPH_MAX_BATCH)
        if not 1 <= max_batch <= limit:
            raise ValueError(
                f"cuda_graph_max_batch={max_batch} must be in 1..{limit} (max_running_requests="
                f"{config.max_running_requests}; the plan reserves memory for at most {DECODE_GRAPH_MAX_BATCH} graphs)"
            )
        self.runner = runner
        self.max_batch = max_batch
        self.capture_graphs = runner.device.type == "cuda" if capture is None else capture
        device = runner.device
        # The request-to-token table: one row per running request, one int32 KV slot per position.
        self.table = torch.zeros((config.max_running_requests, config.context_length), dtype=torch.int32, device=device)
        self._free_rows = list(range(config.max_running_requests - 1, -1, -1))
        self._rows: dict[str, _TableRow] = {}
        self._index = torch.zeros((6, max_batch), dtype=torch.long, device=device)
        self._arange = torch.arange(max_batch + 1, device=device)
        self._page_arange = torch.arange(runner.kv_pool.page_tokens, device=device)
        self._offsets = self._arange.to(torch.int32)
        self._zeros = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # Placeholder spans: the layers read only their count and lengths in a static pass.
        self._spans = [ItemSpan(Sequence(f"decode-graph-row-{i}", [0]), i, 1, 0) for i in range(max_batch)]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # One output buffer for every graph: each graph's own logits would stay allocated in the pool.
        self._logits = torch.zeros((max_batch, runner.model_config.vocab_size), dtype=torch.float32, device=device)

    @property
    def leased_rows(self) -> int:
        return len(self._rows)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def can_run(self, items: list[BatchItem]) -> bool:
        """A decode-only pass of at most max_batch sequences whose table rows can be leased."""
        if not 1 <= len(items) <= self.max_batch or any(len(item.token_ids) != 1 or item.captures for item in items):
            return False
        if self.capture_graphs and len(items) not in self._graphs:
            return False
        missing = sum(item.seq.request_id not in self._rows for item in items)
        return missing <= len(self._free_rows)

    def release(self, seq: Sequence) -> None:
        """seq left the running set (finished, aborted, preempted): its table row is free again."""
        entry = self._rows.pop(seq.request_id, None)
        if entry is not None:
            self._free_rows.append(entry.row)

    def run(self, items: list[BatchItem], tokens_on_device: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Logits [len(items), vocab] fp32 of one decode pass (can_run(items) must hold); a fresh tensor,
        not the graph's output buffer, so callers may keep it across passes.
        tokens_on_device (tokens, rows): item i's input token is tokens[rows[i]], a device tensor the previous
        step sampled into and the host has not read (its item.token_ids are then placeholders); gathered on the
        device, in stream order, so this step is launched without waiting for that one."""
        size = len(items)
        columns = [[0] * size for _ in range(6)]
        kv_pool = self.runner.kv_pool
        for i, item in enumerate(items):
            seq = item.seq
            position = seq.num_computed_tokens
            entry = self._lease(seq, position)
            columns[_TOKEN][i] = item.token_ids[0]
            columns[_POSITION][i] = position
            columns[_WRITE_SLOT][i] = seq.kv_slots[position]
            columns[_SSM_SLOT][i] = seq.ssm_slot if seq.ssm_slot is not None else 0
            columns[_TABLE_ROW][i] = entry.row
            columns[_WINDOW_ROW][i] = kv_pool.residual_row(seq) if kv_pool.is_kivi else 0
            entry.uploaded = position + 1
        copy_into(self._index[:, :size], torch.tensor(columns, dtype=torch.long))
        if tokens_on_device is not None:
            tokens, rows = tokens_on_device
            source = tokens[:size] if rows == list(range(size)) else tokens[to_device(rows, torch.long, tokens.device)]
            self._index[_TOKEN, :size].copy_(source)
        if not self.capture_graphs:
            self._pass(size)
        else:
            self._graphs[size].replay()
        return self._logits[:size].clone()

    def _lease(self, seq: Sequence, position: int) -> _TableRow:
        """seq's table row with slots of positions 0..position-1 in it (uploads what an eager pass added)."""
        entry = self._rows.get(seq.request_id)
        if entry is None:
            entry = self._rows[seq.request_id] = _TableRow(self._free_rows.pop(), 0)
        if entry.shared != seq.num_shared_slots:
            # Re-pointed: the uploaded slots of its prefix may be freed and handed out again; upload them all.
            entry.uploaded, entry.shared = 0, seq.num_shared_slots
        if entry.uploaded != position:
            # Behind: eager passes decoded since; ahead (cannot happen while release() is called): redo all.
            start = entry.uploaded if entry.uploaded < position else 0
            slots = torch.tensor(seq.kv_slots[start:position], dtype=torch.int32)
            copy_into(self.table[entry.row, start:position], slots)
        return entry

    def _placeholders(self) -> None:
        """The static indices every captured size reads: token 0 at position 0 through KV slot, SSM slot, table
        row and window row i for sequence i."""
        self._index.zero_()
        for row in (_WRITE_SLOT, _SSM_SLOT, _TABLE_ROW, _WINDOW_ROW):
            self._index[row] = self._arange[: self.max_batch]

    def _pass(self, size: int) -> None:
        """The recorded work: write each token's slot into the table, then the model over static indices,
        its logits into the shared output buffer."""
        index = self._index[:, :size]
        positions, write_slots, rows = index[_POSITION], index[_WRITE_SLOT], index[_TABLE_ROW]
        self.table[rows, positions] = write_slots.to(torch.int32)
        indices: dict[str, Any] = {KV_WRITE_ROWS: write_slots, GDN_SLOTS: index[_SSM_SLOT], GDN_BOUNDS: self._arange[: size + 1],
                   LAST_ROWS: self._arange[:size]}
        kv_pool = self.runner.kv_pool
        if kv_pool.is_kivi:
            # Closed pages from the pool (page table: each page's first slot / page), the open one from the
            # sequence's window row; the step that fills a page closes it (KVPool.page_close, in the launch that stores the token) before attending.
            page, ends = kv_pool.page_tokens, positions + 1
            window_rows, left = index[_WINDOW_ROW], ends % page
            pages = torch.div(self.table[:, ::page][rows], page, rounding_mode="floor")
            indices[POOL_INDEX] = (pages, self._offsets[: size + 1], self._zeros[:size], (ends - left).to(torch.int32), 1)
            window_table = (window_rows[:, None] * page + self._page_arange[None, :]).to(torch.int32)
            indices[WINDOW_INDEX] = (window_table, left.to(torch.int32))
            closes = torch.where(left == 0, torch.div(write_slots, page, rounding_mode="floor"), -1)
            indices[KIVI_WRITE] = (window_rows * page + positions % page, window_rows, closes)
        else:
            indices[POOL_INDEX] = (self.table[rows], self._offsets[: size + 1], self._zeros[:size],
                                   (positions + 1).to(torch.int32), 1)
        batch = ForwardBatch(index[_TOKEN], positions, self._spans[:size], indices, is_static=True)
        runner = self.runner
        self._logits[:size].copy_(runner.model(batch, runner.kv_pool, runner.ssm_pool))

    def replay_seconds(self, size: int, repeats: int = 20) -> float:
        """Seconds per replay of the size's graph alone (GPU time, for benchmarks); re-runs the last pass of
        that size, so call it only when no request is running."""
        graph = self._graphs[size]
        graph.replay()
        torch.cuda.synchronize(self.runner.device)
        started = time.perf_counter()
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize(self.runner.device)
        return (time.perf_counter() - started) / repeats

    def capture(self, sizes: tuple[int, ...] | None = None) -> CaptureReport:
        """Capture every batch size (or only `sizes`: a benchmark timing one size's step), largest first so the
        smaller graphs reuse its memory.

        Call before any request runs: capture decodes placeholder tokens through KV slots and SSM slots
        0..max_batch-1, overwriting what they hold.
        """
        if sizes is not None and not all(1 <= size <= self.max_batch for size in sizes):
            raise ValueError(f"capture sizes {sizes} must be in 1..{self.max_batch} (max_batch)")
        if not self.capture_graphs:
            return CaptureReport((), 0.0, 0)
        started = time.perf_counter()
        device = self.runner.device
        torch.cuda.synchronize(device)
        # torch.cuda.graph empties the allocator's cache itself: do it first so the deltas are the graphs'.
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        free = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        # One side stream for every warm pass: cuBLAS keeps a workspace per stream it has run on (about
        # 37 MiB each on the H200), so a new stream per size cost that much per graph.
        side = torch.cuda.Stream(device)
        order = sorted(range(1, self.max_batch + 1) if sizes is None else set(sizes), reverse=True)
        if self.runner.compile_ahead is not None:
            # In the warm-up: every size's pass first runs dry, then what they met compiles on every core in one
            # round (kernels/compile_ahead.py), not a round a size (sizes differ in the GEMVs' row configurations
            # and specialisations, kernels/gemv.py NEAREST_ROWS).
            self._placeholders()
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.runner.compile_ahead.prepare(*(lambda size=size: self._pass(size) for size in order))
            torch.cuda.current_stream(device).wait_stream(side)
        # No other thread may call CUDA while a graph is captured (torch captures in its global mode, where another
        # thread's allocation invalidates the capture): fla's import ahead asks the driver about the device.
        wait_for_import()
        for size in order:
            self._placeholders()
            # One eager pass first (on a side stream, as torch asks) compiles and autotunes every kernel.
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._pass(size)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._pass(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        # The eager warm passes' blocks are cached, not the graphs': hand them back before measuring.
        torch.cuda.empty_cache()
        return CaptureReport(
            self.captured_sizes, time.perf_counter() - started, torch.cuda.memory_reserved(device) - reserved,
            free - torch.cuda.mem_get_info(device)[0],
        )
