"""Skinny matrix products for decode: y [M, N] = x [M, K] @ w [N, K].T for M of 1 to 16 rows, bf16 weights read
once at full width. Decode is bound by the weight bytes; each program streams a [BLOCK_N, K / SPLIT] strip of w
and keeps its accumulator in registers, so the grid is sized to the SMs and not to M. A split over K parks fp32
partial sums that the output block's last split to finish adds, in the same launch. Reference: torch's F.linear
(the CPU path).

One row runs on the CUDA cores at about 2.6 sm_90 instructions a weight element in the loop (bench/kernel_sass.py
gemv; 5.1-5.8 with a row sum every tile): an FFMA, a mask or a shift from a bf16 pair to fp32, a 16-byte load an
eighth. bf16 at 4.3 TB/s is 8 weights a cycle an SM against 128 lane-instructions issued, so the loop leaves the
warps' issue slots mostly to memory; what it needs is bytes in flight, which the sweep buys with tiles, stages
and splits.

Whether this beats cuBLAS at a shape is measured, not assumed: bench/engine_speed.py's gemv part times both per
shape and batch, and gemv_tuned_configs.json ships, per GPU and Triton version, the shapes where this kernel won
with the configuration that did; tuned_gemv runs those and returns None for every other shape (cuBLAS then).

silu_mul_gemv is SwiGLU's down projection with the activation fused (the kernel's SILU_MUL): the input row is
silu(gate) * up, made from the gate|up projection's output as each tile is loaded, rounded as kernels/gates.py's
silu_mul rounds it, so decode skips that kernel, its launch and its [M, I] round trip. Its table entries are
separate (input "silu_mul"), timed against silu_mul + cuBLAS.

Several rows with swap_ab (GemvConfig) compute out.T = w @ x.T: the weight tile is the MMA's M operand and the 16
rows of x its N, so a tile of 64 or 128 weight rows can be Hopper's wgmma (M >= 64 a warpgroup) and each pipeline
stage streams a wide weight tile; without it the 16 rows are the M side, too few for wgmma.

Two to eight rows with rows_on_cores (GemvConfig) stay on the CUDA cores as one row does: each weight pair is
unpacked once and is then one FFMA a row (acc [BLOCK_M, BLOCK_N, units], BLOCK_M the rows rounded up to a power of
two): 10.9-12.4 sm_90 instructions a weight element at 8 rows with 3 stages (8 of them FFMAs), against the 16 a
cycle's issue leaves at 4.3 TB/s; the tensor-core tiles reached only ~3.5 TB/s at 8 rows (session 12). Fused
(SILU_MUL) it is ~29: every thread recomputes silu for each row of the x units it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from headroom.kernels.pdl import pdl_launch
from headroom.kernels.quant_matmul import _COUNTER_SLOTS, _counters, _finish_split
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 256
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Several rows only (one row ignores it): the weight tile as the MMA's M operand, acc [BLOCK_N, 16].
    swap_ab: bool = False
    # 2 to 8 rows on the CUDA cores (CORE_ROWS; swap_ab then ignored); one row and 9-16 rows ignore it.
    rows_on_cores: bool = False
    # Weight tiles a program loads before waiting on the kernel before it (PDL; 1, 2 or 4, at most a split's tiles):
    # in a decode step the next GEMV's weights then stream while the small kernels between two GEMVs run
    # (bench/pdl_probe.py: a 4 MiB streaming kernel 3.19 us with PDL, 1.37 with all its weights loaded first).
    prefetch: int = 1


# The most rows CORE_ROWS takes: each row is another FFMA a weight element, and at 8 the loop already issues
# 11-12 instructions a weight element of the 16 a cycle leaves at full bandwidth (see the module docstring).
CORE_ROWS_MAX = 8
# fp32 accumulator registers a thread CORE_ROWS keeps across the loop (BLOCK_M x BLOCK_N x units over the threads)
# before the launch sums over the units every tile instead (ROW_SUM; see gemv_fwd_kernel).
CORE_ROWS_ACC_REGS = 128


TUNED_CONFIGS = Path(__file__).with_name("gemv_tuned_configs.json")
# A table entry's "input": the row as given, or SwiGLU's gate and up halves with the row silu(gate) * up
# (silu_mul_gemv: the down projection with its activation fused). A key of its own, so that the plain down
# shape's entry (timed against cuBLAS alone) and the fused one (against silu_mul + cuBLAS) cannot be confused.
PLAIN_INPUT, SILU_MUL_INPUT = "x", "silu_mul"
# (out_features, in_features, rows, input) -> config, for this process's GPU; loaded on first use.
_tuned: dict[tuple[int, int, int, str], GemvConfig] | None = None


@triton.jit
def _silu_mul(g, u, dtype: tl.constexpr):
    """silu(g) * u of fp32 g, u as gates_triton's silu_mul kernel computes it in `dtype`: the silu rounded to dtype,
    then the product (each unfused bf16 op rounds its result), back in fp32. So the fused down projection reads
    exactly the activation that silu_mul + gemv would have stored and read back."""
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u).to(dtype).to(tl.float32)


@triton.jit
def _products(acc, w_lo, x_lo, w_hi, x_hi, HI: tl.constexpr, ROWS: tl.constexpr, ROW_SUM: tl.constexpr):
    """acc plus w_lo * x_lo (and w_hi * x_hi where HI: the pairs' high elements): weights [BLOCK_N, units] against
    one row's x [units] (acc [BLOCK_N, units]) or, ROWS, [BLOCK_M, units] (acc [BLOCK_M, BLOCK_N, units], or with
    ROW_SUM [BLOCK_M, BLOCK_N], summed over the units here: one reduction a tile for both halves)."""
    if ROWS and ROW_SUM:
        prod = w_lo[None, :, :] * x_lo[:, None, :]
        if HI:
            prod += w_hi[None, :, :] * x_hi[:, None, :]
        acc += tl.sum(prod, axis=2)
    else:
        if ROWS:
            w_a, x_a, w_b, x_b = w_lo[None, :, :], x_lo[:, None, :], w_hi[None, :, :], x_hi[:, None, :]
        else:
            w_a, x_a, w_b, x_b = w_lo, x_lo[None, :], w_hi, x_hi[None, :]
        # two accumulations, not acc + (lo + hi): that compiles to FMUL, FFMA, FADD
        acc += w_a * x_a
        if HI:
            acc += w_b * x_b
    return acc


@triton.jit
def _accumulate(acc, b_w, b_x, b_u, PAIRS: tl.constexpr, SILU_MUL: tl.constexpr, ROWS: tl.constexpr,
                ROW_SUM: tl.constexpr):
    """acc plus the products of weight tile b_w and x b_x ([units] for one row, ROWS: [BLOCK_M, units]; see
    _products), an FFMA each. PAIRS: both are bf16 pairs read as int32 (low element in the low half), and a bf16
    is the top half of an fp32: the high element is one mask, the low one a shift (a bf16 -> fp32 conversion of
    the high element costs ptxas two, PRMT and shift); a weight pair is unpacked once however many rows use it.
    SILU_MUL: b_x is the gate and b_u the up half of the same units; x is silu(gate) * up (see _silu_mul)."""
    if PAIRS:
        w_lo = (b_w << 16).to(tl.float32, bitcast=True)
        w_hi = (b_w & -65536).to(tl.float32, bitcast=True)
        x_lo = (b_x << 16).to(tl.float32, bitcast=True)
        x_hi = (b_x & -65536).to(tl.float32, bitcast=True)
        if SILU_MUL:
            x_lo = _silu_mul(x_lo, (b_u << 16).to(tl.float32, bitcast=True), tl.bfloat16)
            x_hi = _silu_mul(x_hi, (b_u & -65536).to(tl.float32, bitcast=True), tl.bfloat16)
        acc = _products(acc, w_lo, x_lo, w_hi, x_hi, True, ROWS, ROW_SUM)
    else:
        # (if/else, not an early return: see _multiply_add)
        x = b_x.to(tl.float32)
        if SILU_MUL:
            x = _silu_mul(x, b_u.to(tl.float32), b_x.dtype)
        w = b_w.to(tl.float32)
        acc = _products(acc, w, x, w, x, False, ROWS, ROW_SUM)
    return acc


@triton.jit
def _weight_tile(p_w, step, offs_u, remaining, EVEN_K: tl.constexpr, UNIT: tl.constexpr):
    """The [BLOCK_N, BLOCK_K / UNIT] weight tile `step` units into the split's range (remaining: elements left)."""
    if EVEN_K:
        b_w = tl.load(p_w + step)
    else:
        # with PAIRS K is even: a pair is in or out whole
        b_w = tl.load(p_w + step, mask=(offs_u < remaining // UNIT)[None, :], other=0)
    return b_w


@triton.jit
def _x_tile(p_x, step, mask, EVEN_K: tl.constexpr, MASK_ALWAYS: tl.constexpr):
    """x's tile `step` units on from p_x; masked along K only where the tile may pass the split's end (and always
    for several rows, whose mask also drops the rows past M)."""
    if EVEN_K and not MASK_ALWAYS:
        b_x = tl.load(p_x + step)
    else:
        b_x = tl.load(p_x + step, mask=mask, other=0)
    return b_x


@triton.jit
def _multiply_add(acc, b_w, p_x, p_u, step, offs_u, m_m, remaining, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr,
                  PAIRS: tl.constexpr, UNIT: tl.constexpr, SILU_MUL: tl.constexpr, SWAP_AB: tl.constexpr,
                  CORE_ROWS: tl.constexpr, ROW_SUM: tl.constexpr):
    """acc plus x's matching tile times b_w: CUDA-core products for one row and for CORE_ROWS, the tensor cores
    for more (SWAP_AB: acc [BLOCK_N, BLOCK_M] += w-tile @ x-tile.T, else acc [BLOCK_M, BLOCK_N] += x-tile @
    w-tile.T). SILU_MUL: x is silu(gate) * up of the tiles at p_x (gate) and p_u (up), computed here (masked
    units are 0: silu(0) is)."""
    # if/else, not an early return: Triton 3.6 compiles the code after a returning constexpr branch too.
    m_u = offs_u < remaining // UNIT
    if BLOCK_M == 1 or CORE_ROWS:
        # CORE_ROWS: p_x's rows past M repeat row M - 1 (see gemv_fwd_kernel), so only K masks
        mask = m_u if BLOCK_M == 1 else m_u[None, :]
        b_x = _x_tile(p_x, step, mask, EVEN_K, False)
        if SILU_MUL:
            b_u = _x_tile(p_u, step, mask, EVEN_K, False)
        else:
            b_u = b_x
        acc = _accumulate(acc, b_w, b_x, b_u, PAIRS, SILU_MUL, CORE_ROWS, ROW_SUM)
    else:
        mask = m_m[:, None] if EVEN_K else m_m[:, None] & m_u[None, :]
        b_x = _x_tile(p_x, step, mask, EVEN_K, True)
        if SILU_MUL:
            b_u = _x_tile(p_u, step, mask, EVEN_K, True)
            b_x = _silu_mul(b_x.to(tl.float32), b_u.to(tl.float32), b_x.dtype).to(b_x.dtype)
        if SWAP_AB:
            acc = tl.dot(b_w, tl.trans(b_x), acc)
        else:
            acc = tl.dot(b_x, tl.trans(b_w), acc)
    return acc


@triton.jit
def gemv_fwd_kernel(
    x, up, w, out, ws, counters, M, N, K, k_per_split, num_splits, stride_xm, stride_um, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PAIRS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
    SWAP_AB: tl.constexpr, CORE_ROWS: tl.constexpr, ROW_SUM: tl.constexpr, PREFETCH: tl.constexpr = 1,
):
    """Program (n, s): out[:, n-block] (+)= x[:, s's K range] @ w[n-block, s's K range].T. BLOCK_M 1 on the CUDA
    cores, an fp32 partial sum per weight element (pair) a thread holds, summed over K once after the loop (a
    row sum every tile cost shuffles and a tree of adds); larger BLOCK_M (at least 16) on the tensor cores.
    EVEN_K: K is a multiple of BLOCK_K (so is every split's range, as k_per_split is): no tile carries a mask
    along K. PAIRS (BLOCK_M 1, bf16, K even): x and w are int32 views, two elements a unit; K, k_per_split and
    stride_wn stay in elements. SILU_MUL (SwiGLU's down projection): x is the gate and `up` the up half, [M, K]
    each (row strides stride_xm, stride_um, as pairs too), and the product's input row is silu(gate) * up, made
    as each tile is loaded; without SILU_MUL `up` is never read. SWAP_AB (BLOCK_M > 1): the accumulator is
    out.T's block [BLOCK_N, BLOCK_M], the weight tile the MMA's M operand (see GemvConfig.swap_ab).
    CORE_ROWS (BLOCK_M 2-8): the one-row loop for every row at once, x a [BLOCK_M, units] tile (pairs too; row
    strides in elements) and acc [BLOCK_M, BLOCK_N, units], BLOCK_M times one row's registers: kept for tiles of
    at most CORE_ROWS_ACC_REGS a thread (small BLOCK_N x BLOCK_K: an FFMA a row and weight, no reduction in the
    loop; 206-254 registers at 8 rows, no spills). ROW_SUM (larger tiles): acc [BLOCK_M, BLOCK_N], the products
    summed over the units every tile, which bounds the accumulator but costs a shuffle tree a tile for every
    (row, weight row) a thread holds: 77 instructions a weight element at 8 rows of 32 x 256 (1792 SHFLs a tile,
    spills), a fallback for tiles too large, not a contender. PREFETCH (1, 2 or 4; GemvConfig.prefetch): weight
    tiles loaded before the PDL wait, then multiplied in order before the loop takes the rest (the same sums, in
    the same order, as PREFETCH 1)."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    UNIT: tl.constexpr = 2 if PAIRS else 1
    BLOCK_U: tl.constexpr = BLOCK_K // UNIT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_u = tl.arange(0, BLOCK_U)
    m_n = offs_n < N
    m_m = offs_m < M
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # The last block's rows past N read row N - 1 again (its store is masked): no load in the loop is predicated
    # on N, and an unmasked tile needs no zero fill.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    # A tile's addresses are these base pointers plus one scalar offset, which ptxas keeps in uniform registers:
    # no per-element address arithmetic in the loop (advancing the pointers instead cost two IADD3s a 16-byte
    # load, 64-bit adds; session 9's int4 kernel had spent 86 IMADs a tile on addresses and masks).
    p_w = w + rows[:, None] * (stride_wn // UNIT) + (k_lo // UNIT + offs_u)[None, :]
    if BLOCK_M == 1:
        p_x = x + k_lo // UNIT + offs_u
        p_u = up + k_lo // UNIT + offs_u
        acc = tl.zeros((BLOCK_N, BLOCK_U), dtype=tl.float32)
    elif CORE_ROWS:
        # As for N: rows past M read row M - 1 again (their sums are never stored), so x's loads carry no row
        # mask and no zero fill.
        x_rows = tl.minimum(offs_m, M - 1)[:, None]
        p_x = x + x_rows * (stride_xm // UNIT) + (k_lo // UNIT + offs_u)[None, :]
        p_u = up + x_rows * (stride_um // UNIT) + (k_lo // UNIT + offs_u)[None, :]
        if ROW_SUM:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_U), dtype=tl.float32)
    else:
        p_x = x + offs_m[:, None] * stride_xm + (k_lo + offs_u)[None, :]
        p_u = up + offs_m[:, None] * stride_um + (k_lo + offs_u)[None, :]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = k_lo
    if PDL or PREFETCH > 1:
        # Programmatic dependent launch (kernels/pdl.py): the weights do not depend on the kernel before this one,
        # so the first PREFETCH tiles are in flight before waiting on it; only x (and the outputs, the split
        # counters) do. (Every split holds at least PREFETCH tiles: the launcher sees to it.)
        if PDL:
            gdc_launch_dependents()
        b_w0 = _weight_tile(p_w, 0, offs_u, k_hi - k_lo, EVEN_K, UNIT)
        if PREFETCH > 1:
            b_w1 = _weight_tile(p_w, BLOCK_U, offs_u, k_hi - k_lo - BLOCK_K, EVEN_K, UNIT)
        if PREFETCH > 2:
            b_w2 = _weight_tile(p_w, 2 * BLOCK_U, offs_u, k_hi - k_lo - 2 * BLOCK_K, EVEN_K, UNIT)
            b_w3 = _weight_tile(p_w, 3 * BLOCK_U, offs_u, k_hi - k_lo - 3 * BLOCK_K, EVEN_K, UNIT)
        if PDL:
            gdc_wait()
        acc = _multiply_add(acc, b_w0, p_x, p_u, 0, offs_u, m_m, k_hi - k_lo, BLOCK_M, EVEN_K, PAIRS, UNIT,
                            SILU_MUL, SWAP_AB, CORE_ROWS, ROW_SUM)
        if PREFETCH > 1:
            acc = _multiply_add(acc, b_w1, p_x, p_u, BLOCK_U, offs_u, m_m, k_hi - k_lo - BLOCK_K, BLOCK_M, EVEN_K,
                                PAIRS, UNIT, SILU_MUL, SWAP_AB, CORE_ROWS, ROW_SUM)
        if PREFETCH > 2:
            acc = _multiply_add(acc, b_w2, p_x, p_u, 2 * BLOCK_U, offs_u, m_m, k_hi - k_lo - 2 * BLOCK_K, BLOCK_M,
                                EVEN_K, PAIRS, UNIT, SILU_MUL, SWAP_AB, CORE_ROWS, ROW_SUM)
            acc = _multiply_add(acc, b_w3, p_x, p_u, 3 * BLOCK_U, offs_u, m_m, k_hi - k_lo - 3 * BLOCK_K, BLOCK_M,
                                EVEN_K, PAIRS, UNIT, SILU_MUL, SWAP_AB, CORE_ROWS, ROW_SUM)
        k_first = k_lo + PREFETCH * BLOCK_K
    for k0 in tl.range(k_first, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        step = (k0 - k_lo) // UNIT
        b_w = _weight_tile(p_w, step, offs_u, k_hi - k0, EVEN_K, UNIT)
        acc = _multiply_add(acc, b_w, p_x, p_u, step, offs_u, m_m, k_hi - k0, BLOCK_M, EVEN_K, PAIRS, UNIT,
                            SILU_MUL, SWAP_AB, CORE_ROWS, ROW_SUM)
    if BLOCK_M == 1:
        _finish_split(tl.sum(acc, axis=1), out + offs_n, ws, counters, pid_n, offs_n, m_n, num_splits, pid_s, N,
                      SPLIT)
    elif SWAP_AB:
        # acc is indexed [n, m]: the same elements of out and of the [M, N] workspace, addressed transposed (no
        # layout conversion of acc; quant_matmul's swap-AB kernel stores the same way)
        _finish_split(acc, out + offs_m[None, :] * stride_om + offs_n[:, None], ws, counters, pid_n,
                      offs_m[None, :] * N + offs_n[:, None], m_n[:, None] & m_m[None, :], num_splits, pid_s, M * N,
                      SPLIT)
    else:
        if CORE_ROWS and not ROW_SUM:
            # [BLOCK_M, BLOCK_N, units] -> the tensor-core path's [BLOCK_M, BLOCK_N] (the launcher never sets
            # SWAP_AB with CORE_ROWS), stored the same way
            acc = tl.sum(acc, axis=2)
        _finish_split(acc, out + offs_m[:, None] * stride_om + offs_n[None, :], ws, counters, pid_n,
                      offs_m[:, None] * N + offs_n[None, :], m_m[:, None] & m_n[None, :], num_splits, pid_s, M * N,
                      SPLIT)


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """x [M, K] (rows contiguous in K) @ w [N, K].T (contiguous) -> [M, N] in x's dtype; M at most 16 (2 to 8 on
    the CUDA cores with config.rows_on_cores). One launch also with a split over K: the last split of an output
    block to finish sums the others' fp32 partials."""
    return _launch(x, None, w, config)


def silu_mul_gemv(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor,
                  config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """SwiGLU's down projection in one launch: (silu(gate) * up) @ w [N, K].T -> [M, N], the activation made as
    the GEMV loads it, so no silu_mul kernel runs and its [M, K] never goes to memory. gate, up [M, K] with a
    contiguous last dim: the column views of MergedLinear's one gate|up output (row stride 2K), or two tensors.
    Equal to gemv(silu_mul(gate, up), w, config) (the activation rounded as silu_mul rounds it; naive_silu_mul_gemv
    is the torch reference)."""
    if up.shape != gate.shape or up.dtype != gate.dtype or up.stride(-1) != 1:
        raise ValueError(f"silu_mul_gemv: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be the same [M, K] "
                         "shape and dtype with a contiguous last dimension")
    return _launch(gate, up, w, config)


def naive_silu_mul_gemv(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference of silu_mul_gemv: the unfused path, silu_mul's rounded activation through F.linear."""
    from headroom.kernels.gates import naive_silu_mul

    return torch.nn.functional.linear(naive_silu_mul(gate, up), w)


def _launch(x: torch.Tensor, up: torch.Tensor | None, w: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """gemv (up None) or silu_mul_gemv (x the gate)."""
    num_rows, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or num_rows > 16 or x.stride(-1) != 1 or not w.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} (at most 16 rows, last dim contiguous) against w {tuple(w.shape)} "
                         "(contiguous [N, K])")
    blocks = triton.cdiv(n, config.block_n)
    # Arrival counters are per output block (quant_matmul's, shared with the int4 kernels).
    split = max(1, config.split) if blocks <= _COUNTER_SLOTS else 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, num_rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    core_rows = config.rows_on_cores and 1 < num_rows <= CORE_ROWS_MAX
    block_m = 1 if num_rows == 1 else triton.next_power_of_2(num_rows) if core_rows else 16
    # bf16 pairs as int32 on the CUDA cores (see _accumulate); 4-byte alignment holds for any even K and any
    # allocation, but a view of x or w may start mid-pair (the up half of a gate|up row starts K elements in),
    # and several rows need even row strides too
    operands = (x, w) if up is None else (x, up, w)
    pairs = (num_rows == 1 or core_rows) and x.dtype == w.dtype == torch.bfloat16 and k % 2 == 0 \
        and all(t.data_ptr() % 4 == 0 for t in operands) \
        and (num_rows == 1 or all(t.stride(0) % 2 == 0 for t in operands))
    # (x[0]: the one row's view, whatever the row stride; an odd stride could not be viewed as pairs)
    x_arg = (x[0] if num_rows == 1 else x).view(torch.int32) if pairs else x
    up_arg = x_arg if up is None else (up[0] if num_rows == 1 else up).view(torch.int32) if pairs else up
    if config.prefetch not in (1, 2, 4):
        raise ValueError(f"gemv: prefetch={config.prefetch} must be 1, 2 or 4 weight tiles")
    # Tiles before the wait: at most the last split's (the shortest; whole tiles when K is a multiple of block_k).
    last_split = k - (split - 1) * k_per_split
    prefetch = max(p for p in (1, 2, 4) if p == 1 or (p <= config.prefetch and p * config.block_k <= last_split))
    # CORE_ROWS' accumulator [BLOCK_M, BLOCK_N, units], fp32 registers a thread
    acc_regs = block_m * config.block_n * (config.block_k // (2 if pairs else 1)) // (32 * config.num_warps)
    gemv_fwd_kernel[(blocks, split)](
        # counters only for a split (a launch without one never touches them, nor allocates them)
        x_arg, up_arg, w.view(torch.int32) if pairs else w, out, ws,
        _counters(x.device) if split > 1 else out, num_rows, n, k, k_per_split, split, x.stride(0),
        x.stride(0) if up is None else up.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, EVEN_K=k % config.block_k == 0, SPLIT=split > 1, PAIRS=pairs,
        SILU_MUL=up is not None, num_warps=config.num_warps,
        # (one row has no MMA: a swap_ab config runs the same one-row kernel, not a second compile of it)
        SWAP_AB=config.swap_ab and num_rows > 1 and not core_rows, CORE_ROWS=core_rows,
        ROW_SUM=core_rows and acc_regs > CORE_ROWS_ACC_REGS, PREFETCH=prefetch, **pdl_launch(x.device),
    )
    return out


def tuned_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """gemv with the shipped configuration for this GPU, shape and row count; None where none is shipped (or the
    operands are not bf16 with contiguous rows): the caller runs cuBLAS."""
    config = _tuned_config(x, w, PLAIN_INPUT)
    return gemv(x, w, config) if config is not None else None


def tuned_silu_mul_gemv(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """silu_mul_gemv with the shipped configuration of the fused down projection (the table's SILU_MUL_INPUT
    entries, timed against silu_mul + cuBLAS) for this GPU, shape and row count; None where none is shipped: the
    caller runs silu_mul and then its linear."""
    config = _tuned_config(gate, w, SILU_MUL_INPUT)
    if config is None or up.shape != gate.shape or up.dtype != gate.dtype or up.stride(-1) != 1:
        return None
    return silu_mul_gemv(gate, up, w, config)


def _tuned_config(x: torch.Tensor, w: torch.Tensor, kind: str) -> GemvConfig | None:
    global _tuned
    if _tuned is None:
        _tuned = load_tuned_configs(x.device)
    config = _tuned.get((w.shape[0], w.shape[1], x.shape[0], kind)) if x.dim() == 2 else None
    if config is None or x.dtype != torch.bfloat16 or w.dtype != x.dtype or x.stride(-1) != 1 \
            or not w.is_contiguous():
        return None
    return config


def load_tuned_configs(device: torch.device) -> dict[tuple[int, int, int, str], GemvConfig]:
    """The shipped table's entries for this GPU and Triton version (none for another version: timings differ),
    keyed (out_features, in_features, rows, input kind); an entry without "input" (tables before the fused
    down projection) is a plain one, one without "swap_ab" (tables before it) is not swapped, one without
    "rows_on_cores" runs several rows on the tensor cores, and one without "prefetch" loads one tile before its
    PDL wait."""
    from headroom.kernels.tuned_table import entries_for

    return {(c["n"], c["k"], c["m"], c.get("input", PLAIN_INPUT)):
            GemvConfig(c["block_n"], c["block_k"], c["split"], c["num_warps"], c["num_stages"],
                       c.get("swap_ab", False), c.get("rows_on_cores", False), c.get("prefetch", 1))
            for c in entries_for(TUNED_CONFIGS, device)}
