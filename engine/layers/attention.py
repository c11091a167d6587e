"""Full attention over the KV pool: q/k RMSNorm, (partial) rotary, optional sigmoid output gate (Qwen3.5)."""

from __future__ import annotations

import torch
from headroom.engine.layers.linear import MergedLinear, linear_weight
from headroom.engine.layers.normed_rows import NormedRows
from headroom.engine.layers.paged_attention import paged_attention_over_pool
from headroom.engine.layers.residual import Projection, deferred
from headroom.engine.models.config import ModelConfig
from headroom.engine.runtime.forward_batch import KIVI_WRITE, KV_WRITE_ROWS, ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.kernels import ops
from headroom.kernels.host_copy import to_device


class FullAttention:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, pool_layer: int):
        self.config = config
        self.pool_layer = pool_layer
        biases = [weights.get(prefix + name + ".bias") for name in ("q_proj", "k_proj", "v_proj")]
        self.qkv = MergedLinear(config, weights, [prefix + "q_proj", prefix + "k_proj", prefix + "v_proj"], biases)
        self.o_proj = linear_weight(config, weights, prefix + "o_proj")
        self.o_bias = weights.get(prefix + "o_proj.bias")
        self.q_norm = weights[prefix + "q_norm.weight"]
        self.k_norm = weights[prefix + "k_norm.weight"]
        self.inv_freq = ops.rotary_inv_freq(config.rotary_dim, config.rope_theta).to(self.qkv.device)
        self.scale = config.head_dim**-0.5

    def __call__(self, x: torch.Tensor | NormedRows, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor | Projection:
        """x [N, hidden] -> [N, hidden], or at decode the o_proj still to run (residual.deferred: the decoder layer
        adds it to the residual in its GEMV); writes this layer's K/V of every item into the pool first."""
        cfg = self.config
        n = x.shape[0]
        q, k, v = self.qkv(x)
        gate = None
        if cfg.attention_gate:
            # Strided [N, H, D] views; the fused norm/rotary and gate kernels read them without a copy.
            q, gate = q.view(n, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = q.reshape(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        kivi_step = kv_pool.is_kivi and batch.is_static
        if kv_pool.stores_rows_as_is or kivi_step:
            # Both norms, the rotary and the two row stores in one launch: into a bf16 pool's rows, or into the
            # residual windows of a graphed KIVI decode step (then the pages that step fills are closed), where
            # two norms and two indexed writes were three launches a layer more (an int2 step 0.2 ms slower than a
            # bf16 one at 256 tokens of context on the H200, session 16).
            close = None
            if kivi_step:
                slots, rows, close_pages = batch.cached(KIVI_WRITE, _no_static_index)
                pool_k, pool_v = kv_pool.window_slots(self.pool_layer)
                close = kv_pool.page_close(self.pool_layer, rows, close_pages)
            else:
                store = kv_pool.layers[self.pool_layer]
                pool_k, pool_v = store["k"], store["v"]
                slots = batch.cached(KV_WRITE_ROWS, lambda: _write_rows(batch, x.device))
            # (a KIVI step's page close in the same launch: kernels/kv_quant_triton.py quantize_page)
            q, k = ops.qk_norm_rotary_store(q, k, v, self.q_norm, self.k_norm, cfg.rms_norm_eps, cfg.norm_unit_offset,
                                            batch.positions, self.inv_freq, pool_k, pool_v, slots, close=close)
        else:
            q = ops.rms_norm_rotary(q, self.q_norm, cfg.rms_norm_eps, cfg.norm_unit_offset, batch.positions, self.inv_freq)
            k = ops.rms_norm_rotary(k, self.k_norm, cfg.rms_norm_eps, cfg.norm_unit_offset, batch.positions, self.inv_freq)
            self._store(k, v, batch, kv_pool)
        if q.is_cuda or batch.is_static:
            # A graphed decode step's gate goes into the attention's split merge (a launch less a layer).
            fused_gate = gate if batch.is_static else None
            out = paged_attention_over_pool(q, batch, kv_pool, self.pool_layer, self.scale, (k, v), fused_gate)
            if fused_gate is not None:
                gate = None
        else:
            out = torch.empty_like(q)
            for span in batch.spans:
                rows = slice(span.offset, span.offset + span.length)
                k_ctx, v_ctx = kv_pool.context(self.pool_layer, span.seq, span.end)
                out[rows] = ops.prefix_attention(q[rows], k_ctx, v_ctx, batch.positions[rows], self.scale)
        attn = out.reshape(n, -1)
        if gate is not None:
            attn = ops.sigmoid_mul(attn, gate)
        return deferred(Projection(attn, self.o_proj, self.o_bias))

    def _store(self, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, kv_pool: KVPool) -> None:
        """This layer's K/V of every item into an fp8 or KIVI pool."""
        if kv_pool.is_kivi:
            # Whole pages are quantized; each sequence's open page stays in its residual window.
            for span in batch.spans:
                rows = slice(span.offset, span.offset + span.length)
                kv_pool.store(self.pool_layer, span.seq, span.start, k[rows], v[rows])
        else:
            kv_pool.write_rows(self.pool_layer, batch.cached(KV_WRITE_ROWS, lambda: _write_rows(batch, k.device)), k, v)


def _write_rows(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """The pool row of every token of the pass, int64 [N] (a graphed pass's comes from DecodeGraphs)."""
    return to_device([slot for s in batch.spans for slot in s.seq.kv_slots[s.start:s.end]], torch.long, device)


def _no_static_index() -> None:
    raise RuntimeError("a static KIVI pass needs its window index (KIVI_WRITE) from DecodeGraphs")
