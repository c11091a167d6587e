"""Skinny matrix products for decode: y [M, N] = x [M, K] @ w [N, K].T for M of 1 to 16 rows, bf16 weights read
once at full width. Decode is bound by the weight bytes; each program streams a [BLOCK_N, K / SPLIT] strip of w
and keeps the M x BLOCK_N accumulator in registers, so the grid is sized to the SMs and not to M. A split over K
writes fp32 partial sums that one reduction adds. Reference: torch's F.linear (the CPU path).

Whether this beats cuBLAS at a shape is measured, not assumed: bench/engine_speed.py's gemv part times both per
shape and batch, and gemv_tuned_configs.json ships, per GPU and Triton version, the shapes where this kernel won
with the configuration that did; tuned_gemv runs those and returns None for every other shape (cuBLAS then)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 256
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3


TUNED_CONFIGS = Path(__file__).with_name("gemv_tuned_configs.json")
# (out_features, in_features, rows) -> config, for this process's GPU; loaded on first use.
_tuned: dict[tuple[int, int, int], GemvConfig] | None = None


@triton.jit
def gemv_fwd_kernel(
    x, w, out, M, N, K, k_per_split, stride_xm, stride_wn, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (n, s): out[s, :, n-block] = x[:, s's K range] @ w[n-block, s's K range].T. BLOCK_M 1 reduces
    with a row sum; larger BLOCK_M (at least 16) multiplies on the tensor cores."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_n = offs_n < N
    m_m = offs_m < M
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    p_w = w + offs_n[:, None].to(tl.int64) * stride_wn
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        m_k = offs_k < k_hi
        b_w = tl.load(p_w + offs_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        if BLOCK_M == 1:
            b_x = tl.load(x + offs_k, mask=m_k, other=0.0).to(tl.float32)
            acc += tl.sum(b_w.to(tl.float32) * b_x[None, :], axis=1)
        else:
            b_x = tl.load(x + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_m[:, None] & m_k[None, :],
                          other=0.0)
            acc = tl.dot(b_x, tl.trans(b_w), acc)
    p_out = out + pid_s * stride_os
    if BLOCK_M == 1:
        tl.store(p_out + offs_n, acc.to(out.dtype.element_ty), mask=m_n)
    else:
        tl.store(p_out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=m_m[:, None] & m_n[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """x [M, K] (rows contiguous in K) @ w [N, K].T (contiguous) -> [M, N] in x's dtype; M at most 16."""
    num_rows, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or num_rows > 16 or x.stride(-1) != 1 or not w.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} (at most 16 rows, last dim contiguous) against w {tuple(w.shape)} "
                         "(contiguous [N, K])")
    split = max(1, config.split)
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    block_m = 1 if num_rows == 1 else 16
    partial = torch.empty((split, num_rows, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), split)
    gemv_fwd_kernel[grid](
        x, w, partial, num_rows, n, k, k_per_split, x.stride(0), w.stride(0), partial.stride(0), partial.stride(1),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return partial[0] if split == 1 else partial.sum(0).to(x.dtype)


def tuned_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """gemv with the shipped configuration for this GPU, shape and row count; None where none is shipped (or the
    operands are not bf16 with contiguous rows): the caller runs cuBLAS."""
    global _tuned
    if _tuned is None:
        _tuned = load_tuned_configs(x.device)
    config = _tuned.get((w.shape[0], w.shape[1], x.shape[0])) if x.dim() == 2 else None
    if config is None or x.dtype != torch.bfloat16 or w.dtype != x.dtype or x.stride(-1) != 1 \
            or not w.is_contiguous():
        return None
    return gemv(x, w, config)


def load_tuned_configs(device: torch.device) -> dict[tuple[int, int, int], GemvConfig]:
    """The shipped table's entries for this GPU and Triton version (none for another version: timings differ)."""
    from headroom.kernels.tuned_table import entries_for

    return {(c["n"], c["k"], c["m"]): GemvConfig(c["block_n"], c["block_k"], c["split"], c["num_warps"],
                                                  c["num_stages"]) for c in entries_for(TUNED_CONFIGS, device)}
