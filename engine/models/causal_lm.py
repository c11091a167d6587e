"""The decoder stack shared by Qwen3 (all full attention), Qwen3.5 (Gated DeltaNet + gated attention)
and Qwen3-Next (Qwen3.5's mixers with fused GDN projections and sparse MoE MLPs)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from headroom.engine.layers.attention import FullAttention
from headroom.engine.layers.linear import linear, linear_weight
from headroom.engine.layers.linear_attention import GatedDeltaNet
from headroom.engine.layers.mlp import SwiGLU
from headroom.engine.layers.moe import SparseMoE
from headroom.engine.layers.residual import Projection, add_and_norm, as_tensor, deferred, take_rows
from headroom.engine.models.config import ModelConfig
from headroom.engine.runtime.forward_batch import ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.engine.runtime.loader import check_weights
from headroom.engine.runtime.parallel import TensorParallel, vocab_parallel_embedding
from headroom.engine.runtime.ssm_pool import SSMPool


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], index: int, pool_layer: int,
                 tp: TensorParallel | None = None):
        prefix = f"model.layers.{index}."
        self.config = config
        self.tp = tp
        self.is_linear = config.layer_types[index] == "linear_attention"
        self.mixer: FullAttention | GatedDeltaNet
        if self.is_linear:
            self.mixer = GatedDeltaNet(config, weights, prefix + "linear_attn.", pool_layer)
        else:
            self.mixer = FullAttention(config, weights, prefix + "self_attn.", pool_layer)
        self.input_norm = weights[prefix + "input_layernorm.weight"]
        self.post_norm = weights[prefix + "post_attention_layernorm.weight"]
        self.mlp: SwiGLU | SparseMoE
        if index in config.moe_layers:
            self.mlp = SparseMoE(config, weights, prefix + "mlp.")
        else:
            self.mlp = SwiGLU(config, weights, prefix + "mlp.")

    def __call__(
        self, x: torch.Tensor, delta: torch.Tensor | Projection | None, batch: ForwardBatch, kv_pool: KVPool | None,
        ssm_pool: SSMPool | None,
    ) -> tuple[torch.Tensor, torch.Tensor | Projection]:
        """(residual x, the previous layer's MLP output or None) [N, hidden] -> the same pair for the next layer.
        The residual add is left to the next norm (layers/residual.py add_and_norm), and a module's output
        projection to that add (a Projection), so that decode runs both in the GEMVs around them."""
        cfg = self.config
        reduce = None if self.tp is None else self.tp.all_reduce
        h, x = add_and_norm(x, delta, self.input_norm, cfg.rms_norm_eps, cfg.norm_unit_offset, reduce)
        if isinstance(self.mixer, GatedDeltaNet):
            assert ssm_pool is not None
            out = self.mixer(h, batch, ssm_pool)
        else:
            assert kv_pool is not None
            out = self.mixer(h, batch, kv_pool)
        h, x = add_and_norm(x, out, self.post_norm, cfg.rms_norm_eps, cfg.norm_unit_offset, reduce)
        del out  # (the mixer's output, or the inputs of its projection: not held through the MLP)
        if isinstance(self.mlp, SwiGLU):
            return x, deferred(self.mlp.projection(h))
        return x, self.mlp(as_tensor(h))


class CausalLM:
    """Weights as plain tensors; __call__ runs one ForwardBatch and returns each item's last-position logits.

    With tp, config and weights are one rank's share (engine/runtime/parallel.py) and the logits are the
    rank's vocabulary columns."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tp: TensorParallel | None = None):
        check_weights(config, weights)
        self.config = config
        self.tp = tp
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else linear_weight(config, weights, "lm_head")
        full, linear_layers = config.full_attention_layers, config.linear_attention_layers
        self.layers = []
        for i in range(config.num_layers):
            self.layers.append(
                DecoderLayer(config, weights, i, linear_layers.index(i) if i in linear_layers else full.index(i), tp))
            if self.embed.is_cuda:
                # The layer merged its projections (layers/linear.py's MergedLinear): hand the parts' memory
                # back now, or the cached blocks would add up to most of the weights again before the pools.
                torch.cuda.empty_cache()

    @torch.inference_mode()
    def __call__(
        self, batch: ForwardBatch, kv_pool: KVPool | None, ssm_pool: SSMPool | None, all_positions: bool = False,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """-> logits (fp32) [num_items, vocab] at each item's last token, or [num_tokens, vocab] if all_positions.
        between_layers() runs after every layer but the last (another pass may run there: engine/loop/step.py)."""
        x = vocab_parallel_embedding(batch.token_ids, self.embed, self.tp)
        delta = None
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            x, delta = layer(x, delta, batch, kv_pool, ssm_pool)
            if between_layers is not None and index < last:
                between_layers()
        assert delta is not None, "a model has at least one layer"
        cfg = self.config
        reduce = None if self.tp is None else self.tp.all_reduce
        if all_positions or batch.is_decode_only:
            # (a decode pass's last rows are all its rows, in order)
            last, _ = add_and_norm(x, delta, self.final_norm, cfg.rms_norm_eps, cfg.norm_unit_offset, reduce)
        elif isinstance(delta, Projection) and reduce is None:
            # A short pass (residual.deferred left its projection) adds and norms in the GEMVs as a decode step of
            # its rows does (the same kernel variants, so a short prompt compiles nothing the warm-up's steps did
            # not), then takes its last rows.
            last, _ = add_and_norm(x, delta, self.final_norm, cfg.rms_norm_eps, cfg.norm_unit_offset)
            last = take_rows(last, batch.last_rows)
        else:
            if isinstance(delta, Projection):
                delta = delta.run()
            if reduce is not None:
                delta = reduce(delta)  # every row, as before the fusion (the collective's size and order)
            last, _ = add_and_norm(x[batch.last_rows], delta[batch.last_rows], self.final_norm, cfg.rms_norm_eps,
                                   cfg.norm_unit_offset)
        return linear(last, self.lm_head).float()
