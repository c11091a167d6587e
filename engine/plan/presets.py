"""Built-in model geometries for examples and the demo, transcribed from published configs.

`seed-27b-int2` is the field report's case (seed 004): a Qwen3.5-27B-shaped hybrid with 2-bit
weights on 2 x 12 GB. Its weight bytes are calibrated so SGLang's pool at mem-fraction-static 0.78
with 32 fp16 SSM slots comes to the reported 148,058 tokens (7,726 MiB of weights per GPU).
"""

from __future__ import annotations

from typing import Any

MiB = 1024**2

_QWEN35_27B: dict[str, Any] = {
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
    "head_dim": 256, "intermediate_size": 17408, "vocab_size": 248320, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
_QWEN35_4B: dict[str, Any] = {
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "intermediate_size": 9216, "vocab_size": 248320, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
_QWEN3_NEXT_80B: dict[str, Any] = {
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "intermediate_size": 5120, "vocab_size": 151936, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "torch_dtype": "bfloat16",
}

# name -> (config.json, whole-model weight bytes or None to estimate from shapes)
PRESETS: dict[str, tuple[dict[str, Any], int | None]] = {
    "seed-27b-int2": (_QWEN35_27B, 2 * 7726 * MiB),
    "qwen3.5-27b": (_QWEN35_27B, None),
    "qwen3.5-4b": (_QWEN35_4B, None),
    "qwen3-next-80b-a3b": (_QWEN3_NEXT_80B, None),
}


def preset_config(name: str) -> tuple[dict[str, Any], int | None]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    config, weight_bytes = PRESETS[name]
    return dict(config), weight_bytes
