"""Tiny random Qwen3 / Qwen3.5 checkpoints built with transformers (the oracle) into tmp dirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

QWEN3_5_CONFIGS = [
    # Odd sizes on purpose: odd vocab, head counts, head dims, GQA ratios.
    dict(vocab_size=101, hidden_size=48, intermediate_size=72, num_hidden_layers=4, num_attention_heads=3,
         num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
         linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4),
    dict(vocab_size=77, hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=5,
         num_key_value_heads=5, head_dim=12, linear_num_key_heads=1, linear_num_value_heads=3,
         linear_key_head_dim=6, linear_value_head_dim=10, linear_conv_kernel_dim=3,
         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    dict(vocab_size=131, hidden_size=64, intermediate_size=40, num_hidden_layers=5, num_attention_heads=4,
         num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
         layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
         tie_word_embeddings=True, partial_rotary_factor=0.5),
]

QWEN3_CONFIGS = [
    dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=8),
    dict(vocab_size=61, hidden_size=36, intermediate_size=52, num_hidden_layers=3, num_attention_heads=3,
         num_key_value_heads=3, head_dim=14, tie_word_embeddings=True),
    dict(vocab_size=113, hidden_size=48, intermediate_size=36, num_hidden_layers=2, num_attention_heads=6,
         num_key_value_heads=1, head_dim=10, rope_theta=5000.0),
]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises norms to 0 or 1 and A_log/dt_bias to fixed ranges; randomise every
    parameter so that a wrong (1 + w) versus w, or a swapped tensor, cannot go unnoticed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 - 1)
            else:
                param.add_(noise)


def build_model(kind: str, index: int, out_dir: Path, seed: int = 0):
    """Save a random tiny model of kind 'qwen3' or 'qwen3_5' (config index) to out_dir; return it (eval, fp32)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed + index)
    if kind == "qwen3_5":
        params = dict(QWEN3_5_CONFIGS[index])
        partial = params.pop("partial_rotary_factor", 0.25)
        config = Qwen3_5TextConfig(**params, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": partial})
        model = Qwen3_5ForCausalLM(config)
    else:
        params = dict(QWEN3_CONFIGS[index])
        theta = params.pop("rope_theta", 10000.0)
        config = Qwen3Config(**params, rope_parameters={"rope_type": "default", "rope_theta": theta})
        model = Qwen3ForCausalLM(config)
    _perturb(model, seed + 100 * index)
    model = model.float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """(kind, index) -> (model_dir, transformers model); each built once per test session."""
    built: dict[tuple[str, int], tuple[Path, torch.nn.Module]] = {}

    def get(kind: str, index: int = 0):
        key = (kind, index)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{kind}_{index}")
            built[key] = (out, build_model(kind, index, out))
        return built[key]

    return get
