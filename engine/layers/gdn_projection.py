"""Gated DeltaNet input projections: Qwen3.5's separate in_proj_qkv/z/b/a, or Qwen3-Next's fused,
head-grouped in_proj_qkvz/ba. Both yield the same tensors, so GatedDeltaNet is layout-agnostic."""

from __future__ import annotations

import torch
from headroom.engine.layers.linear import MergedLinear, linear, linear_weight
from headroom.engine.layers.normed_rows import NormedRows
from headroom.engine.models.config import ModelConfig
from headroom.kernels import ops

# (mixed_qkv [N, 2*Hk*Dk + Hv*Dv] in conv-channel order q|k|v, z [N, Hv, Dv], b [N, Hv], a [N, Hv])
Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class SplitProjection:
    """Qwen3.5: four matrices, already in conv-channel order. Dense, all four are one GEMM: b|a alone is a
    64-row product that costs a launch and ~5 us of latency a layer at decode (H200, 4B model), for 0.3 MB.
    A quantized checkpoint keeps b and a dense, so they cannot join qkv|z: then qkv|z and b|a are one GEMM each."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.config = config
        modules = [prefix + name for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
        quant = config.weight_quant
        if quant is None or not any(quant.is_quantized(module) for module in modules):
            self.parts = [MergedLinear(config, weights, modules)]
        else:
            self.parts = [MergedLinear(config, weights, modules[:2]), MergedLinear(config, weights, modules[2:])]

    def __call__(self, x: torch.Tensor | NormedRows) -> Projected:
        """x [N, hidden] -> Projected."""
        cfg = self.config
        mixed, z, b, a = (out for part in self.parts for out in part(x))
        return mixed, z.view(x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim), b, a

    def convolved(self, x: torch.Tensor | NormedRows, conv_weight: torch.Tensor, conv_states: torch.Tensor,
                  slots: torch.Tensor) -> Projected | None:
        """A decode step's Projected with mixed already through the conv step (silu(conv), the states at slots
        rolled in place), the step in the epilogue of the projection's one GEMV (ops.conv_dense_linear: q|k|v are
        its first output columns, so no conv kernel runs and the unconvolved mixed never goes to memory); None
        where that GEMV does not run (two parts, no table entry, too many rows, q|k|v not the conv's channels),
        nothing run: the caller projects and convolves apart."""
        part = self.parts[0]
        weight = part.weights[0]
        if len(self.parts) != 1 or len(part.weights) != 1 or part.biases[0] is not None \
                or not isinstance(weight, torch.Tensor) or part.sizes[0] != conv_weight.shape[0]:
            return None
        if isinstance(x, NormedRows):
            rows, norm = x.gemv_operands()
            out = ops.conv_dense_linear(rows, weight, conv_weight, conv_states, slots, norm)
        else:
            out = ops.conv_dense_linear(x, weight, conv_weight, conv_states, slots)
        if out is None:
            return None
        cfg = self.config
        mixed, z, b, a = torch.split(out, part.sizes, dim=-1)
        return mixed, z.view(x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim), b, a


class FusedGroupedProjection:
    """Qwen3-Next: in_proj_qkvz's output rows are grouped per key head g as
    [q_g (Dk), k_g (Dk), v_g (R*Dv), z_g (R*Dv)] and in_proj_ba's as [b_g (R), a_g (R)], R = Hv // Hk;
    value head g*R + j belongs to key head g. The checkpoint's layout is kept (no weight copy at load,
    one GEMM each); regrouping the outputs costs one [N, conv] concatenation per layer."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.config = config
        self.in_proj_qkvz = linear_weight(config, weights, prefix + "in_proj_qkvz")
        self.in_proj_ba = linear_weight(config, weights, prefix + "in_proj_ba")

    def __call__(self, x: torch.Tensor | NormedRows) -> Projected:
        """x [N, hidden] -> Projected."""
        cfg = self.config
        n, hk, dk, dv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        per_group = cfg.linear_num_value_heads // hk
        qkvz = linear(x, self.in_proj_qkvz).view(n, hk, 2 * dk + 2 * per_group * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, per_group * dv, per_group * dv], dim=-1)
        mixed = torch.cat((q.reshape(n, hk * dk), k.reshape(n, hk * dk), v.reshape(n, -1)), dim=-1)
        b, a = torch.split(linear(x, self.in_proj_ba).view(n, hk, 2 * per_group), per_group, dim=-1)
        return mixed, z.reshape(n, cfg.linear_num_value_heads, dv), b.reshape(n, -1), a.reshape(n, -1)

    def convolved(self, x: torch.Tensor | NormedRows, conv_weight: torch.Tensor, conv_states: torch.Tensor,
                  slots: torch.Tensor) -> Projected | None:
        """Never fused: q|k|v are not the first columns of in_proj_qkvz's output but interleaved per key head with
        z, which the GEMV's conv epilogue does not map (Qwen3-Next is a sparse MoE, whose decode is not graphed)."""
        return None


def gdn_projection(config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str) -> SplitProjection | FusedGroupedProjection:
    if config.family == "qwen3_next":
        return FusedGroupedProjection(config, weights, prefix)
    return SplitProjection(config, weights, prefix)


def gdn_projection_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensors of the projection (names relative to 'linear_attn.') and their shapes."""
    h, hv = config.hidden_size, config.linear_num_value_heads
    value_dim = hv * config.linear_value_head_dim
    if config.family == "qwen3_next":
        return {
            "in_proj_qkvz.weight": (config.linear_conv_channels + value_dim, h),
            "in_proj_ba.weight": (2 * hv, h),
        }
    return {
        "in_proj_qkv.weight": (config.linear_conv_channels, h),
        "in_proj_z.weight": (value_dim, h),
        "in_proj_b.weight": (hv, h),
        "in_proj_a.weight": (hv, h),
    }
