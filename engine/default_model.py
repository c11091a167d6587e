"""The embedded default model: a small generated Qwen3.5-style hybrid with a byte-level tokenizer.

Lets `headroom serve` and `headroom demo` run with no download and on a CPU. The weights are random
(seeded, so every machine generates the same model): the output is noise, the scheduling is real.
Written once to $HEADROOM_CACHE/default-model (or ~/.cache/headroom/default-model) on first use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from headroom.engine.server.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

DEFAULT_MODEL_NAME = "headroom-tiny-hybrid"
_SEED = 20260101
_FORMAT_VERSION = "1"


def default_config() -> dict[str, Any]:
    """3 Gated DeltaNet layers + 1 full-attention layer, hidden 64: a Qwen3.5 layout at toy size."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "eos_token_id": ByteTokenizer.EOS,
        "headroom_default_model": _FORMAT_VERSION,
    }


def cache_dir() -> Path:
    root = os.environ.get("HEADROOM_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "headroom"


def ensure_default_model(directory: Path | None = None) -> Path:
    """The model directory, generating config.json, model.safetensors and tokenizer marker when absent."""
    target = directory or cache_dir() / "default-model"
    config_path = target / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get("headroom_default_model") == _FORMAT_VERSION:
        return target
    import torch
    from headroom.engine.models.config import model_config_from_hf
    from headroom.engine.runtime.loader import expected_shapes
    from safetensors.torch import save_file

    config = default_config()
    generator = torch.Generator().manual_seed(_SEED)
    tensors = {}
    for name, shape in sorted(expected_shapes(model_config_from_hf(config)).items()):
        if name.endswith("A_log"):
            tensors[name] = torch.rand(shape, generator=generator) * 2 - 1
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            tensors[name] = torch.randn(shape, generator=generator) * 0.1
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            tensors[name] = torch.randn(shape, generator=generator) / fan_in**0.5
    target.mkdir(parents=True, exist_ok=True)
    # Write to temporaries and rename, so a concurrent first use never reads half a file.
    weights_tmp = target / f"model.safetensors.{os.getpid()}.tmp"
    save_file(tensors, str(weights_tmp))
    weights_tmp.replace(target / "model.safetensors")
    (target / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "headroom-bytes"}) + "\n")
    config_tmp = target / f"config.json.{os.getpid()}.tmp"
    config_tmp.write_text(json.dumps(config, indent=2) + "\n")
    config_tmp.replace(config_path)
    return target
