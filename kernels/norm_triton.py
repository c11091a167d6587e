"""RMSNorm kernels: one program per row (token, or token x head; gated_rms_norm and l2_norm: a block of rows),
statistics in fp32, rounding where kernels/norm.py's references round, so bf16 results match them up to the
last ulp of rsqrt.

rms_norm also does the decoder's residual step (s = residual + delta, stored, then normed) in the same
pass, and reads strided [T, H, D] rows (q/k heads cut from a wider projection) without a copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def rms_norm_fwd_kernel(
    x, delta, weight, out, summed, stride_xt, stride_xh, stride_dt, num_heads, dim, eps,
    BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr, HAS_DELTA: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
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
    x, gate, weight, out, stride_xt, stride_xh, stride_gt, stride_gh, num_rows, num_heads, dim, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_r < num_rows)[:, None] & (o_d < dim)[None, :]
    i_t, i_h = o_r // num_heads, o_r % num_heads
    b_x = tl.load(x + (i_t * stride_xt + i_h * stride_xh)[:, None] + o_d[None, :], mask=m, other=0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) / dim + eps)
    b_w = tl.load(weight + o_d, mask=o_d < dim, other=0).to(tl.float32)
    b_y = ((b_x * rstd[:, None]).to(out.dtype.element_ty).to(tl.float32) * b_w[None, :])
    b_y = b_y.to(out.dtype.element_ty).to(tl.float32)
    b_g = tl.load(gate + (i_t * stride_gt + i_h * stride_gh)[:, None] + o_d[None, :], mask=m, other=0).to(tl.float32)
    b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
    tl.store(out + o_r[:, None] * dim + o_d[None, :], b_y.to(out.dtype.element_ty), mask=m)


@triton.jit
def l2_norm_fwd_kernel(x, out, stride_xt, stride_xh, num_rows, num_heads, dim, eps,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_r < num_rows)[:, None] & (o_d < dim)[None, :]
    p_x = x + (o_r // num_heads * stride_xt + o_r % num_heads * stride_xh)[:, None] + o_d[None, :]
    b_x = tl.load(p_x, mask=m, other=0).to(tl.float32)
    b_y = b_x * (1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps))[:, None]
    tl.store(out + o_r[:, None] * dim + o_d[None, :], b_y.to(out.dtype.element_ty), mask=m)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H, D] (strided rows allowed) -> x / sqrt(sum(x^2) + eps) per row, contiguous, x's dtype; fp32 sums.
    Gated DeltaNet's q/k norm, done here rather than inside fla: fla's own l2norm autotunes per bucket of
    T x H / 65,536, so a pass a little over 8,192 tokens met a new bucket while serving (25 compiles, H200)."""
    tokens, heads, stride_t, stride_h = _rows(x, "l2_norm x")
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, block_d = tokens * heads, triton.next_power_of_2(dim)
    block_r = max(1, min(16, 4096 // block_d))
    if rows:
        l2_norm_fwd_kernel[(triton.cdiv(rows, block_r),)](
            x, out, stride_t, stride_h, rows, heads, dim, eps, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
        )
    return out


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
            num_warps=4 if dim <= 1024 else 8, **pdl_launch(x.device),
        )
    return out, summed


# (BLOCK_R rows, num_warps) of a gated_rms_norm program for passes of at least GATED_MANY_ROWS rows (prefill:
# 262,144 rows of 128 at 8K tokens of the 4B model, where one row a program ran 4x off bandwidth on the H200),
# and one row of 4 warps below (decode's 32 rows a token, as before). Two variants only, so that no pass size
# compiles one while serving. bench/prefill_gdn_kernels.py sweeps them on the GPU.
GATED_MANY_ROWS = 4096
# H200, session 10 (bench/results/session10/call3/prefill_gdn_kernels.json): 8K tokens 0.055 ms (16 x 4: 0.057;
# one row a program with the gate copied first, as before: 0.253).
GATED_CONFIG = (4, 2)
GATED_FEW_ROWS_CONFIG = (1, 4)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   config: tuple[int, int] | None = None) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate): x, gate [..., D] (same shape; [T, D] or [T, H, D] may have strided rows,
    e.g. z cut from the in-projection), weight [D] -> x's shape, contiguous. config: (BLOCK_R, num_warps),
    by row count when None."""
    dim = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    x3, g3 = _heads(x, gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens, heads = x3.shape[:2]
    rows = tokens * heads
    block_r, num_warps = config or (GATED_CONFIG if rows >= GATED_MANY_ROWS else GATED_FEW_ROWS_CONFIG)
    if rows:
        gated_rms_norm_fwd_kernel[(triton.cdiv(rows, block_r),)](
            x3, g3, weight, out, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), rows, heads, dim, eps,
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(dim), num_warps=num_warps, **pdl_launch(x.device),
        )
    return out


def _heads(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, gate [..., D] as [T, H, D] with contiguous last dims: views of [T, D] or [T, H, D], else copies."""
    if x.dim() in (2, 3) and x.stride(-1) == 1 and gate.stride(-1) == 1:
        return (x, gate) if x.dim() == 3 else (x[:, None, :], gate[:, None, :])
    return x.reshape(-1, 1, x.shape[-1]).contiguous(), gate.reshape(-1, 1, x.shape[-1]).contiguous()
