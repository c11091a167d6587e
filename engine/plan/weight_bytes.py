"""Weight bytes from shapes when no safetensors headers are at hand (a config.json in a ConfigMap): every linear
layer at its stored format's bytes (codes plus scales, zero points), everything else in the model dtype.
With headers, geometry.safetensors_weight_bytes measures the real tensors instead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from headroom.engine.plan.quant_format import WeightQuant

if TYPE_CHECKING:
    from headroom.engine.plan.geometry import ModelGeometry

# (module name, out features, in features, how many alike) of Linear layers; the experts of one layer come as
# expert 0 times num_experts, so that a 512-expert model prices in well under the planner's 100 ms.
Linear = tuple[str, int, int, int]


def _swiglu(prefix: str, hidden: int, inter: int, count: int = 1) -> list[Linear]:
    return [(prefix + "gate_proj", inter, hidden, count), (prefix + "up_proj", inter, hidden, count),
            (prefix + "down_proj", hidden, inter, count)]


def linear_modules(g: ModelGeometry) -> Iterator[Linear]:
    """Every Linear of the text model, named as in the checkpoint ('model.layers.3.mlp.up_proj')."""
    h, d = g.hidden_size, g.head_dim
    key_dim, value_dim = g.linear_num_key_heads * g.linear_key_head_dim, g.linear_num_value_heads * g.linear_value_head_dim
    conv = 2 * key_dim + value_dim
    kinds = g.layer_types or ("full_attention",) * g.num_layers
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        if kind == "full_attention":
            q_out = g.num_attention_heads * d * (2 if g.has_attention_gate else 1)
            yield from [(p + "self_attn.q_proj", q_out, h, 1), (p + "self_attn.k_proj", g.num_kv_heads * d, h, 1),
                        (p + "self_attn.v_proj", g.num_kv_heads * d, h, 1),
                        (p + "self_attn.o_proj", h, g.num_attention_heads * d, 1)]
        elif g.model_type == "qwen3_next":
            yield from [(p + "linear_attn.in_proj_qkvz", conv + value_dim, h, 1),
                        (p + "linear_attn.in_proj_ba", 2 * g.linear_num_value_heads, h, 1),
                        (p + "linear_attn.out_proj", h, value_dim, 1)]
        else:
            hv = g.linear_num_value_heads
            yield from [(p + "linear_attn.in_proj_qkv", conv, h, 1), (p + "linear_attn.in_proj_z", value_dim, h, 1),
                        (p + "linear_attn.in_proj_b", hv, h, 1), (p + "linear_attn.in_proj_a", hv, h, 1),
                        (p + "linear_attn.out_proj", h, value_dim, 1)]
        if g.num_experts:
            # Every layer sparse, as estimated_parameter_count assumes (config.json's sparse-step is not kept).
            yield (p + "mlp.gate", g.num_experts, h, 1)
            yield from _swiglu(f"{p}mlp.experts.0.", h, g.moe_intermediate_size, g.num_experts)
            if g.shared_expert_intermediate_size:
                yield from _swiglu(p + "mlp.shared_expert.", h, g.shared_expert_intermediate_size)
                yield (p + "mlp.shared_expert_gate", 1, h, 1)
        else:
            yield from _swiglu(p + "mlp.", h, g.intermediate_size)
    if not g.tie_word_embeddings:
        yield ("lm_head", g.vocab_size, h, 1)


def quantized_linear_bytes(quant: WeightQuant, n: int, k: int, scale_bytes: int) -> int:
    """Bytes of one quantized [n, k] linear as the checkpoint stores it (kernels/quant_weight.py's layout)."""
    bn, bk = quant.block
    if quant.method == "fp8_block":
        return n * k + -(-n // bn) * -(-k // bk) * 4
    groups = -(-k // bk)
    if quant.layout != "pack-quantized":
        # GPTQ stores zero points for symmetric groups too, and g_idx (int32 per input); no weight_shape.
        return n * -(-k // 8) * 4 + n * groups * scale_bytes + groups * -(-n // 8) * 4 + k * 4
    zero = 0 if quant.symmetric else -(-n // 8) * groups * 4
    # weight_shape: two int64.
    return n * -(-k // 8) * 4 + n * groups * scale_bytes + zero + 16


def estimated_weight_bytes(g: ModelGeometry, quant: WeightQuant | None) -> int:
    """Whole-model weight bytes from shapes: dense parameters at dtype_bytes, quantized linears at their format's."""
    total_params = g.estimated_parameter_count()
    if quant is None:
        return total_params * g.dtype_bytes
    linear_params, quantized = 0, 0
    for name, n, k, count in linear_modules(g):
        if quant.is_quantized(name):
            linear_params += n * k * count
            quantized += quantized_linear_bytes(quant, n, k, g.dtype_bytes) * count
    return (total_params - linear_params) * g.dtype_bytes + quantized


def largest_quantized_linear_params(g: ModelGeometry, quant: WeightQuant | None) -> int:
    """Weights of the widest quantized linear (0 if none): what one dequantized-for-prefill copy holds."""
    if quant is None:
        return 0
    return max((n * k for name, n, k, _ in linear_modules(g) if quant.is_quantized(name)), default=0)
