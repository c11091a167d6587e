"""ModelConfig: what the engine's model code needs from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headroom.engine.models.moe_config import MoEConfigError, moe_fields_from_hf
from headroom.engine.plan.geometry import GeometryError, layer_types
from headroom.engine.plan.quant_format import QuantConfigError, WeightQuant, weight_quant_from_config

# architecture -> (family, whether the checkpoint nests the text model under model.language_model)
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_HYBRID_FAMILIES = ("qwen3_5", "qwen3_next")


class ModelConfigError(ValueError):
    """A config.json the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    # Qwen3.5 norms scale by (1 + w); Qwen3's by w.
    norm_unit_offset: bool
    # Qwen3.5 full attention: q_proj also yields a sigmoid output gate.
    attention_gate: bool
    tie_word_embeddings: bool
    torch_dtype: str
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Qwen3-Next sparse MoE MLP (moe_layers lists the layers that use it; the others are dense SwiGLU).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # Quantized linear weights (quantization_config); None: every weight in the model dtype.
    weight_quant: WeightQuant | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    @property
    def linear_conv_channels(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim


def _field(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ModelConfigError(f"config.json lacks the field {key!r} (architecture {cfg.get('architectures')})")
    return cfg[key]


def _rope(cfg: dict[str, Any], head_dim: int, default_partial: float) -> tuple[float, int]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelConfigError(f"config.json rope_type {rope_type!r} is not supported (only 'default')")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial)))
    return theta, int(head_dim * partial)


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Parse config.json; a ConditionalGeneration wrapper's text_config is unwrapped."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelConfigError(
            f"unsupported architectures {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    top = cfg
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "architectures": archs, "dtype": cfg.get("dtype", cfg["text_config"].get("dtype"))}
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        # Read before the text_config unwrap: a wrapper keeps quantization_config at its top level.
        weight_quant = weight_quant_from_config(top)
    except QuantConfigError as exc:
        raise ModelConfigError(str(exc)) from None
    hidden = int(_field(cfg, "hidden_size"))
    heads = int(_field(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    num_layers = int(_field(cfg, "num_hidden_layers"))
    hybrid = family in _HYBRID_FAMILIES
    if hybrid:
        # The planner's reading of the layer kinds, so the pools it sizes are the pools the model uses.
        try:
            types = layer_types(cfg, num_layers, family)
        except GeometryError as exc:
            raise ModelConfigError(str(exc)) from exc
    else:
        types = ["full_attention"] * num_layers
        if cfg.get("use_sliding_window"):
            raise ModelConfigError("config.json use_sliding_window=true is not supported")
    if len(types) != num_layers or set(types) - {"full_attention", "linear_attention"}:
        raise ModelConfigError(f"config.json layer_types {types} does not fit num_hidden_layers={num_layers}")
    theta, rotary_dim = _rope(cfg, head_dim, 0.25 if hybrid else 1.0)
    eos = cfg.get("eos_token_id")
    linear: dict[str, Any] = {}
    if hybrid:
        linear = {k: int(_field(cfg, k)) for k in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim",
        )}
    if family == "qwen3_next":
        if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
            raise ModelConfigError(
                f"config.json linear_num_value_heads={linear['linear_num_value_heads']} is not a multiple of "
                f"linear_num_key_heads={linear['linear_num_key_heads']}"
            )
        try:
            linear.update(moe_fields_from_hf(cfg, num_layers))
        except MoEConfigError as exc:
            raise ModelConfigError(str(exc)) from None
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=int(_field(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_field(cfg, "intermediate_size")),
        layer_types=tuple(types),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        norm_unit_offset=hybrid,
        attention_gate=hybrid,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
        eos_token_ids=tuple([eos] if isinstance(eos, int) else (eos or [])),
        weight_quant=weight_quant,
        **linear,
    )
