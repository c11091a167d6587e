"""Model geometry from a Hugging Face config.json: what the memory ledger needs, nothing more."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from headroom.engine.plan.quant_format import QuantConfigError, WeightQuant, weight_quant_from_config
from headroom.engine.plan.weight_bytes import estimated_weight_bytes

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_5_text", "qwen3_5", "qwen3_next")

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


class GeometryError(ValueError):
    """A config.json or model directory the planner cannot use; the message names the field."""


@dataclass(frozen=True)
class ModelGeometry:
    """Shapes of one model, whole (not per GPU). Byte counts are in bytes."""

    model_type: str
    num_layers: int
    num_full_attention_layers: int
    num_linear_attention_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # Gated DeltaNet (linear attention); zero for a full-attention-only model.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Mixture of experts (qwen3_next); zero experts means a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    has_attention_gate: bool = False
    max_position_embeddings: int = 32768
    dtype_bytes: int = 2
    # Measured from safetensors headers or given by the user; None means estimate from shapes.
    weight_bytes: int | None = None
    # Each layer's kind (full_attention / linear_attention); empty for a full-attention-only model.
    layer_types: tuple[str, ...] = ()
    # How the checkpoint stores its linear weights (quantization_config); None: the model dtype.
    weight_quant: WeightQuant | None = None

    @property
    def weight_format(self) -> str:
        """The weights' storage as the plan reports it ('bf16', 'fp8 e4m3, 128x128 blocks', ...)."""
        if self.weight_quant is not None:
            return self.weight_quant.label
        return {1: "fp8", 2: "bf16/fp16", 4: "fp32"}.get(self.dtype_bytes, f"{self.dtype_bytes}-byte")

    @property
    def is_hybrid(self) -> bool:
        return self.num_linear_attention_layers > 0

    def with_weight_bytes(self, weight_bytes: int) -> ModelGeometry:
        if weight_bytes <= 0:
            raise GeometryError(f"weight bytes must be positive, got {weight_bytes}")
        return replace(self, weight_bytes=weight_bytes)

    def estimated_parameter_count(self) -> int:
        """Parameters from shapes alone (dense dtype); used only when no weight bytes are known."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        q_out = self.num_attention_heads * self.head_dim * (2 if self.has_attention_gate else 1)
        # Projections, then the q/k norms (one weight per head dim each).
        attn = (h * q_out + 2 * h * self.num_kv_heads * self.head_dim + self.num_attention_heads * self.head_dim * h
                + 2 * self.head_dim)
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        linear = (
            h * conv_dim + h * value_dim + 2 * h * self.linear_num_value_heads
            + conv_dim * self.linear_conv_kernel_dim + value_dim * h
            # The gated norm over a value head, and dt_bias + A_log per value head.
            + self.linear_value_head_dim + 2 * self.linear_num_value_heads
        )
        if self.num_experts:
            mlp = (
                self.num_experts * 3 * h * self.moe_intermediate_size
                + 3 * h * self.shared_expert_intermediate_size + h * self.num_experts + h
            )
        else:
            mlp = 3 * h * self.intermediate_size
        per_layer_norms = 2 * h
        return (
            embed + h
            + self.num_full_attention_layers * attn
            + self.num_linear_attention_layers * linear
            + self.num_layers * (mlp + per_layer_norms)
        )

    def total_weight_bytes(self) -> int:
        if self.weight_bytes is not None:
            return self.weight_bytes
        return estimated_weight_bytes(self, self.weight_quant)


def _require(cfg: dict[str, Any], key: str, model_type: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise GeometryError(f"config.json of model_type {model_type!r} lacks the field {key!r}")
    return cfg[key]


def layer_types(cfg: dict[str, Any], num_layers: int, model_type: str) -> list[str]:
    """Each layer's kind from layer_types, or every full_attention_interval-th layer full (default 4)."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise GeometryError(
            f"config.json layer_types has {len(types)} entries but num_hidden_layers is {num_layers}"
        )
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise GeometryError(f"config.json layer_types has unknown kinds {unknown} for {model_type!r}")
    return list(types)


def geometry_from_config(cfg: dict[str, Any]) -> ModelGeometry:
    """Build geometry from a parsed config.json (a qwen3_5 wrapper's text_config is unwrapped)."""
    try:
        # Read before the text_config unwrap: a wrapper keeps quantization_config at its top level.
        weight_quant = weight_quant_from_config(cfg)
    except QuantConfigError as exc:
        raise GeometryError(str(exc)) from None
    model_type = cfg.get("model_type")
    if model_type == "qwen3_5" and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": "qwen3_5_text"}
        model_type = "qwen3_5_text"
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures")
        raise GeometryError(
            f"unsupported model_type {model_type!r} (architectures {archs}); "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    num_layers = int(_require(cfg, "num_hidden_layers", model_type))
    hidden = int(_require(cfg, "hidden_size", model_type))
    heads = int(_require(cfg, "num_attention_heads", model_type))
    common: dict[str, Any] = dict(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=int(_require(cfg, "vocab_size", model_type)),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
        dtype_bytes=_DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2),
        weight_quant=weight_quant,
    )
    if model_type == "qwen3":
        return ModelGeometry(num_full_attention_layers=num_layers, num_linear_attention_layers=0, **common)
    types = layer_types(cfg, num_layers, model_type)
    num_full = types.count("full_attention")
    linear: dict[str, Any] = {
        key: int(_require(cfg, key, model_type))
        for key in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim",
        )
    }
    moe: dict[str, Any] = {}
    if model_type == "qwen3_next":
        moe = dict(
            num_experts=int(cfg.get("num_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )
    return ModelGeometry(
        num_full_attention_layers=num_full,
        num_linear_attention_layers=num_layers - num_full,
        layer_types=tuple(types),
        has_attention_gate=True,
        **common,
        **linear,
        **moe,
    )


def safetensors_weight_bytes(model_dir: Path) -> int | None:
    """Sum tensor sizes from safetensors headers only (8-byte length + JSON), quantization codes, scales and
    zero points included as stored. None if there are none."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as handle:
            raw_len = handle.read(8)
            if len(raw_len) != 8:
                raise GeometryError(f"{path}: truncated safetensors header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > 100_000_000:
                raise GeometryError(f"{path}: safetensors header of {header_len} bytes is implausible")
            header = json.loads(handle.read(header_len))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            total += int(end) - int(begin)
    return total


def load_geometry(path: str | Path, weight_bytes: int | None = None) -> ModelGeometry:
    """Geometry from a config.json file or a model directory (weights measured from its safetensors)."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise GeometryError(f"no config.json at {config_path}")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise GeometryError(f"{config_path} is not valid JSON: {exc}") from exc
    geometry = geometry_from_config(cfg)
    if weight_bytes is not None:
        return geometry.with_weight_bytes(weight_bytes)
    measured = safetensors_weight_bytes(config_path.parent)
    return geometry.with_weight_bytes(measured) if measured else geometry
