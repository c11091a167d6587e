"""SwiGLU MLP (the linear helper lives in layers/linear.py and is re-exported here)."""

from __future__ import annotations

import torch
from headroom.engine.layers.linear import MergedLinear, linear, linear_weight
from headroom.engine.models.config import ModelConfig
from headroom.kernels import ops

__all__ = ["SwiGLU", "linear"]


class SwiGLU:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.gate_up = MergedLinear(config, weights, [prefix + "gate_proj", prefix + "up_proj"])
        self.down = linear_weight(config, weights, prefix + "down_proj")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        gate, up = self.gate_up(x)
        if isinstance(self.down, torch.Tensor):
            # Decode on CUDA where the GEMV table has the fused shape: the activation is made inside the down
            # projection's GEMV (no silu_mul launch, no [N, I] activation written and read back).
            out = ops.silu_mul_dense_linear(gate, up, self.down)
            if out is not None:
                return out
        return linear(ops.silu_mul(gate, up), self.down)
