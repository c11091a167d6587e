"""Qwen3-Next's mixture-of-experts fields from config.json, validated, and which layers are sparse."""

from __future__ import annotations

from typing import Any


class MoEConfigError(ValueError):
    """A qwen3_next config.json whose expert fields do not fit together; the message names them."""


def _positive(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MoEConfigError(f"config.json field {key!r} must be a positive integer for qwen3_next, got {value!r}")
    return value


def moe_fields_from_hf(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelConfig's expert fields. A layer is sparse (MoE) unless it is in mlp_only_layers or
    (index + 1) is not a multiple of decoder_sparse_step; num_experts=0 makes every layer dense."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise MoEConfigError(f"config.json hidden_act {cfg.get('hidden_act')!r} is not supported (only 'silu')")
    num_experts = int(cfg.get("num_experts") or 0)
    if num_experts == 0:
        return {}
    top_k = _positive(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise MoEConfigError(f"config.json num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
    step = _positive({"decoder_sparse_step": 1, **cfg}, "decoder_sparse_step")
    dense_only = cfg.get("mlp_only_layers") or []
    bad = [i for i in dense_only if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise MoEConfigError(f"config.json mlp_only_layers has {bad}, outside 0..{num_layers - 1}")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if not isinstance(shared, int) or shared < 0:
        raise MoEConfigError(f"config.json shared_expert_intermediate_size must be >= 0, got {shared!r}")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_positive(cfg, "moe_intermediate_size"),
        shared_expert_intermediate_size=shared,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_layers=tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0),
    )
