"""SwiGLU MLP and plain linear helpers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from headroom.kernels import ops


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class SwiGLU:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str):
        self.gate = weights[prefix + "gate_proj.weight"]
        self.up = weights[prefix + "up_proj.weight"]
        self.down = weights[prefix + "down_proj.weight"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        return linear(ops.silu_mul(linear(x, self.gate), linear(x, self.up)), self.down)
