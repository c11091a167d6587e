"""Load a Hugging Face model directory: config.json + *.safetensors -> ModelConfig and a weight dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from headroom.engine.layers.gdn_projection import gdn_projection_shapes
from headroom.engine.models.config import ModelConfig, model_config_from_hf
from safetensors.torch import load_file

# Checkpoint parts a text-only engine does not use (multimodal tower, multi-token prediction head).
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")
_NESTED_TEXT_PREFIX = "model.language_model."


class WeightError(ValueError):
    """Missing or mis-shaped tensors; the message names them."""


def load_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    return model_config_from_hf(json.loads(path.read_text()))


def canonical_name(name: str) -> str | None:
    """A checkpoint tensor's *ForCausalLM name ('model.layers.0...'), None for parts the engine skips."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith(_NESTED_TEXT_PREFIX):
        return "model." + name[len(_NESTED_TEXT_PREFIX):]
    return name


def load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """All tensors of the text model, named as in a *ForCausalLM checkpoint ('model.layers.0...', 'lm_head...')."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model directory {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(str(path), device="cpu").items():
            if name.startswith(_IGNORED_PREFIXES):
                continue
            if name.startswith(_NESTED_TEXT_PREFIX):
                name = "model." + name[len(_NESTED_TEXT_PREFIX):]
            weights[name] = tensor.to(device=device, dtype=dtype)
    return weights


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs (biases excluded: they are optional)."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(_mlp_shapes(config, i))
        if kind == "full_attention":
            q_out = config.num_heads * d * (2 if config.attention_gate else 1)
            shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
            shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * d, h)
            shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * d, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * d)
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        else:
            hv = config.linear_num_value_heads
            value_dim = hv * config.linear_value_head_dim
            conv = config.linear_conv_channels
            shapes.update({p + "linear_attn." + name: shape for name, shape in gdn_projection_shapes(config).items()})
            shapes[p + "linear_attn.conv1d.weight"] = (conv, 1, config.linear_conv_kernel_dim)
            shapes[p + "linear_attn.dt_bias"] = (hv,)
            shapes[p + "linear_attn.A_log"] = (hv,)
            shapes[p + "linear_attn.norm.weight"] = (config.linear_value_head_dim,)
            shapes[p + "linear_attn.out_proj.weight"] = (h, value_dim)
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (intermediate, hidden),
        prefix + "up_proj.weight": (intermediate, hidden),
        prefix + "down_proj.weight": (hidden, intermediate),
    }


def _mlp_shapes(config: ModelConfig, index: int) -> dict[str, tuple[int, ...]]:
    """Layer index's dense SwiGLU, or (Qwen3-Next MoE layers) router, experts and shared expert."""
    h, p = config.hidden_size, f"model.layers.{index}.mlp."
    if index not in config.moe_layers:
        return _swiglu_shapes(p, h, config.intermediate_size)
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (config.num_experts, h)}
    for e in range(config.num_experts):
        shapes.update(_swiglu_shapes(f"{p}experts.{e}.", h, config.moe_intermediate_size))
    if config.shared_expert_intermediate_size:
        shapes.update(_swiglu_shapes(p + "shared_expert.", h, config.shared_expert_intermediate_size))
        shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise WeightError naming every missing or mis-shaped tensor."""
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in weights]
    wrong = [
        f"{name}: {tuple(weights[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if wrong:
            parts.append(f"mis-shaped tensors: {'; '.join(wrong[:8])}")
        raise WeightError(f"{config.architecture} checkpoint does not fit its config.json: " + " | ".join(parts))
