"""Small gates between the GEMMs: SwiGLU's silu(gate) * up, the attention output's x * sigmoid(gate), and
Gated DeltaNet's beta / log-decay. Pure torch references of the fused Triton kernels in gates_triton.py,
each rounding where the unfused model code rounds (every bf16 op rounds its result)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] -> silu(gate) * up [N, I]."""
    return F.silu(gate) * up


def naive_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [N, C], gate [N, H, D] with H * D = C (any strides) -> x * sigmoid(gate) [N, C]."""
    return x * torch.sigmoid(gate.reshape(x.shape))


def naive_gdn_gates(
    b: torch.Tensor, a: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [N, Hv] (model dtype); neg_a = -exp(A_log) [Hv] fp32; dt_bias [Hv].
    -> (beta = sigmoid(b) [N, Hv] in b's dtype, g = neg_a * softplus(a + dt_bias) [N, Hv] fp32)."""
    return torch.sigmoid(b), neg_a * F.softplus(a.float() + dt_bias.float())
