"""SwiGLU MLP (the linear helper lives in layers/linear.py and is re-exported here)."""

from __future__ import annotations

import torch
from headroom.engine.layers.linear import linear, linear_weight
from headroom.engine.models.config import ModelConfig
from headroom.kernels import ops

__all__ = ["SwiGLU", "linear"]


class SwiGLU:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.gate = linear_weight(config, weights, prefix + "gate_proj")
        self.up = linear_weight(config, weights, prefix + "up_proj")
        self.down = linear_weight(config, weights, prefix + "down_proj")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        return linear(ops.silu_mul(linear(x, self.gate), linear(x, self.up)), self.down)
