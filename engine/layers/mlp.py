"""SwiGLU MLP (the linear helper lives in layers/linear.py and is re-exported here)."""

from __future__ import annotations

import torch
from headroom.engine.layers.linear import MergedLinear, linear, linear_weight
from headroom.engine.layers.normed_rows import NormedRows
from headroom.engine.layers.residual import Projection
from headroom.engine.models.config import ModelConfig

__all__ = ["SwiGLU", "linear"]


class SwiGLU:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.gate_up = MergedLinear(config, weights, [prefix + "gate_proj", prefix + "up_proj"])
        self.down = linear_weight(config, weights, prefix + "down_proj")

    def projection(self, x: torch.Tensor | NormedRows) -> Projection:
        """x [N, hidden] -> the down projection still to run (the decoder layer's MLP: residual.deferred)."""
        gate, up = self.gate_up(x)
        return Projection(gate, self.down, up=up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden] (a MoE expert, the shared expert)."""
        return self.projection(x).run()
