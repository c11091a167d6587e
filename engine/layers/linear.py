"""The linear path: a layer's weight is a dense tensor or, where the checkpoint quantized it, a QuantizedWeight."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeAlias

import torch
from headroom.engine.layers.normed_rows import NormedRows
from headroom.engine.models.config import ModelConfig
from headroom.kernels import ops
from headroom.kernels.quant_weight import QuantizedWeight

LinearWeight: TypeAlias = torch.Tensor | QuantizedWeight


def linear(x: torch.Tensor | NormedRows, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) -> [..., N]. NormedRows: their norm in the same GEMV where one runs
    it (decode-sized, dense, no bias: ops.normed_dense_linear), else normed first."""
    if isinstance(x, NormedRows):
        if bias is None and isinstance(weight, torch.Tensor):
            out = ops.normed_dense_linear(*x.gemv_operands(), weight)
            if out is not None:
                return out
        x = x.tensor()
    if isinstance(weight, QuantizedWeight):
        return ops.quant_linear(x, weight, bias)
    return ops.dense_linear(x, weight, bias)


def swiglu_linear(x: torch.Tensor | NormedRows, weight: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x @ weight.T, weight's gate and up rows interleaved, in one GEMV with its activation (and
    NormedRows' norm) where one runs it (ops.swiglu_dense_linear); None elsewhere: the caller projects, then
    silu_mul of the pairs."""
    if isinstance(x, NormedRows):
        rows, norm = x.gemv_operands()
        return ops.swiglu_dense_linear(rows, weight, norm)
    return ops.swiglu_dense_linear(x, weight)


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


def _concat(parts: list[LinearWeight]) -> LinearWeight | None:
    """Weights [N_i, K] as one [sum N_i, K], or None where their layouts do not stack: dense with quantized,
    different formats, or an fp8 block / packed int4 zero point straddling two parts."""
    first = parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)  # type: ignore[arg-type]
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        return None
    quantized: list[QuantizedWeight] = parts  # type: ignore[assignment]
    assert isinstance(first, QuantizedWeight)
    rows_per_scale = first.block[0] if first.method == "fp8_block" else (8 if first.zero is not None else 1)
    alike = all(p.method == first.method and p.block == first.block and (p.zero is None) == (first.zero is None)
                and p.in_features == first.in_features and p.out_features % rows_per_scale == 0 for p in quantized)
    if not alike:
        return None
    zero = torch.cat([p.zero for p in quantized]) if first.zero is not None else None  # type: ignore[misc]
    return replace(first, data=torch.cat([p.data for p in quantized]), scale=torch.cat([p.scale for p in quantized]),
                   zero=zero, out_features=sum(p.out_features for p in quantized))


class MergedLinear:
    """Linears that read the same input (q|k|v, gate|up, Gated DeltaNet's in-projections) as one weight where
    their layouts stack: one GEMM instead of several, which at decode is several fewer weight streams a layer
    (fewer, fuller kernels). Outputs are column views of the one result. The parts' tensors leave `weights` as
    they are merged, so loading holds at most one layer's parts twice."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], modules: list[str],
                 biases: list[torch.Tensor | None] | None = None):
        parts = [linear_weight(config, weights, module) for module in modules]
        self.sizes = [p.shape[0] for p in parts]
        merged = _concat(parts) if len(parts) > 1 else None
        self.weights = [merged] if merged is not None else parts
        biases = biases or [None] * len(parts)
        if merged is not None:
            given = [b for b in biases if b is not None]
            # A part without a bias adds zeros (Qwen2-style q/k/v biases come all together or not at all).
            biases = [torch.cat([b if b is not None else given[0].new_zeros(n) for b, n in
                                 zip(biases, self.sizes, strict=True)]) if given else None]
        self.biases = biases
        if merged is not None:
            for module in modules:
                for suffix in (".weight", ".weight_scale_inv", ".weight_packed", ".weight_scale", ".weight_zero_point",
                               ".weight_shape"):
                    weights.pop(module + suffix, None)

    @property
    def device(self) -> torch.device:
        return self.weights[0].device

    def __call__(self, x: torch.Tensor | NormedRows) -> list[torch.Tensor]:
        """x [..., K] -> one [..., N_i] per part (views of one GEMM's output when merged)."""
        if len(self.weights) == 1 and len(self.sizes) > 1:
            return list(torch.split(linear(x, self.weights[0], self.biases[0]), self.sizes, dim=-1))
        return [linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True)]

