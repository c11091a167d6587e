"""SwiGLU MLP (the linear helper lives in layers/linear.py and is re-exported here)."""

from __future__ import annotations

import os

import torch
from headroom.engine.layers.linear import MergedLinear, linear, linear_weight, swiglu_linear
from headroom.engine.layers.normed_rows import NormedRows
from headroom.engine.layers.residual import Projection
from headroom.engine.models.config import ModelConfig

__all__ = ["SwiGLU", "interleave_gate_up", "linear"]

# Dense gate and up weights interleaved at load, and SwiGLU's activation made in the gate|up GEMV's epilogue at
# decode (kernels/gemv.py SWIGLU) for passes of at most FUSED_SWIGLU_ROWS rows where the table has the shape: a
# silu_mul launch a layer fewer, 32 a step on the 4B model, whose silu_mul launches took 0.045 / 0.048 ms of a
# 3.50 / 4.19 ms step at batch 1 / 8 on an H100 (session 28's profile_decode_batches, PDL off). Measured on an H100
# (session 29, bench/engine_speed.py fused_swiglu, two calls): the graphed decode step 0.995-0.996x at batch 1,
# 0.9935x at 8, 0.990-0.992x at 16, the same tokens; session 30 (bench/results/session30/), the rows on and
# off on one machine: decode +0.5% / +0.8% / +1.2% at batch 1 / 8 / 16 through the HTTP API, prefill at 8K / 32K
# within 0.4% (longer passes run silu_mul on the pairs, read as pairs: gates_triton PAIRED), nothing compiled after
# /ready, the logits as close to fp32 as without it. On by default; HEADROOM_FUSED_SWIGLU=0 (anything but 1, as the
# other switches) turns it off, read as each MLP is built.
FUSED_SWIGLU = os.environ.get("HEADROOM_FUSED_SWIGLU", "1") == "1"
FUSED_SWIGLU_ROWS = 16


class SwiGLU:
    """With FUSED_SWIGLU, dense gate and up weights are kept as one [2I, K] weight with their rows interleaved (gate
    row i at 2i, up row i at 2i + 1; interleave_gate_up): every output block of the decode GEMV then holds whole
    (gate, up) pairs, so the activation is made in its epilogue (ops.swiglu_dense_linear: no silu_mul launch, no
    [N, 2I] product written and read back). Elsewhere the one GEMM's even and odd columns are the gate and up
    halves, as the merged halves were. Without it, and for quantized weights (their scales run along the rows in
    blocks), MergedLinear's stacked halves."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        gate, up = (linear_weight(config, weights, prefix + name) for name in ("gate_proj", "up_proj"))
        self.interleaved: torch.Tensor | None = None
        if FUSED_SWIGLU and isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) \
                and gate.shape == up.shape and gate.dtype == up.dtype:
            self.interleaved = interleave_gate_up(gate, up)
            for name in ("gate_proj", "up_proj"):
                weights.pop(prefix + name + ".weight", None)
        else:
            self.gate_up = MergedLinear(config, weights, [prefix + "gate_proj", prefix + "up_proj"])
        self.down = linear_weight(config, weights, prefix + "down_proj")

    def projection(self, x: torch.Tensor | NormedRows) -> Projection:
        """x [N, hidden] -> the down projection still to run (the decoder layer's MLP: residual.deferred)."""
        if self.interleaved is None:
            gate, up = self.gate_up(x)
            return Projection(gate, self.down, up=up)
        activation = swiglu_linear(x, self.interleaved) if x.shape[0] <= FUSED_SWIGLU_ROWS else None
        if activation is not None:
            return Projection(activation, self.down)
        pairs = linear(x, self.interleaved)
        return Projection(pairs[..., 0::2], self.down, up=pairs[..., 1::2])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden] (a MoE expert, the shared expert)."""
        return self.projection(x).run()


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, K] -> [2I, K] with gate row i at 2i and up row i at 2i + 1 (contiguous)."""
    return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1])
