"""RMSNorm kernels: one program per row (token, or token x head), statistics in fp32, rounding where
kernels/norm.py's references round, so bf16 results match them up to the last ulp of rsqrt.

rms_norm also does the decoder's residual step (s = residual + delta, stored, then normed) in the same
pass, and reads strided [T, H, D] rows (q/k heads cut from a wider projection) without a copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(
    x, delta, weight, out, summed, stride_xt, stride_xh, stride_dt, num_heads, dim, eps,
    BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_t, i_h = i_r // num_heads, i_r % num_heads
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    b_x = tl.load(x + i_t * stride_xt + i_h * stride_xh + o_d, mask=m_d, other=0).to(tl.float32)
    if HAS_DELTA:
        b_delta = tl.load(delta + i_t * stride_dt + o_d, mask=m_d, other=0).to(tl.float32)
        b_sum = (b_x + b_delta).to(out.dtype.element_ty)
        tl.store(summed + i_r * dim + o_d, b_sum, mask=m_d)
        b_x = b_sum.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 0) / dim + eps)
    b_w = tl.load(weight + o_d, mask=m_d, other=0).to(tl.float32)
    if UNIT_OFFSET:
        b_y = b_x * rstd * (1.0 + b_w)
    else:
        b_y = (b_x * rstd).to(out.dtype.element_ty).to(tl.float32) * b_w
    tl.store(out + i_r * dim + o_d, b_y.to(out.dtype.element_ty), mask=m_d)


@triton.jit
def gated_rms_norm_fwd_kernel(
    x, gate, weight, out, stride_x, stride_g, dim, eps, BLOCK_D: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    b_x = tl.load(x + i_r * stride_x + o_d, mask=m_d, other=0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 0) / dim + eps)
    b_w = tl.load(weight + o_d, mask=m_d, other=0).to(tl.float32)
    b_y = ((b_x * rstd).to(out.dtype.element_ty).to(tl.float32) * b_w).to(out.dtype.element_ty).to(tl.float32)
    b_g = tl.load(gate + i_r * stride_g + o_d, mask=m_d, other=0).to(tl.float32)
    b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
    tl.store(out + i_r * dim + o_d, b_y.to(out.dtype.element_ty), mask=m_d)


def _rows(x: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """(tokens, heads, stride per token, stride per head) of x [T, D] or [T, H, D] with a contiguous last dim."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"{name} {tuple(x.shape)} must be [T, D] or [T, H, D] with a contiguous last dimension")
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, D] or [T, H, D] (strided rows allowed), weight [D] -> (normed, contiguous, x's shape and dtype;
    s = x + delta [T, D] when delta [T, D] is given and s is what was normed, else None)."""
    tokens, heads, stride_t, stride_h = _rows(x, "rms_norm x")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm weight {tuple(weight.shape)} must be [{dim}]")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = None
    if delta is not None:
        if x.dim() != 2 or delta.shape != x.shape or delta.stride(-1) != 1:
            raise ValueError(f"rms_norm delta {tuple(delta.shape)} must match the residual {tuple(x.shape)} [T, D]")
        summed = torch.empty_like(out)
    if tokens * heads:
        rms_norm_fwd_kernel[(tokens * heads,)](
            x, delta if delta is not None else x, weight, out, summed if summed is not None else out,
            stride_t, stride_h, delta.stride(0) if delta is not None else 0, heads, dim, eps,
            BLOCK_D=triton.next_power_of_2(dim), UNIT_OFFSET=unit_offset, HAS_DELTA=delta is not None,
            num_warps=4 if dim <= 1024 else 8,
        )
    return out, summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate): x, gate [..., D] (same shape), weight [D] -> x's shape, contiguous."""
    dim = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    x2, g2 = x.reshape(-1, dim), gate.reshape(-1, dim)
    if x2.stride(-1) != 1 or g2.stride(-1) != 1:
        x2, g2 = x2.contiguous(), g2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        gated_rms_norm_fwd_kernel[(x2.shape[0],)](
            x2, g2, weight, out, x2.stride(0), g2.stride(0), dim, eps, BLOCK_D=triton.next_power_of_2(dim),
        )
    return out
