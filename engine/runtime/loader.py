"""Load a Hugging Face model directory: config.json + *.safetensors -> ModelConfig and a weight dict."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from headroom.engine.layers.gdn_projection import gdn_projection_shapes
from headroom.engine.models.config import ModelConfig, model_config_from_hf
from headroom.engine.plan.quant_format import WeightQuant
from safetensors.torch import load_file

# Checkpoint parts a text-only engine does not use (multimodal tower, multi-token prediction head).
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")
_NESTED_TEXT_PREFIX = "model.language_model."
# GPTQ's tensors of one linear (engine/runtime/gptq_layout.py), kept on the CPU until the last file is read.
GPTQ_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
# A quantized checkpoint's codes, scales and shapes keep their stored dtypes (never cast to the model dtype).
_QUANT_SUFFIXES = (".weight_scale_inv", ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape")


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


def load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device,
                 quant: WeightQuant | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the text model, named as in a *ForCausalLM checkpoint ('model.layers.0...', 'lm_head...').
    quant: the checkpoint's weight quantization; a GPTQ checkpoint's linears are read into the pack-quantized
    layout (engine/runtime/gptq_layout.py) on the CPU once every file is read, since the shards may split one
    linear's qweight, qzeros and scales between them."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model directory {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    gptq_parts: dict[str, torch.Tensor] = {}
    gptq = quant is not None and quant.layout != "pack-quantized"

    def place(name: str, tensor: torch.Tensor) -> None:
        keep = name.endswith(_QUANT_SUFFIXES) or tensor.dtype == torch.float8_e4m3fn
        weights[name] = tensor.to(device=device) if keep else tensor.to(device=device, dtype=dtype)

    for path in files:
        for name, tensor in load_file(str(path), device="cpu").items():
            if name.startswith(_IGNORED_PREFIXES):
                continue
            if name.startswith(_NESTED_TEXT_PREFIX):
                name = "model." + name[len(_NESTED_TEXT_PREFIX):]
            if gptq and name.endswith(GPTQ_SUFFIXES):
                gptq_parts[name] = tensor
            else:
                place(name, tensor)
    if gptq_parts:
        from headroom.engine.runtime.gptq_layout import GPTQLayoutError, gptq_to_pack_quantized

        try:
            converted = gptq_to_pack_quantized(gptq_parts, quant)
        except GPTQLayoutError as exc:
            raise WeightError(str(exc)) from None
        for name, tensor in converted.items():
            place(name, tensor)
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
    if config.weight_quant is not None:
        shapes = quantized_shapes(shapes, config.weight_quant)
    return shapes


def _is_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Every 2-D '.weight' but the embedding is a Linear layer's (norms are 1-D, conv1d 3-D)."""
    return name.endswith(".weight") and len(shape) == 2 and name != "model.embed_tokens.weight"


def quantized_shapes(shapes: dict[str, tuple[int, ...]], quant: WeightQuant) -> dict[str, tuple[int, ...]]:
    """Dense tensor shapes -> the checkpoint's: each quantized linear's codes and scales (kernels/quant_weight.py)."""
    out: dict[str, tuple[int, ...]] = {}
    bn, bk = quant.block
    for name, shape in shapes.items():
        module = name[: -len(".weight")]
        if not (_is_linear(name, shape) and quant.is_quantized(module)):
            out[name] = shape
            continue
        n, k = shape
        if quant.method == "fp8_block":
            out[name] = shape
            out[module + ".weight_scale_inv"] = (-(-n // bn), -(-k // bk))
            continue
        out[module + ".weight_packed"] = (n, -(-k // 8))
        out[module + ".weight_scale"] = (n, -(-k // bk))
        out[module + ".weight_shape"] = (2,)
        if not quant.symmetric:
            out[module + ".weight_zero_point"] = (-(-n // 8), -(-k // bk))
    return out


def _dtype_problems(config: ModelConfig, weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Quantized parts in the dtype their format fixes, dense linears not stored quantized, weight_shape right."""
    problems = []
    dense: dict[str, tuple[int, ...]] | None = None
    for name, shape in expected.items():
        tensor = weights.get(name)
        if tensor is None:
            continue
        if name.endswith((".weight_packed", ".weight_zero_point")) and tensor.dtype != torch.int32:
            problems.append(f"{name} is {tensor.dtype}, not int32")
        elif name.endswith(".weight") and _is_linear(name, shape) and name[:-7] + ".weight_scale_inv" in expected:
            if tensor.dtype != torch.float8_e4m3fn:
                problems.append(f"{name} is {tensor.dtype}, not float8_e4m3fn as quantization_config says")
        elif name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            problems.append(f"{name} is float8_e4m3fn but quantization_config leaves it unquantized (ignore list)")
        elif name.endswith(".weight_shape"):
            if dense is None:
                dense = expected_shapes(replace(config, weight_quant=None))
            want = dense[name[: -len("_shape")]]
            if tuple(int(v) for v in tensor.tolist()) != want:
                problems.append(f"{name} holds {tensor.tolist()}, not {list(want)}")
    return problems


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
    wrong += _dtype_problems(config, weights, expected)
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if wrong:
            parts.append(f"mis-shaped or mis-typed tensors: {'; '.join(wrong[:8])}")
        raise WeightError(f"{config.architecture} checkpoint does not fit its config.json: " + " | ".join(parts))
