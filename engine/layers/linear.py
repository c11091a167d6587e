"""The linear path: a layer's weight is a dense tensor or, where the checkpoint quantized it, a QuantizedWeight."""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.nn.functional as F
from headroom.engine.models.config import ModelConfig
from headroom.kernels import ops
from headroom.kernels.quant_weight import QuantizedWeight

LinearWeight: TypeAlias = torch.Tensor | QuantizedWeight


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) -> [..., N]."""
    if isinstance(weight, QuantizedWeight):
        return ops.quant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_weight(config: ModelConfig, weights: dict[str, torch.Tensor], module: str) -> LinearWeight:
    """The weight of linear `module` ('model.layers.0.mlp.up_proj'): the dense `.weight`, or the checkpoint's
    quantized tensors (fp8 `.weight` + `.weight_scale_inv`; int4 `.weight_packed`, `.weight_scale`,
    `.weight_zero_point`, `.weight_shape`) as one QuantizedWeight. check_weights has named any missing one."""
    quant = config.weight_quant
    if quant is None or not quant.is_quantized(module):
        return weights[module + ".weight"]
    if quant.method == "fp8_block":
        data = weights[module + ".weight"]
        n, k = data.shape
        return QuantizedWeight("fp8_block", data, weights[module + ".weight_scale_inv"], None, n, k, quant.block)
    n, k = (int(v) for v in weights[module + ".weight_shape"].tolist())
    zero = None if quant.symmetric else weights[module + ".weight_zero_point"]
    return QuantizedWeight("int4_group", weights[module + ".weight_packed"], weights[module + ".weight_scale"], zero,
                           n, k, quant.block)
