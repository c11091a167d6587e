"""Fused gates (references in kernels/gates.py): silu(gate) * up, x * sigmoid(gate), and Gated DeltaNet's
beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias). One launch each instead of two to six."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.pdl import pdl_enter, pdl_launch

_BLOCK = 1024


@triton.jit
def _round(x, like):
    """x rounded to like's element type, back in fp32 (each unfused bf16 op rounds its result)."""
    return x.to(like.dtype.element_ty).to(tl.float32)


@triton.jit
def silu_mul_fwd_kernel(gate, up, out, cols, stride_g, stride_u, stride_gc, stride_uc, BLOCK: tl.constexpr,
                        PDL: tl.constexpr, PAIRED: tl.constexpr = False):
    """PAIRED: gate and up interleaved in one row (gate column c at 2c, up at 2c + 1 from `gate`): each pair loaded
    as one contiguous [BLOCK, 2] tile and split, instead of two loads that each use half of every sector."""
    pdl_enter(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o_c < cols
    if PAIRED:
        pairs = tl.load(gate + i_t * stride_g + (2 * o_c)[:, None] + tl.arange(0, 2)[None, :], mask=mask[:, None],
                        other=0).to(tl.float32)
        b_g, b_u = tl.split(pairs)
    else:
        # (a column stride of 1, the split halves' case, is specialised by Triton: no multiply)
        b_g = tl.load(gate + i_t * stride_g + o_c * stride_gc, mask=mask, other=0).to(tl.float32)
        b_u = tl.load(up + i_t * stride_u + o_c * stride_uc, mask=mask, other=0).to(tl.float32)
    b_s = _round(b_g / (1.0 + tl.exp(-b_g)), out)
    tl.store(out + i_t * cols + o_c, (b_s * b_u).to(out.dtype.element_ty), mask=mask)


@triton.jit
def sigmoid_mul_fwd_kernel(x, gate, out, cols, head_dim, stride_gt, stride_gh, BLOCK: tl.constexpr,
        PDL: tl.constexpr):
    pdl_enter(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o_c < cols
    b_x = tl.load(x + i_t * cols + o_c, mask=mask, other=0).to(tl.float32)
    p_g = gate + i_t * stride_gt + (o_c // head_dim) * stride_gh + o_c % head_dim
    b_g = tl.load(p_g, mask=mask, other=0).to(tl.float32)
    tl.store(out + i_t * cols + o_c, sigmoid_gate(b_x, b_g, out).to(out.dtype.element_ty), mask=mask)


@triton.jit
def sigmoid_gate(b_x, b_g, like):
    """fp32 x * sigmoid(gate) as the unfused bf16 ops round it (the sigmoid rounded to like's dtype), in fp32 (the
    caller rounds the product as it stores it); kernels/attention_merge_triton.py gates merged rows with it."""
    return b_x * _round(1.0 / (1.0 + tl.exp(-b_g)), like)


@triton.jit
def gdn_gate_values(b_b, b_a, b_dt, b_neg, BETA_DTYPE: tl.constexpr):
    """fp32 b, a, dt_bias, neg_a -> (beta = sigmoid(b) rounded to BETA_DTYPE, as fp32; g = neg_a * softplus(a +
    dt_bias), fp32): naive_gdn_gates, for the gates kernel and the decode step that computes its own."""
    beta = (1.0 / (1.0 + tl.exp(-b_b))).to(BETA_DTYPE).to(tl.float32)
    x = b_a + b_dt
    # softplus with torch's threshold 20; log1p(e) as log(u) - ((u - 1) - e) / u keeps small e exact.
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) - ((u - 1.0) - e) / u)
    return beta, b_neg * tl.where(x > 20.0, x, log1p)


@triton.jit
def gdn_gates_fwd_kernel(b, a, neg_a, dt_bias, beta, g, heads, stride_b, stride_a, BLOCK: tl.constexpr,
        PDL: tl.constexpr):
    pdl_enter(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK)
    mask = o_h < heads
    b_beta, b_g = gdn_gate_values(tl.load(b + i_t * stride_b + o_h, mask=mask, other=0).to(tl.float32),
                                  tl.load(a + i_t * stride_a + o_h, mask=mask, other=0).to(tl.float32),
                                  tl.load(dt_bias + o_h, mask=mask, other=0).to(tl.float32),
                                  tl.load(neg_a + o_h, mask=mask, other=0), beta.dtype.element_ty)
    tl.store(beta + i_t * heads + o_h, b_beta.to(beta.dtype.element_ty), mask=mask)
    tl.store(g + i_t * heads + o_h, b_g, mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] (strided views allowed: the column halves of one merged gate|up GEMM, or the even and odd
    columns of an interleaved one, engine/layers/mlp.py), same dtype -> silu(gate) * up [N, I] contiguous."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be the same [N, I] shape")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        grid = (gate.shape[0], triton.cdiv(gate.shape[1], _BLOCK))
        # the even and odd columns of one interleaved product: read as pairs
        paired = gate.stride(1) == up.stride(1) == 2 and gate.stride(0) == up.stride(0) \
            and up.data_ptr() == gate.data_ptr() + gate.element_size() and gate.dtype == up.dtype
        silu_mul_fwd_kernel[grid](gate, up, out, gate.shape[1], gate.stride(0), up.stride(0), gate.stride(1),
                                  up.stride(1), BLOCK=_BLOCK, PAIRED=paired, **pdl_launch(gate.device))
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [N, C] contiguous, gate [N, H, D] (H * D = C, strided rows allowed) -> x * sigmoid(gate) [N, C]."""
    if x.dim() != 2 or not x.is_contiguous() or gate.dim() != 3 or gate.shape[0] != x.shape[0] \
            or gate.shape[1] * gate.shape[2] != x.shape[1] or gate.stride(-1) != 1:
        raise ValueError(f"sigmoid_mul: x {tuple(x.shape)} must be contiguous [N, C], gate {tuple(gate.shape)} [N, H, D]")
    out = torch.empty_like(x)
    if x.numel():
        grid = (x.shape[0], triton.cdiv(x.shape[1], _BLOCK))
        sigmoid_mul_fwd_kernel[grid](x, gate, out, x.shape[1], gate.shape[2], gate.stride(0), gate.stride(1), BLOCK=_BLOCK,
                **pdl_launch(x.device))
    return out


def gdn_gates(b: torch.Tensor, a: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [N, Hv] (rows may be strided); neg_a, dt_bias [Hv] -> (beta [N, Hv] in b's dtype, g [N, Hv] fp32)."""
    tokens, heads = b.shape
    if a.shape != b.shape or neg_a.shape != (heads,) or dt_bias.shape != (heads,) or b.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError(f"gdn_gates: b {tuple(b.shape)}, a {tuple(a.shape)} [N, Hv]; neg_a {tuple(neg_a.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)} [Hv]")
    beta = torch.empty((tokens, heads), dtype=b.dtype, device=b.device)
    g = torch.empty((tokens, heads), dtype=torch.float32, device=b.device)
    if tokens:
        gdn_gates_fwd_kernel[(tokens,)](b, a, neg_a.float(), dt_bias, beta, g, heads, b.stride(0), a.stride(0),
                                        BLOCK=triton.next_power_of_2(heads), **pdl_launch(b.device))
    return beta, g
