"""Triton GEMMs that read quantized weights directly: y [M, N] = x [M, K] @ w.T, w in the checkpoint's layout
(kernels/quant_weight.py). Each K tile lies inside one scale block / group, so the scale multiplies the tile's
partial product once per output column. Decode (small M) splits K across programs so that enough of them
stream the weight at once; the fp32 partials are summed afterwards."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from headroom.kernels.quant_weight import INT4_SYMMETRIC_ZERO, QuantizedWeight

# Programs to keep in flight per SM before splitting K (decode is bandwidth-bound: fill the machine).
_PROGRAMS_PER_SM = 2


@triton.jit
def quant_matmul_fwd_kernel(
    x, w, s, z, o, M, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_os, stride_om, k_per_split,
    IS_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = i_s * k_per_split
    for i_k in range(0, tl.cdiv(k_per_split, BLOCK_K)):
        k0 = k_start + i_k * BLOCK_K
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        p_x = x + o_m[:, None] * stride_xm + o_k[None, :]
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        # A split's last tiles may start past K: their scale and zero columns do not exist.
        m_g = m_n & (o_n * 0 + k0 < K)
        if IS_INT4:
            # One load per word: [BLOCK_K / 8, BLOCK_N] words, unpacked to [BLOCK_K, BLOCK_N] codes, code k of
            # row n in word k // 8 at bits 4 * (k % 8).
            o_kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            m_kw = o_kw < tl.cdiv(K, 8)
            b_p = tl.load(w + o_n[None, :] * stride_wn + o_kw[:, None], mask=m_kw[:, None] & m_n[None, :], other=0)
            b_q = (b_p[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
            b_q = tl.reshape(b_q, [BLOCK_K, BLOCK_N])
            if HAS_ZERO:
                b_zp = tl.load(z + (o_n // 8) * stride_zn + k0 // SCALE_BK, mask=m_g, other=0)
                b_zero = (b_zp >> ((o_n % 8) * 4)) & 0xF
            else:
                b_zero = tl.full([BLOCK_N], ZERO, dtype=tl.int32)
            # Codes minus zero points lie in [-15, 15]: exact in bf16. Columns past K meet zeros in x.
            b_w = (b_q - b_zero[None, :]).to(b_x.dtype)
            b_s = tl.load(s + o_n * stride_sn + k0 // SCALE_BK, mask=m_g, other=0.0).to(tl.float32)
        else:
            m_w = m_k[:, None] & m_n[None, :]
            b_w = tl.load(w + o_n[None, :] * stride_wn + o_k[:, None], mask=m_w, other=0.0).to(b_x.dtype)
            b_s = tl.load(s + (o_n // SCALE_BN) * stride_sn + k0 // SCALE_BK, mask=m_g, other=0.0).to(tl.float32)
        b_acc += tl.dot(b_x, b_w, out_dtype=tl.float32) * b_s[None, :]
    p_o = o + i_s * stride_os + o_m[:, None] * stride_om + o_n[None, :]
    tl.store(p_o, b_acc.to(o.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _tile_k(scale_bk: int) -> int:
    """Largest K tile (<= 128, >= 16) that divides the scale block, so one tile sees one scale."""
    for tile in (128, 64, 32, 16):
        if scale_bk % tile == 0:
            return tile
    raise ValueError(f"scale block of {scale_bk} along K is not a multiple of 16; the Triton GEMM cannot tile it")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def quant_matmul_fwd(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, contiguous rows) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.out_features
    scale_bn, scale_bk = weight.block
    block_k = _tile_k(scale_bk)
    block_m = 16 if m <= 16 else 64
    block_n = 64 if m <= 64 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_PROGRAMS_PER_SM * _num_sms(x.device), tiles), triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    zero = weight.zero if weight.zero is not None else weight.scale
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    quant_matmul_fwd_kernel[grid](
        x, weight.data, weight.scale, zero, out, m, n, k, x.stride(0), weight.data.stride(0),
        weight.scale.stride(0), zero.stride(0), out.stride(0), out.stride(1), k_per_split,
        IS_INT4=weight.method == "int4_group", HAS_ZERO=weight.zero is not None, ZERO=INT4_SYMMETRIC_ZERO,
        SCALE_BN=scale_bn, SCALE_BK=scale_bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=2 if weight.method == "int4_group" else 3,
    )
    return out.sum(0).to(x.dtype) if split > 1 else out[0]


def quant_matmul(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight.T (+ bias) -> [..., N]; the launcher validates shapes."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} input features but the weight expects {weight.in_features}")
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = quant_matmul_fwd(flat, weight).view(*x.shape[:-1], weight.out_features)
    return out + bias if bias is not None else out
