"""One tensor-parallel rank's weights, read straight from the safetensors files as slices (no rank ever
holds the whole checkpoint). The rules follow the layouts the layers read (engine/layers/):

- rows (column-parallel, whole heads or channels): q_proj (per head [q, gate] rows), in_proj_z/b/a,
  dt_bias, A_log, gate_proj/up_proj of every MLP and expert; Qwen3-Next's in_proj_qkvz / in_proj_ba,
  whose rows are grouped per key head (engine/layers/gdn_projection.py), so a contiguous share is whole
  key-head groups with their value heads.
- segments: Qwen3.5's in_proj_qkv and every conv1d are q | k | v channels; each segment is split alike.
- kv: k_proj / v_proj by KV head; with fewer KV heads than ranks, rank r replicates head r * heads // size.
- cols (row-parallel, all-reduced after): o_proj, out_proj, down_proj. Their biases stay on rank 0 only.
- vocab: embed_tokens and lm_head rows, the last shard zero-padded.
- replicated: norms, the MoE router and the shared-expert gate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from headroom.engine.models.config import ModelConfig
from headroom.engine.runtime.loader import WeightError, canonical_name
from headroom.engine.runtime.parallel import vocab_rows
from safetensors import safe_open

_ROWS = ("q_proj.weight", "q_proj.bias", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
         "in_proj_qkvz.weight", "in_proj_ba.weight", "gate_proj.weight", "up_proj.weight", "dt_bias", "A_log")
_COLS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
_KV = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
_SEGMENTS = ("in_proj_qkv.weight", "conv1d.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_ROW_PARALLEL_BIASES = ("o_proj.bias",)
_REPLICATED = ("norm.weight", "layernorm.weight", "mlp.gate.weight", "shared_expert_gate.weight")

# (safetensors slice, rank, size) -> this rank's tensor
Rule = Callable[[Any, int, int], torch.Tensor]


def _share(length: int, rank: int, size: int) -> slice:
    part = length // size
    return slice(rank * part, (rank + 1) * part)


def _rows(view: Any, rank: int, size: int) -> torch.Tensor:
    return view[_share(view.get_shape()[0], rank, size)]


def _cols(view: Any, rank: int, size: int) -> torch.Tensor:
    return view[:, _share(view.get_shape()[1], rank, size)]


def _replicated(view: Any, rank: int, size: int) -> torch.Tensor:
    return view[:]


def _segments(config: ModelConfig) -> Rule:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim

    def rule(view: Any, rank: int, size: int) -> torch.Tensor:
        parts, offset = [], 0
        for length in (key_dim, key_dim, value_dim):
            share = _share(length, rank, size)
            parts.append(view[offset + share.start : offset + share.stop])
            offset += length
        return torch.cat(parts)

    return rule


def _kv(config: ModelConfig) -> Rule:
    heads, head_dim = config.num_kv_heads, config.head_dim

    def rule(view: Any, rank: int, size: int) -> torch.Tensor:
        if heads >= size:
            return _rows(view, rank, size)
        head = rank * heads // size
        return view[head * head_dim : (head + 1) * head_dim]

    return rule


def _vocab(config: ModelConfig) -> Rule:
    def rule(view: Any, rank: int, size: int) -> torch.Tensor:
        rows = vocab_rows(config.vocab_size, size)
        shard = view[rank * rows : min((rank + 1) * rows, config.vocab_size)]
        if shard.shape[0] == rows:
            return shard
        return torch.cat((shard, shard.new_zeros((rows - shard.shape[0], *shard.shape[1:]))))

    return rule


def shard_rule(name: str, config: ModelConfig, rank: int) -> Rule | None:
    """How rank slices tensor `name` (the full model's config); None: this rank does not hold it."""
    if name in _VOCAB:
        return _vocab(config)
    if name.endswith(_ROW_PARALLEL_BIASES):
        # Added once: the all-reduce after a row-parallel layer sums every rank's output.
        return _replicated if rank == 0 else None
    for suffixes, rule in ((_ROWS, _rows), (_COLS, _cols), (_KV, _kv(config)), (_SEGMENTS, _segments(config)),
                           (_REPLICATED, _replicated)):
        if name.endswith(suffixes):
            return rule
    raise WeightError(f"tensor {name!r} has no tensor-parallel sharding rule (engine/runtime/sharded_loader.py)")


def load_sharded_weights(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank's share of every text-model tensor, named as load_weights names them; config is the full model's."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model directory {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for stored in handle.keys():
                name = canonical_name(stored)
                rule = shard_rule(name, config, rank) if name is not None else None
                if name is None or rule is None:
                    continue
                weights[name] = rule(handle.get_slice(stored), rank, size).to(device=device, dtype=dtype)
    return weights
