"""Decode rows (1-4) against a quantized weight on the CUDA cores, streaming the codes at HBM speed:
y [M, N] = x [M, K] @ dequantized w.T, w int4 groups or fp8 blocks in the checkpoint's layout
(kernels/quant_weight.py). The reference is naive_quant_linear; kernels/quant_matmul.py dispatches here.

Why a kernel of its own: at one row a decode GEMM is a stream of weight bytes, and an int4 weight is 8 codes a
32-bit word, so the cost is the ALU work per code, not the MMA. The obvious decode (shift, mask, int-to-float
convert, subtract the zero point) spends a quarter-rate conversion on every code, which caps the H200 at about
half its bandwidth on int4 (sessions 3-7: 9-38% of HBM against cuBLAS's 53-78% on bf16). Here a code becomes a
float without a conversion: OR-ing a masked nibble into the mantissa of 2^23 gives the float 2^23 + code * 16^j
exactly (the mantissa holds 23 bits), and subtracting 2^23 leaves code * 16^j; the 16^-j goes into x (a power of
two, exact), so each code costs one mask-and-or, one subtract and one FMA, with no shift for the low five
nibbles and one shift per word for the top three. The zero point and the group scale are applied once per
word lane (sum over the group of (code - zero) * x = sum code * x - zero * sum x), not per code.

Each program streams a [BLOCK_N, BLOCK_K] tile of the weight per step, BLOCK_K dividing the scale group so that
a tile has one scale per row; K is split across programs to fill the SMs, and the last split of an output tile
to arrive sums the splits (quant_matmul's arrival counters), so a linear is one launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from headroom.kernels.quant_matmul import CORES_MAX_ROWS, _counters, _finish_split, _launch_args, _splits
from headroom.kernels.quant_weight import QuantizedWeight

# Rows this kernel takes, as for quant_matmul's other CUDA-core kernel: each further row is another FMA per
# code, and from a few rows on the tensor-core kernels (swap_ab) win on the ALU budget.
STREAM_MAX_ROWS = CORES_MAX_ROWS
# 2^23 as a float: a nibble OR-ed into its mantissa reads as 2^23 + the nibble's value.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)


@dataclass(frozen=True)
class StreamConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4


@triton.jit
def _int4_tile(w, o_n, m_n, o_m, m_m, x, stride_xm, stride_wn, k0, K, BLOCK_K: tl.constexpr):
    """(sum over each word lane of code * x, sum over it of x): [BLOCK_M, BLOCK_N, BLOCK_K / 8] and
    [BLOCK_M, BLOCK_K / 8], fp32, for weight rows o_n and columns k0..k0+BLOCK_K (codes not yet offset)."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    o_w = k0 // 8 + tl.arange(0, BLOCK_W)
    words = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + o_w[None, :],
                    mask=m_n[:, None] & (o_w < tl.cdiv(K, 8))[None, :], other=0)
    high = words >> 20
    b_dot = tl.zeros([o_m.shape[0], o_n.shape[0], BLOCK_W], dtype=tl.float32)
    b_xsum = tl.zeros([o_m.shape[0], BLOCK_W], dtype=tl.float32)
    for j in tl.static_range(8):
        # Nibbles 0-4 sit in the low 20 bits and are read in place; 5-7 from the word shifted right by 20.
        if j < 5:
            bits = (words & (0xF << (4 * j))) | _MAGIC_BITS
            inv = 1.0 / (1 << (4 * j))
        else:
            bits = (high & (0xF << (4 * (j - 5)))) | _MAGIC_BITS
            inv = 1.0 / (1 << (4 * (j - 5)))
        # code * 16^j, exact in fp32
        b_code = bits.to(tl.float32, bitcast=True) - _MAGIC
        o_k = o_w * 8 + j
        b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :],
                      other=0.0).to(tl.float32)
        b_xsum += b_x
        b_dot += b_code[None, :, :] * (b_x * inv)[:, None, :]
    return b_dot, b_xsum


@triton.jit
def quant_stream_kernel(
    x, w, s, z, o, ws, counters, M, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
    num_splits, IS_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (n, s): rows o_n of the output against split s's K range, every row of x at once."""
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    m_n, m_m = o_n < N, o_m < M
    k_lo = i_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # int4 keeps one partial sum per word lane (reduced once at the end); fp8 reduces each tile.
    if IS_INT4:
        BLOCK_W: tl.constexpr = BLOCK_K // 8
        b_acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], dtype=tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        # The tile's scale group (int4: per row; fp8: per block of SCALE_BN rows).
        if IS_INT4:
            b_s = tl.load(s + o_n * stride_sn + k0 // SCALE_BK, mask=m_n, other=0.0).to(tl.float32)
            b_dot, b_xsum = _int4_tile(w, o_n, m_n, o_m, m_m, x, stride_xm, stride_wn, k0, K, BLOCK_K)
            if HAS_ZERO:
                b_zp = tl.load(z + (o_n // 8) * stride_zn + k0 // SCALE_BK, mask=m_n, other=0)
                b_zero = ((b_zp >> ((o_n % 8) * 4)) & 0xF).to(tl.float32)
            else:
                b_zero = tl.full([BLOCK_N], ZERO, dtype=tl.float32)
            b_acc += (b_dot - b_zero[None, :, None] * b_xsum[:, None, :]) * b_s[None, :, None]
        else:
            b_s = tl.load(s + (o_n // SCALE_BN) * stride_sn + k0 // SCALE_BK, mask=m_n, other=0.0).to(tl.float32)
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :],
                          mask=m_n[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)
            b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :],
                          other=0.0).to(tl.float32)
            b_acc += tl.sum(b_w[None, :, :] * b_x[:, None, :], axis=2) * b_s[None, :]
    if IS_INT4:
        b_out = tl.sum(b_acc, axis=2)
    else:
        b_out = b_acc
    offsets = o_m[:, None] * N + o_n[None, :]
    _finish_split(b_out, o + o_m[:, None] * stride_om + o_n[None, :], ws, counters, i_n, offsets,
                  m_m[:, None] & m_n[None, :], num_splits, i_s, M * N, SPLIT)


def _block_k(scale_bk: int, wanted: int) -> int:
    """The largest K tile up to `wanted` (at least 16) that divides the scale group / block."""
    tile = wanted
    while tile >= 16:
        if scale_bk % tile == 0:
            return tile
        tile //= 2
    raise ValueError(f"scale block of {scale_bk} along K is not a multiple of 16; the stream kernel cannot tile it")


def quant_stream_fwd(x: torch.Tensor, weight: QuantizedWeight, config: StreamConfig = StreamConfig()) -> torch.Tensor:
    """x [M, K] (contiguous rows, M <= STREAM_MAX_ROWS) @ the dequantized weight.T -> [M, N] in x's dtype."""
    m, k = x.shape
    if m > STREAM_MAX_ROWS or k != weight.in_features or x.stride(-1) != 1:
        raise ValueError(f"the stream kernel takes at most {STREAM_MAX_ROWS} contiguous rows of "
                         f"{weight.in_features} features, got x {tuple(x.shape)}")
    n = weight.out_features
    block_k = _block_k(weight.block[1], config.block_k)
    tiles = triton.cdiv(n, config.block_n)
    split, k_per_split = _splits(tiles, k, block_k, x.device, config.programs_per_sm)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    workspace = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    quant_stream_kernel[(tiles, split)](
        x, weight.data, weight.scale, o=out, ws=workspace, counters=_counters(x.device), M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_wn=weight.data.stride(0), stride_sn=weight.scale.stride(0),
        stride_om=out.stride(0), k_per_split=k_per_split, num_splits=split, BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=config.block_n, BLOCK_K=block_k, SPLIT=split > 1, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, **_launch_args(weight),
    )
    return out
