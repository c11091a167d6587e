"""Triton GEMMs that read quantized weights directly: y [M, N] = x [M, K] @ w.T, w in the checkpoint's layout
(kernels/quant_weight.py). Each K tile lies inside one scale block / group, so the scale multiplies the tile's
partial product once per output column.

Decode (small M) is bandwidth-bound: K is split across programs so that enough of them stream the weight at
once, and the splits of one output tile are summed in the kernel by the last one to finish (a per-tile arrival
counter), so a linear is one launch, not a GEMM plus a reduction plus a cast. Prefill (M >= DENSE_MIN_ROWS) is
compute-bound: the weight is dequantized into a transient bf16 copy and multiplied by cuBLAS, whose GEMM this
kernel does not beat; the copy is one layer's weight at a time (the planner prices the largest as
weight_dequant_transient)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from headroom.kernels.quant_weight import INT4_SYMMETRIC_ZERO, QuantizedWeight

# Programs to keep in flight per SM before splitting K (decode is bandwidth-bound: fill the machine).
_PROGRAMS_PER_SM = 2
# From this many rows on, dequantize-then-cuBLAS: the dequantization reads the weight once and writes it
# once (3 bytes per fp8 weight), a cost that M rows of GEMM hide. Measured on the H200 (bench/quant_kernels.py).
DENSE_MIN_ROWS = 128
# Rows up to which the swap-AB decode kernel runs (the M-major GEMM above it, then cuBLAS from DENSE_MIN_ROWS),
# and up to which the CUDA-core kernel competes with it (each row is another pass over the decoded tile).
GEMV_MAX_ROWS = 16
CORES_MAX_ROWS = 4
# Arrival counters of split-K output tiles; every tile's counter is back at zero when its kernel ends.
_COUNTER_SLOTS = 1 << 16


@triton.jit
def _weight_tile(
    w, s, z, o_n, m_n, k0, K, stride_wn, stride_sn, stride_zn, dtype: tl.constexpr,
    IS_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Weights w[o_n, k0:k0+BLOCK_K] as [BLOCK_N, BLOCK_K] in dtype, unscaled (codes minus zero points for int4,
    exact in bf16), and their scale [BLOCK_N] fp32: the tile lies inside one scale block / group."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    # A split's last tiles may start past K: their scale and zero columns do not exist.
    m_g = m_n & (o_n * 0 + k0 < K)
    if IS_INT4:
        # [BLOCK_N, BLOCK_K / 8] contiguous words, unpacked along a trailing axis of 8 (code k in word k // 8,
        # bits 4 * (k % 8)), so that the reshape keeps k in order.
        o_kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        m_kw = o_kw < tl.cdiv(K, 8)
        b_p = tl.load(w + o_n[:, None] * stride_wn + o_kw[None, :], mask=m_n[:, None] & m_kw[None, :], other=0)
        b_q = (b_p[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        b_q = tl.reshape(b_q, [b_p.shape[0], BLOCK_K])
        if HAS_ZERO:
            b_zp = tl.load(z + (o_n // 8) * stride_zn + k0 // SCALE_BK, mask=m_g, other=0)
            b_zero = (b_zp >> ((o_n % 8) * 4)) & 0xF
        else:
            b_zero = tl.full(o_n.shape, ZERO, dtype=tl.int32)
        # Columns past K meet zeros in x (or are masked at the store).
        b_w = (b_q - b_zero[:, None]).to(dtype)
        b_s = tl.load(s + o_n * stride_sn + k0 // SCALE_BK, mask=m_g, other=0.0).to(tl.float32)
    else:
        m_w = m_n[:, None] & (o_k < K)[None, :]
        b_w = tl.load(w + o_n[:, None] * stride_wn + o_k[None, :], mask=m_w, other=0.0).to(dtype)
        b_s = tl.load(s + (o_n // SCALE_BN) * stride_sn + k0 // SCALE_BK, mask=m_g, other=0.0).to(tl.float32)
    return b_w, b_s


@triton.jit
def _split_total(b_acc, ws, counters, tile, offsets, mask, num_splits, i_s, split_numel, SPLIT: tl.constexpr):
    """(b_acc summed over the tile's splits, whether this program holds that sum): without a split b_acc itself;
    with one (split K) b_acc is parked in the workspace and the tile's last split to arrive sums all of them and
    resets the tile's counter (the others' loads are masked off). offsets: the elements' offsets inside one
    split's [M, N]. (A mask and the scalar `last` combine by tl.where: `mask & last` is an integer tensor in
    Triton's interpreter, which its loads and stores refuse as a mask.)"""
    if SPLIT:
        tl.store(ws + i_s * split_numel + offsets, b_acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel")
        last = arrived == num_splits - 1
        b_sum = tl.zeros(b_acc.shape, dtype=tl.float32)
        for j in range(0, num_splits):
            b_sum += tl.load(ws + j * split_numel + offsets, mask=tl.where(last, mask, False), other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(counters + tile, 0, mask=last)
    else:
        b_sum = b_acc
        last = tile >= 0
    return b_sum, last


@triton.jit
def _finish_split(
    b_acc, p_o, ws, counters, tile, offsets, mask, num_splits, i_s, split_numel, SPLIT: tl.constexpr,
):
    """Store b_acc at p_o, summed over the tile's splits first where K is split (_split_total)."""
    b_sum, last = _split_total(b_acc, ws, counters, tile, offsets, mask, num_splits, i_s, split_numel, SPLIT)
    tl.store(p_o, b_sum.to(p_o.dtype.element_ty), mask=tl.where(last, mask, False))


@triton.jit
def quant_gemv_fwd_kernel(
    x, w, s, z, o, ws, counters, M, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
    num_splits, IS_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, USE_MMA: tl.constexpr,
):
    """Decode rows (M <= BLOCK_M) against BLOCK_N weight rows a program.
    USE_MMA ("swap AB"): out.T = W @ x.T, the weight tile the MMA's wide A operand, loaded as stored (K
    contiguous), the few rows of x its narrow B operand. Otherwise ("cores", fp8, M <= 4) no MMA: each weight
    tile is converted once in registers and dotted with every row on the CUDA cores."""
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    m_n, m_m = o_n < N, o_m < M
    b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = i_s * k_per_split
    for i_k in range(0, tl.cdiv(k_per_split, BLOCK_K)):
        k0 = k_start + i_k * BLOCK_K
        if USE_MMA:
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_xt = tl.load(x + o_m[None, :] * stride_xm + o_k[:, None], mask=m_m[None, :] & (o_k < K)[:, None],
                           other=0.0)
            b_w, b_s = _weight_tile(w, s, z, o_n, m_n, k0, K, stride_wn, stride_sn, stride_zn, b_xt.dtype, IS_INT4,
                                    HAS_ZERO, ZERO, SCALE_BN, SCALE_BK, BLOCK_K)
            b_acc += tl.dot(b_w, b_xt, out_dtype=tl.float32) * b_s[:, None]
        else:
            b_acc += _cores_tile(x, w, s, o_n, m_n, o_m, k0, M, K, stride_xm, stride_wn, stride_sn, SCALE_BN,
                                 SCALE_BK, BLOCK_M, BLOCK_K)
    offsets = o_m[None, :] * N + o_n[:, None]
    _finish_split(b_acc, o + o_m[None, :] * stride_om + o_n[:, None], ws, counters, i_n, offsets,
                  m_n[:, None] & m_m[None, :], num_splits, i_s, M * N, SPLIT)


@triton.jit
def _cores_tile(
    x, w, s, o_n, m_n, o_m, k0, M, K, stride_xm, stride_wn, stride_sn, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """[BLOCK_N, BLOCK_M] fp32: fp8 weight rows o_n, columns k0..k0+BLOCK_K, against each row of x, on CUDA cores
    (int4 takes kernels/quant_gemv.py, which decodes codes without conversions)."""
    b_part = tl.zeros([o_n.shape[0], BLOCK_M], dtype=tl.float32)
    m_g = m_n & (o_n * 0 + k0 < K)
    o_k = k0 + tl.arange(0, BLOCK_K)
    b_w = tl.load(w + o_n[:, None] * stride_wn + o_k[None, :], mask=m_n[:, None] & (o_k < K)[None, :],
                  other=0.0).to(tl.float32)
    b_s = tl.load(s + (o_n // SCALE_BN) * stride_sn + k0 // SCALE_BK, mask=m_g, other=0.0).to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        b_x = tl.load(x + m * stride_xm + o_k, mask=(o_k < K) & (o_k * 0 + m < M), other=0.0).to(tl.float32)
        part = tl.sum(b_w * b_x[None, :], 1) * b_s
        b_part += tl.where((o_m == m)[None, :], part[:, None], 0.0)
    return b_part


@triton.jit
def _tile_product(
    x, w, s, z, o_m, o_n, m_m, m_n, k0, K, stride_xm, stride_wn, stride_sn, stride_zn,
    IS_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """x[o_m, k0:k0+BLOCK_K] @ w[o_n, same].T, scaled: [BLOCK_M, BLOCK_N] fp32."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0.0)
    b_w, b_s = _weight_tile(w, s, z, o_n, m_n, k0, K, stride_wn, stride_sn, stride_zn, b_x.dtype, IS_INT4, HAS_ZERO,
                            ZERO, SCALE_BN, SCALE_BK, BLOCK_K)
    return tl.dot(b_x, tl.trans(b_w), out_dtype=tl.float32) * b_s[None, :]


@triton.jit
def quant_matmul_fwd_kernel(
    x, w, s, z, o, ws, counters, M, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
    num_splits, IS_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    m_o = m_m[:, None] & m_n[None, :]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = i_s * k_per_split
    for i_k in range(0, tl.cdiv(k_per_split, BLOCK_K)):
        b_acc += _tile_product(x, w, s, z, o_m, o_n, m_m, m_n, k_start + i_k * BLOCK_K, K, stride_xm, stride_wn,
                               stride_sn, stride_zn, IS_INT4, HAS_ZERO, ZERO, SCALE_BN, SCALE_BK, BLOCK_K)
    _finish_split(b_acc, o + o_m[:, None] * stride_om + o_n[None, :], ws, counters, i_m * tl.num_programs(1) + i_n,
                  o_m[:, None] * N + o_n[None, :], m_o, num_splits, i_s, M * N, SPLIT)


@triton.jit
def dequantize_fwd_kernel(
    w, s, z, o, N, K, stride_wn, stride_sn, stride_zn, stride_on,
    IS_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """o [N, K] (x's dtype) = the dequantized weight, one [BLOCK_N, BLOCK_K] tile (inside one scale block) a program."""
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_n = o_n < N
    b_w, b_s = _weight_tile(w, s, z, o_n, m_n, i_k * BLOCK_K, K, stride_wn, stride_sn, stride_zn, tl.float32,
                            IS_INT4, HAS_ZERO, ZERO, SCALE_BN, SCALE_BK, BLOCK_K)
    value = b_w * b_s[:, None]
    tl.store(o + o_n[:, None] * stride_on + o_k[None, :], value.to(o.dtype.element_ty),
             mask=m_n[:, None] & (o_k < K)[None, :])


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


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters (zeroed once; every kernel leaves them at zero). Made on the
    first, eager call: the warm-up runs every shape class before decode graphs are captured."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _launch_args(weight: QuantizedWeight) -> dict:
    zero = weight.zero if weight.zero is not None else weight.scale
    return {"z": zero, "stride_zn": zero.stride(0), "IS_INT4": weight.method == "int4_group",
            "HAS_ZERO": weight.zero is not None, "ZERO": INT4_SYMMETRIC_ZERO, "SCALE_BN": weight.block[0],
            "SCALE_BK": weight.block[1]}


def dequantize_fwd(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in dtype (the reference is naive_dequantize)."""
    n, k = weight.shape
    out = torch.empty((n, k), device=weight.device, dtype=dtype)
    block_n, block_k = 32, _tile_k(weight.block[1])
    dequantize_fwd_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.data, weight.scale, o=out, N=n, K=k, stride_wn=weight.data.stride(0), stride_sn=weight.scale.stride(0),
        stride_on=out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **_launch_args(weight),
    )
    return out


def _splits(tiles: int, k: int, block_k: int, device: torch.device, programs_per_sm: int) -> tuple[int, int]:
    """(splits, K per split) so that about programs_per_sm programs per SM stream the weight."""
    split = max(1, min(triton.cdiv(programs_per_sm * _num_sms(device), tiles), triton.cdiv(k, block_k)))
    if tiles > _COUNTER_SLOTS:
        split = 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def quant_matmul_fwd(x: torch.Tensor, weight: QuantizedWeight, kernel: str | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, contiguous rows) -> [M, N] in x's dtype, in one launch. kernel: "stream" or
    "cores" (M <= 4), "swap_ab" (M <= 64) or "m_major"; None: pick_kernel's rule for these rows and format."""
    m, k = x.shape
    n = weight.out_features
    block_k = _tile_k(weight.block[1])
    kernel = kernel or pick_kernel(x, weight)
    if kernel == "stream":
        from headroom.kernels.quant_gemv import quant_stream_fwd

        return quant_stream_fwd(x, weight)
    programs_per_sm = _PROGRAMS_PER_SM
    if kernel == "cores":
        if weight.method != "fp8_block":
            raise ValueError("the CUDA-core kernel reads fp8 blocks; int4 rows take the stream kernel")
        if m > CORES_MAX_ROWS:
            raise ValueError(f"the CUDA-core kernel takes at most {CORES_MAX_ROWS} rows, got {m}")
        block_m, block_n = triton.next_power_of_2(m), 32
        tiles = triton.cdiv(n, block_n)
        grid_mn: tuple[int, ...] = (tiles,)
        launch, extra = quant_gemv_fwd_kernel, {"USE_MMA": False}
        # No MMA pipeline hides the loads' latency: more programs in flight instead.
        programs_per_sm = 4 * _PROGRAMS_PER_SM
    elif kernel == "swap_ab":
        block_m, block_n = max(16, triton.next_power_of_2(m)), 128
        tiles = triton.cdiv(n, block_n)
        grid_mn = (tiles,)
        launch, extra = quant_gemv_fwd_kernel, {"USE_MMA": True}
    else:
        block_m = 16 if m <= 16 else 64
        block_n = 64 if m <= 64 else 128
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        launch, extra = quant_matmul_fwd_kernel, {}
    split, k_per_split = _splits(tiles, k, block_k, x.device, programs_per_sm)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    workspace = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    launch[(*grid_mn, split)](
        x, weight.data, weight.scale, o=out, ws=workspace, counters=_counters(x.device), M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_wn=weight.data.stride(0), stride_sn=weight.scale.stride(0),
        stride_om=out.stride(0), k_per_split=k_per_split, num_splits=split, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT=split > 1, num_warps=4, num_stages=3, **_launch_args(weight), **extra,
    )
    return out


def pick_kernel(x: torch.Tensor, weight: QuantizedWeight) -> str:
    """The decode kernel for these rows and this format, a rule read off the H200 (bench/quant_kernels.py at the
    4B shapes, CUDA-graph replay over weights larger than L2; bench/results/session8/callB_quant_kernels.json):
    - int4, 1-4 rows: stream (fastest at 1-2 rows on all five shapes, e.g. gate_up 17 us against 30-34 for the
      others; at 4 rows within a few us of the best);
    - fp8, 1-2 rows: cores (e.g. gate_up 11 us, swap_ab 20, the dense bf16 weight under cuBLAS 14);
    - 5-16 rows (fp8 from 3): m_major where it was the faster of the two MMA kernels on most shapes (fp8, int4
      symmetric), swap_ab otherwise (int4 with zero points).
    A per-shape timing at start-up picked these before; it timed one launch on a weight that stays in L2 and chose
    the wrong kernel in 51 of 75 cases."""
    m = x.shape[0]
    if m > GEMV_MAX_ROWS:
        return "m_major"
    if weight.method == "int4_group":
        if m <= CORES_MAX_ROWS:
            return "stream"
        return "swap_ab" if weight.zero is not None else "m_major"
    return "cores" if m <= 2 else "m_major"


def quant_matmul(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 dense_min_rows: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight.T (+ bias) -> [..., N]; the launcher validates shapes.
    dense_min_rows: rows from which to dequantize and use cuBLAS (default DENSE_MIN_ROWS; the CPU tests and
    the bench set it to test either path)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} input features but the weight expects {weight.in_features}")
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    threshold = DENSE_MIN_ROWS if dense_min_rows is None else dense_min_rows
    if flat.shape[0] >= threshold:
        out = F.linear(flat, dequantize_fwd(weight, flat.dtype))
    else:
        out = quant_matmul_fwd(flat, weight)
    out = out.view(*x.shape[:-1], weight.out_features)
    return out + bias if bias is not None else out
