"""Decode rows (1-4) against an int4 weight on the CUDA cores: y [M, N] = x [M, K] @ dequantized w.T, w int4
groups in the checkpoint's pack-quantized layout (kernels/quant_weight.py). The reference is
naive_quant_linear; kernels/quant_matmul.py dispatches here (pick_kernel).

Why a kernel of its own: at one row a decode GEMM is a stream of weight bytes, and an int4 weight is 8 codes a
32-bit word, so the cost is the instructions per code, not the MMA: at 4.3 TB/s the H200 must take 8.6 G codes
a millisecond, and its 132 SMs issue about 33 G lane-instructions, so every instruction a code costs is about
an eighth of the bandwidth. The obvious decode (shift, mask, int-to-float convert, subtract the zero point)
spends a quarter-rate conversion on every code. Here a code becomes a float without one
(kernels/int_float.py): a masked nibble below 2^20 is OR-ed into the mantissa of 2^23 (one LOP3 does the mask
and the OR) and 2^23 subtracted, giving code * 16^j exactly; the 16^-j goes into x (a power of two, exact),
so each code costs a LOP3, an FADD and an FFMA, with one shift per word for the top three nibbles. The zero
point and the group scale are applied once per word lane (sum over a group of (code - zero) * x = sum code *
x - zero * sum x), not per code.

What else a code costs is addressing, which the loop keeps out: pointers advance by a constant a tile, and
when K is a multiple of the tile (every layer of the models served here) no tile carries a mask along K.
bench/kernel_sass.py counts the loop's SASS for sm_90 on a CPU: the session 8 kernel spent 8.75 instructions
a code (86 IMADs and 27 ISETPs a tile of addresses and masks), this one 4.3 at 256 x 128 tiles; session 8's
H200 sweep had that kernel at about 0.8 TB/s whatever the tile, as an instruction-bound kernel would be.

Each program streams a [BLOCK_N, BLOCK_K] tile of the weight per step: BLOCK_K divides the group (one scale per
row) or is a multiple of it (one per word lane). K is split across programs when the row blocks alone do not
fill the SMs, and the last split of an output tile to arrive sums the splits (quant_matmul's arrival
counters), so a linear is one launch. FP8 goes to quant_matmul's cores kernel: on the H200 it streams fp8 2-8x
faster than this layout did (bench/results/session8/callB_quant_kernels.json)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from headroom.kernels.int_float import MAGIC, MAGIC_BITS
from headroom.kernels.quant_matmul import CORES_MAX_ROWS, _counters, _finish_split, _splits
from headroom.kernels.quant_weight import INT4_SYMMETRIC_ZERO, QuantizedWeight

# Rows this kernel takes, as for quant_matmul's other CUDA-core kernel: each further row is another FMA per
# code, and from a few rows on the tensor-core kernels (swap_ab) win on the ALU budget.
STREAM_MAX_ROWS = CORES_MAX_ROWS


@dataclass(frozen=True)
class StreamConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2


TUNED_CONFIGS = Path(__file__).with_name("quant_gemv_tuned_configs.json")
# (out_features, in_features, rows bucket 1 or 4) -> config, for this process's GPU; loaded on first use.
_tuned: dict[tuple[int, int, int], StreamConfig] | None = None


def rows_bucket(rows: int) -> int:
    """Tables and defaults are per bucket: 1-2 rows (timed at 1) and 3-4 (timed at 4)."""
    return 1 if rows <= 2 else 4


def default_config(rows: int) -> StreamConfig:
    """Where no table entry holds: 128 x 128 tiles with 4 programs an SM for one or two rows (48.5 us over the five
    4B shapes at one row, against 57.4 for session 8's 64 x 128 with 2; bench/results/session9/
    call1_quant_kernels.json), 128 x 64 for three or four (session 8's, still the best total at four rows there)."""
    return StreamConfig(block_n=128, programs_per_sm=4) if rows_bucket(rows) == 1 else StreamConfig(block_n=128,
                                                                                                    block_k=64)


def stream_config(n: int, k: int, rows: int, device: torch.device) -> StreamConfig:
    """The shipped table's configuration for this GPU, shape and row bucket, else default_config(rows)."""
    global _tuned
    if _tuned is None:
        from headroom.kernels.tuned_table import entries_for

        _tuned = {(c["n"], c["k"], c["m"]): StreamConfig(c["block_n"], c["block_k"], c["num_warps"], c["num_stages"],
                                                         c["programs_per_sm"])
                  for c in entries_for(TUNED_CONFIGS, device)}
    return _tuned.get((n, k, rows_bucket(rows))) or default_config(rows)


@triton.jit
def _x_pair(p_x, i, o_m, m_m, k_left, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr):
    """x at columns 2i and 2i + 1 of each word lane, fp32 [BLOCK_M, BLOCK_K / 8] each. X_PAIRS: x is bf16 read as
    int32 pairs (p_x at the lanes' first pair), so each load is 4 bytes, which the pipeliner copies ahead
    asynchronously like the weight tiles (a 2-byte load it cannot); the halves are bf16's top bits of fp32."""
    o_k = tl.arange(0, BLOCK_K // 8) * 8 + 2 * i
    if EVEN_K:
        mask = m_m[:, None]
    else:
        mask = m_m[:, None] & (o_k < k_left)[None, :]
    if X_PAIRS:
        pair = tl.load(p_x + i, mask=mask, other=0)
        return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)
    if not EVEN_K:
        mask2 = m_m[:, None] & (o_k + 1 < k_left)[None, :]
    else:
        mask2 = mask
    return (tl.load(p_x + 2 * i, mask=mask, other=0.0).to(tl.float32),
            tl.load(p_x + 2 * i + 1, mask=mask2, other=0.0).to(tl.float32))


@triton.jit
def _int4_tile(words, p_x, o_m, m_m, k_left, magic_bits, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               X_PAIRS: tl.constexpr):
    """(sum over each word lane of code * x, sum over it of x): [BLOCK_M, BLOCK_N, BLOCK_K / 8] and
    [BLOCK_M, BLOCK_K / 8], fp32, for a tile of words [BLOCK_N, BLOCK_K / 8] (codes not yet offset) whose first
    column's x is at p_x [BLOCK_M, BLOCK_K / 8] (a word lane apart: 8 columns, or 4 pairs); columns from k_left on
    count as absent unless EVEN_K."""
    # Nibbles 0-4 sit in the low 20 bits and are read in place; 5-7 from the word shifted right by 20 (logically:
    # an arithmetic shift costs a sign extension per word).
    high = (words.to(tl.uint32, bitcast=True) >> 20).to(tl.int32, bitcast=True)
    b_dot = tl.zeros([o_m.shape[0], words.shape[0], words.shape[1]], dtype=tl.float32)
    b_xsum = tl.zeros([o_m.shape[0], words.shape[1]], dtype=tl.float32)
    for j in tl.static_range(8):
        # code * 16^j (below 2^20), exact in fp32 (kernels/int_float.py); the 16^-j goes into x (exact)
        if j < 5:
            b_code = (words & (0xF << (4 * j))) | magic_bits
            inv = 1.0 / (1 << (4 * j))
        else:
            b_code = (high & (0xF << (4 * (j - 5)))) | magic_bits
            inv = 1.0 / (1 << (4 * (j - 5)))
        b_code = b_code.to(tl.float32, bitcast=True) - MAGIC
        if j % 2 == 0:
            b_x_even, b_x_odd = _x_pair(p_x, j // 2, o_m, m_m, k_left, BLOCK_K, EVEN_K, X_PAIRS)
            b_x = b_x_even
        else:
            b_x = b_x_odd
        b_xsum += b_x
        b_dot += b_code[None, :, :] * (b_x * inv)[:, None, :]
    return b_dot, b_xsum


@triton.jit
def _group_params(s, z, o_n, m_n, k0, o_w, K, stride_sn, stride_zn, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr,
                  SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr):
    """(scale, zero point) fp32 of the tile's groups, broadcastable against [BLOCK_N, BLOCK_K / 8]: one per row
    when the tile lies inside one group, one per (row, word lane) when it spans several."""
    if BLOCK_K > SCALE_BK:
        i_g = (o_w * 8) // SCALE_BK
        m_g = m_n[:, None] & (o_w * 8 < K)[None, :]
        b_s = tl.load(s + o_n[:, None] * stride_sn + i_g[None, :], mask=m_g, other=0.0).to(tl.float32)
        if HAS_ZERO:
            b_zp = tl.load(z + (o_n // 8)[:, None] * stride_zn + i_g[None, :], mask=m_g, other=0)
            b_zero = ((b_zp >> ((o_n % 8) * 4)[:, None]) & 0xF).to(tl.float32)
        else:
            b_zero = tl.full([o_n.shape[0], o_w.shape[0]], ZERO, dtype=tl.float32)
    else:
        b_s = tl.load(s + o_n * stride_sn + k0 // SCALE_BK, mask=m_n, other=0.0).to(tl.float32)[:, None]
        if HAS_ZERO:
            b_zp = tl.load(z + (o_n // 8) * stride_zn + k0 // SCALE_BK, mask=m_n, other=0)
            b_zero = ((b_zp >> ((o_n % 8) * 4)) & 0xF).to(tl.float32)[:, None]
        else:
            b_zero = tl.full([o_n.shape[0], 1], ZERO, dtype=tl.float32)
    return b_s, b_zero


@triton.jit
def quant_stream_kernel(
    x, w, s, z, o, ws, counters, M, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
    num_splits, magic_bits, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr,
):
    """Program (n, s): rows o_n of the output against split s's K range, every row of x at once. One partial
    sum per (row, word lane), reduced once at the end. EVEN_K: K is a multiple of BLOCK_K (so is every split),
    and no tile needs a mask along K."""
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    m_n, m_m = o_n < N, o_m < M
    k_lo = i_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    o_w = tl.arange(0, BLOCK_W)
    # k_per_split is a multiple of BLOCK_K: a split's words start BLOCK_W-word aligned (128-bit loads).
    k_w = tl.multiple_of(k_lo // 8, BLOCK_W)
    p_w = w + o_n[:, None].to(tl.int64) * stride_wn + (k_w + o_w)[None, :]
    if X_PAIRS:
        # int32 pairs: strides and offsets in pairs
        p_x = x + o_m[:, None] * stride_xm + (k_lo // 2 + o_w * 4)[None, :]
    else:
        p_x = x + o_m[:, None] * stride_xm + (k_lo + o_w * 8)[None, :]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            words = tl.load(p_w, mask=m_n[:, None], other=0)
        else:
            words = tl.load(p_w, mask=m_n[:, None] & (k0 // 8 + o_w < tl.cdiv(k_hi, 8))[None, :], other=0)
        b_dot, b_xsum = _int4_tile(words, p_x, o_m, m_m, k_hi - k0, magic_bits, BLOCK_K, EVEN_K, X_PAIRS)
        b_s, b_zero = _group_params(s, z, o_n, m_n, k0, k0 // 8 + o_w, k_hi, stride_sn, stride_zn, HAS_ZERO, ZERO,
                                    SCALE_BK, BLOCK_K)
        b_acc += (b_dot - b_zero[None, :, :] * b_xsum[:, None, :]) * b_s[None, :, :]
        p_w += BLOCK_W
        p_x += BLOCK_K // 2 if X_PAIRS else BLOCK_K
    offsets = o_m[:, None] * N + o_n[None, :]
    _finish_split(tl.sum(b_acc, axis=2), o + o_m[:, None] * stride_om + o_n[None, :], ws, counters, i_n, offsets,
                  m_m[:, None] & m_n[None, :], num_splits, i_s, M * N, SPLIT)


def _block_k(group: int, wanted: int) -> int:
    """The K tile: `wanted` if it is a multiple of the group (a scale per word lane) or divides it (one per
    row), else the largest power of two below it that divides the group (at least 16)."""
    if wanted % group == 0:
        return wanted
    tile = wanted
    while tile >= 16:
        if group % tile == 0:
            return tile
        tile //= 2
    raise ValueError(f"an int4 group of {group} inputs is not a multiple of 16; the stream kernel cannot tile it")


def quant_stream_fwd(x: torch.Tensor, weight: QuantizedWeight, config: StreamConfig | None = None,
                     x_pairs: bool = True) -> torch.Tensor:
    """x [M, K] (contiguous rows, M <= STREAM_MAX_ROWS) @ the dequantized weight.T -> [M, N] in x's dtype;
    config None: stream_config(M). x_pairs False reads bf16 rows 2 bytes at a time (the bench's comparison)."""
    m, k = x.shape
    config = config or stream_config(weight.out_features, k, m, x.device)
    if weight.method != "int4_group":
        raise ValueError(f"the stream kernel reads int4 groups, not {weight.method} (quant_matmul's cores kernel "
                         "streams fp8 faster)")
    if m > STREAM_MAX_ROWS or k != weight.in_features or x.stride(-1) != 1:
        raise ValueError(f"the stream kernel takes at most {STREAM_MAX_ROWS} contiguous rows of "
                         f"{weight.in_features} features, got x {tuple(x.shape)}")
    n = weight.out_features
    block_k = _block_k(weight.block[1], config.block_k)
    tiles = triton.cdiv(n, config.block_n)
    split, k_per_split = _splits(tiles, k, block_k, x.device, config.programs_per_sm)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    workspace = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    zero = weight.zero if weight.zero is not None else weight.scale
    # The float 2^23's bits go in as an argument, not a constant: a code is one LOP3 ((word & mask) | magic),
    # which takes one immediate; as an argument the magic sits in a register once and the eight masks are the
    # immediates (as a constant, ptxas kept the magic immediate and re-made a mask register before every LOP3:
    # 5.0 against 4.3 instructions a code, bench/kernel_sass.py).
    # bf16 rows go in as int32 pairs (4-byte loads the pipeliner copies ahead; see _x_pair).
    pairs = x_pairs and x.dtype == torch.bfloat16 and k % 2 == 0 and x.stride(0) % 2 == 0
    x_in = x.view(torch.int32) if pairs else x
    quant_stream_kernel[(tiles, split)](
        x_in, weight.data, weight.scale, z=zero, stride_zn=zero.stride(0), o=out, ws=workspace, counters=_counters(x.device), M=m, N=n, K=k,
        stride_xm=x_in.stride(0), stride_wn=weight.data.stride(0), stride_sn=weight.scale.stride(0),
        stride_om=out.stride(0), k_per_split=k_per_split, num_splits=split, magic_bits=MAGIC_BITS.value,
        BLOCK_M=triton.next_power_of_2(m), HAS_ZERO=weight.zero is not None, ZERO=INT4_SYMMETRIC_ZERO,
        SCALE_BK=weight.block[1], BLOCK_N=config.block_n, BLOCK_K=block_k, SPLIT=split > 1,
        NUM_STAGES=config.num_stages, EVEN_K=k % block_k == 0, X_PAIRS=pairs, num_warps=config.num_warps,
    )
    return out
