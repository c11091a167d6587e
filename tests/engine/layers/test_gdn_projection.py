"""Qwen3.5's Gated DeltaNet in-projections (engine/layers/gdn_projection.py): dense, the four matrices are one
GEMM whose column views equal each matrix applied alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from headroom.engine.layers.gdn_projection import SplitProjection
from headroom.engine.runtime.loader import load_config, load_weights


def test_dense_projection_is_one_gemm_equal_to_the_four(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    config = load_config(model_dir)
    weights = load_weights(model_dir, torch.float32, torch.device("cpu"))
    layer = config.linear_attention_layers[0]
    prefix = f"model.layers.{layer}.linear_attn."
    originals = {name: weights[prefix + name + ".weight"].clone()
                 for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    project = SplitProjection(config, weights, prefix)
    (merged,) = project.parts
    assert len(merged.weights) == 1, "qkv|z|b|a stacked into one weight"
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    mixed, z, b, a = project(x)
    torch.testing.assert_close(mixed, F.linear(x, originals["in_proj_qkv"]))
    torch.testing.assert_close(z.reshape(5, -1), F.linear(x, originals["in_proj_z"]))
    torch.testing.assert_close(b, F.linear(x, originals["in_proj_b"]))
    torch.testing.assert_close(a, F.linear(x, originals["in_proj_a"]))
