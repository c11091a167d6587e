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

swiglu_gemv is the other way round: SwiGLU's gate|up projection with the activation in its epilogue (SWIGLU),
the weight's gate and up rows interleaved (gate row i at 2i, up row i at 2i + 1; engine/layers/mlp.py stores it so)
so that every output block holds whole pairs: each program rounds its pairs as F.linear would store them and
writes silu(gate) * up as silu_mul does, [M, N / 2]. Nothing is recomputed (silu_mul_gemv's input recomputes the
activation in every program that reads it) and the same tiles stream as the plain GEMV's: it takes the plain
shape's table entries.

Several rows with swap_ab (GemvConfig) compute out.T = w @ x.T: the weight tile is the MMA's M operand and the 16
rows of x its N, so a tile of 64 or 128 weight rows can be Hopper's wgmma (M >= 64 a warpgroup) and each pipeline
stage streams a wide weight tile; without it the 16 rows are the M side, too few for wgmma.

Two to eight rows with rows_on_cores (GemvConfig) stay on the CUDA cores as one row does: each weight pair is
unpacked once and is then one FFMA a row (acc [BLOCK_M, BLOCK_N, units], BLOCK_M the rows rounded up to a power of
two): 10.9-12.4 sm_90 instructions a weight element at 8 rows with 3 stages (8 of them FFMAs), against the 16 a
cycle's issue leaves at 4.3 TB/s; the tensor-core tiles reached only ~3.5 TB/s at 8 rows (session 12). Fused
(SILU_MUL) it is ~29: every thread recomputes silu for each row of the x units it holds."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from headroom.kernels.conv_update import conv_step
from headroom.kernels.pdl import pdl_launch
from headroom.kernels.quant_matmul import _COUNTER_SLOTS, _counters, _finish_split, _split_total
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
    # Several rows on the tensor cores only: stream-K, `stream` programs a multiprocessor sharing the (output block,
    # K tile) iterations evenly (gemv_stream_fwd_kernel), 0 for the grid of blocks x splits. split is then ignored.
    stream: int = 0
    # Weight tiles after those a program loads into registers before its PDL wait that it asks L2 to fetch then
    # (prefetch.global.L2, 0 for none): the next GEMV's ramp overlapped with the kernel before it, as `prefetch`
    # does, without holding the tiles in registers (prefetch 2 and 4 cost more registers than they hid, session 21).
    # Measured in the graphed step on an H100 (session 31): 2 at every 8- and 16-row entry, 3.82 against 3.95 ms a
    # step at batch 8 and 4.24 against 4.35 at 16 (their programs run 4-12 K tiles, so 2 more is much of a
    # program's weights); 8 lost (4.07 at batch 8); 2 at one row, 3.44 against 3.27 ms, lost as in session 22.
    l2_prefetch: int = 0


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
# The most rows a launch takes (x [M, K], M of 1 to 16).
MAX_ROWS = 16
# Row counts without an entry of their own (the sweep and the step tuning time 1, 8 and 16 rows): with NEAREST_ROWS
# the next larger row count's entry of the same shape and input serves them (2-7 rows take 8's, 9-15 16's: every
# several-row configuration runs any 2-16 rows, and the core-row tiles any 2-8), else cuBLAS runs them. On since
# session 24: on an H100 the graphed decode step at 2, 3, 4, 6 and 12 sequences took 7-8% less time with it than
# with cuBLAS (bench/engine_speed.py llm_bf16_nearest, on/off/on in one process), and a server with it on compiled
# nothing after /ready (eager passes of 2-15 rows share the several-row configurations' compiled variants with the
# graph captures of 2-16 sequences in the warm-up). HEADROOM_GEMV_NEAREST_ROWS=0 turns it off.
NEAREST_ROWS = os.environ.get("HEADROOM_GEMV_NEAREST_ROWS", "1") == "1"
# A residual GEMV (RESIDUAL) loads its block of the residual stream right after the PDL wait, under its loop, instead
# of in the last split's epilogue after the split's sum, where the round trip sits on the launch's critical path (64
# launches a step at 2-16 rows, 72 at one). The same bits. HEADROOM_EARLY_RESIDUAL=1 turns it on; off until measured
# in the graphed step (bench/engine_speed.py fused_early_residual).
EARLY_RESIDUAL = os.environ.get("HEADROOM_EARLY_RESIDUAL", "0") == "1"


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
def _rms_normed(x, g, rstd, UNIT_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """fp32 x's RMSNorm with weight g (fp32) and the row's 1 / rms, rounded to dtype and back to fp32 where and as
    kernels/norm_triton.py's rms_norm rounds it: Qwen3.5's (1 + g) in fp32 before the one rounding, Qwen3's g after
    rounding the normed x. So a GEMV that norms its input as it loads it (NORM) multiplies what rms_norm stores."""
    if UNIT_OFFSET:
        y = x * rstd * (1.0 + g)
    else:
        y = (x * rstd).to(dtype).to(tl.float32) * g
    return y.to(dtype).to(tl.float32)


@triton.jit
def _head_rstd(squares, eps, HEAD: tl.constexpr, HEAD_UNITS: tl.constexpr, ROWS: tl.constexpr):
    """Each head's 1 / rms at every unit of it: squares [units] (ROWS: [BLOCK_M, units]) of a tile that starts on
    a head and holds whole heads of HEAD elements, HEAD_UNITS units each; as norm_triton's gated_rms_norm computes
    it from a head's sum."""
    if ROWS:
        rows: tl.constexpr = squares.shape[0]
        heads: tl.constexpr = squares.shape[1] // HEAD_UNITS
        per_head = tl.sum(tl.reshape(squares, [rows, heads, HEAD_UNITS]), axis=2)
        rstd = 1.0 / tl.sqrt(per_head / HEAD + eps)
        return tl.reshape(tl.broadcast_to(rstd[:, :, None], [rows, heads, HEAD_UNITS]), [rows, heads * HEAD_UNITS])
    else:
        heads: tl.constexpr = squares.shape[0] // HEAD_UNITS
        per_head = tl.sum(tl.reshape(squares, [heads, HEAD_UNITS]), axis=1)
        rstd = 1.0 / tl.sqrt(per_head / HEAD + eps)
        return tl.reshape(tl.broadcast_to(rstd[:, None], [heads, HEAD_UNITS]), [heads * HEAD_UNITS])


@triton.jit
def _gated_normed(x, z, g, rstd, dtype: tl.constexpr):
    """fp32 x's head norm with weight g, times silu(z), rounded to dtype (back in fp32) where and as
    norm_triton's gated_rms_norm rounds it (Gated DeltaNet's output norm: norm before gate)."""
    y = (x * rstd).to(dtype).to(tl.float32) * g
    y = y.to(dtype).to(tl.float32)
    return (y * (z / (1.0 + tl.exp(-z)))).to(dtype).to(tl.float32)


@triton.jit
def _accumulate(acc, b_w, b_x, b_u, rstd, b_g, eps, PAIRS: tl.constexpr, SILU_MUL: tl.constexpr,
                NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, GATED: tl.constexpr, HEAD: tl.constexpr,
                ROWS: tl.constexpr, ROW_SUM: tl.constexpr):
    """acc plus the products of weight tile b_w and x b_x ([units] for one row, ROWS: [BLOCK_M, units]; see
    _products), an FFMA each. PAIRS: both are bf16 pairs read as int32 (low element in the low half), and a bf16
    is the top half of an fp32: the high element is one mask, the low one a shift (a bf16 -> fp32 conversion of
    the high element costs ptxas two, PRMT and shift); a weight pair is unpacked once however many rows use it.
    SILU_MUL: b_x is the gate and b_u the up half of the same units; x is silu(gate) * up (see _silu_mul).
    NORM: b_u is the norm's weight at the same units and rstd the rows' 1 / rms (a scalar for one row, ROWS:
    [BLOCK_M, 1]); x is b_x normed (see _rms_normed). GATED: b_u is the gate z at the same units and b_g the head
    norm's weight at them; x is b_x's gated head norm (see _gated_normed), each head's 1 / rms from the tile."""
    if PAIRS:
        w_lo = (b_w << 16).to(tl.float32, bitcast=True)
        w_hi = (b_w & -65536).to(tl.float32, bitcast=True)
        x_lo = (b_x << 16).to(tl.float32, bitcast=True)
        x_hi = (b_x & -65536).to(tl.float32, bitcast=True)
        if SILU_MUL:
            x_lo = _silu_mul(x_lo, (b_u << 16).to(tl.float32, bitcast=True), tl.bfloat16)
            x_hi = _silu_mul(x_hi, (b_u & -65536).to(tl.float32, bitcast=True), tl.bfloat16)
        if NORM:
            x_lo = _rms_normed(x_lo, (b_u << 16).to(tl.float32, bitcast=True), rstd, UNIT_OFFSET, tl.bfloat16)
            x_hi = _rms_normed(x_hi, (b_u & -65536).to(tl.float32, bitcast=True), rstd, UNIT_OFFSET, tl.bfloat16)
        if GATED:
            head_rstd = _head_rstd(x_lo * x_lo + x_hi * x_hi, eps, HEAD, HEAD // 2, ROWS)
            x_lo = _gated_normed(x_lo, (b_u << 16).to(tl.float32, bitcast=True),
                                 (b_g << 16).to(tl.float32, bitcast=True), head_rstd, tl.bfloat16)
            x_hi = _gated_normed(x_hi, (b_u & -65536).to(tl.float32, bitcast=True),
                                 (b_g & -65536).to(tl.float32, bitcast=True), head_rstd, tl.bfloat16)
        acc = _products(acc, w_lo, x_lo, w_hi, x_hi, True, ROWS, ROW_SUM)
    else:
        # (if/else, not an early return: see _multiply_add)
        x = b_x.to(tl.float32)
        if SILU_MUL:
            x = _silu_mul(x, b_u.to(tl.float32), b_x.dtype)
        if NORM:
            x = _rms_normed(x, b_u.to(tl.float32), rstd, UNIT_OFFSET, b_x.dtype)
        if GATED:
            x = _gated_normed(x, b_u.to(tl.float32), b_g.to(tl.float32), _head_rstd(x * x, eps, HEAD, HEAD, ROWS),
                              b_x.dtype)
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
def _prefetch_l2(p_rows, first, last, UNITS: tl.constexpr):
    """Ask L2 for units first .. first + UNITS - 1 of each row at p_rows (a unit's offset past `last`, the split's
    last unit, is taken as `last`: nothing outside the program's own range, nor past the weight's end), a
    prefetch.global.L2 every 32 units (128 bytes of pairs). Nothing waits on it and no register holds what it
    fetches; the loads that follow find the lines in L2. PTX, so never under the interpreter (PDL is off there)."""
    LINES: tl.constexpr = UNITS // 32
    offsets = tl.minimum(first + tl.arange(0, LINES) * 32, last)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [p_rows[:, None] + offsets[None, :]], dtype=tl.int32, is_pure=False, pack=1)


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
def _multiply_add(acc, b_w, p_x, p_u, rstd, b_g, eps, step, offs_u, m_m, remaining, BLOCK_M: tl.constexpr,
                  EVEN_K: tl.constexpr, PAIRS: tl.constexpr, UNIT: tl.constexpr, SILU_MUL: tl.constexpr,
                  NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, GATED: tl.constexpr, HEAD: tl.constexpr,
                  SWAP_AB: tl.constexpr, CORE_ROWS: tl.constexpr, ROW_SUM: tl.constexpr):
    """acc plus x's matching tile times b_w: CUDA-core products for one row and for CORE_ROWS, the tensor cores
    for more (SWAP_AB: acc [BLOCK_N, BLOCK_M] += w-tile @ x-tile.T, else acc [BLOCK_M, BLOCK_N] += x-tile @
    w-tile.T). SILU_MUL: x is silu(gate) * up of the tiles at p_x (gate) and p_u (up), computed here (masked
    units are 0: silu(0) is). NORM: x is the RMSNorm of p_x's tile with the weight at p_u (every row's pointers
    the same units of it) and the rows' rstd (masked units are 0: their norm is). GATED: x is the gated head norm
    of p_x's tile with the gate at p_u and the head weight b_g (the same at every tile: tiles start on heads)."""
    # if/else, not an early return: Triton 3.6 compiles the code after a returning constexpr branch too.
    m_u = offs_u < remaining // UNIT
    if BLOCK_M == 1 or CORE_ROWS:
        # CORE_ROWS: p_x's rows past M repeat row M - 1 (see gemv_fwd_kernel), so only K masks
        mask = m_u if BLOCK_M == 1 else m_u[None, :]
        b_x = _x_tile(p_x, step, mask, EVEN_K, False)
        if SILU_MUL or NORM or GATED:
            b_u = _x_tile(p_u, step, mask, EVEN_K, False)
        else:
            b_u = b_x
        acc = _accumulate(acc, b_w, b_x, b_u, rstd, b_g, eps, PAIRS, SILU_MUL, NORM, UNIT_OFFSET, GATED, HEAD,
                          CORE_ROWS, ROW_SUM)
    else:
        mask = m_m[:, None] if EVEN_K else m_m[:, None] & m_u[None, :]
        b_x = _x_tile(p_x, step, mask, EVEN_K, True)
        if SILU_MUL:
            b_u = _x_tile(p_u, step, mask, EVEN_K, True)
            b_x = _silu_mul(b_x.to(tl.float32), b_u.to(tl.float32), b_x.dtype).to(b_x.dtype)
        if NORM:
            b_u = _x_tile(p_u, step, mask, EVEN_K, True)
            b_x = _rms_normed(b_x.to(tl.float32), b_u.to(tl.float32), rstd, UNIT_OFFSET, b_x.dtype).to(b_x.dtype)
        if GATED:
            b_u = _x_tile(p_u, step, mask, EVEN_K, True)
            x = b_x.to(tl.float32)
            b_x = _gated_normed(x, b_u.to(tl.float32), b_g.to(tl.float32), _head_rstd(x * x, eps, HEAD, HEAD, True),
                                b_x.dtype).to(b_x.dtype)
        if SWAP_AB:
            acc = tl.dot(b_w, tl.trans(b_x), acc)
        else:
            acc = tl.dot(b_x, tl.trans(b_w), acc)
    return acc


# _row_rstd's chunks of partial sums: several rows a row of CHUNK at a time, one row ROW_CHUNK at a time.
_CHUNK = tl.constexpr(64)
_ROW_CHUNK = tl.constexpr(1024)


@triton.jit
def _row_rstd(sumsq, rows, num_parts, K, eps, BLOCK_M: tl.constexpr):
    """1 / rms of the input rows (NORM) from the partial sums of squares the GEMV that wrote them left (RESIDUAL:
    [M, num_parts] fp32, one a block of its output), summed in a fixed order (the same in every program and run):
    a scalar for one row, else [BLOCK_M] for the row indices `rows`. Every program of the GEMV waits on this sum
    before its first tile: one row loads up to ROW_CHUNK parts in one round trip (a 2,560-wide residual GEMV of
    4-row blocks leaves 640), several rows CHUNK a row at a time."""
    if BLOCK_M == 1:
        total = tl.zeros([_ROW_CHUNK], dtype=tl.float32)
    else:
        total = tl.zeros([BLOCK_M, _CHUNK], dtype=tl.float32)
    return _rstd_from_parts(total, 0, sumsq, rows, num_parts, K, eps, BLOCK_M)


@triton.jit
def _first_parts(sumsq, rows, num_parts, BLOCK_M: tl.constexpr):
    """The first chunk of _row_rstd's partial sums (all of them for at most ROW_CHUNK / CHUNK parts), loaded with
    nothing waiting on it: ROW_SCALE loads it after the PDL wait and sums it only after the loop
    (_rstd_from_parts(first, 1, ...)), so its round trip runs under the loop. (_row_rstd's loop of loads, summed
    at once, had every program wait for it before its first tile: +0.6 to +1.6 us a launch at 8 rows, session 33.)"""
    if BLOCK_M == 1:
        offs_r = tl.arange(0, _ROW_CHUNK)
        first = tl.load(sumsq + offs_r, mask=offs_r < num_parts, other=0.0)
    else:
        offs_p = tl.arange(0, _CHUNK)
        first = tl.load(sumsq + rows[:, None] * num_parts + offs_p[None, :], mask=(offs_p < num_parts)[None, :],
                        other=0.0)
    return first  # (one return: the GPU compiler rejects a return inside a constexpr branch)


@triton.jit
def _rstd_from_parts(total, chunks_in: tl.constexpr, sumsq, rows, num_parts, K, eps, BLOCK_M: tl.constexpr):
    """_row_rstd's sum from `total`, which holds its first chunks_in chunks already (0 or _first_parts' 1): the
    other chunks added in order, then 1 / rms."""
    if BLOCK_M == 1:
        offs_r = tl.arange(0, _ROW_CHUNK)
        for p0 in range(chunks_in * _ROW_CHUNK, num_parts, _ROW_CHUNK):
            total += tl.load(sumsq + p0 + offs_r, mask=p0 + offs_r < num_parts, other=0.0)
        squares = tl.sum(total, axis=0)
    else:
        offs_p = tl.arange(0, _CHUNK)
        for p0 in range(chunks_in * _CHUNK, num_parts, _CHUNK):
            total += tl.load(sumsq + rows[:, None] * num_parts + p0 + offs_p[None, :],
                             mask=(p0 + offs_p < num_parts)[None, :], other=0.0)
        squares = tl.sum(total, axis=1)
    # as kernels/norm_triton.py's rms_norm computes it from its own sum
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _store_swiglu(total, last, out, stride_om, offs_m, m_m, pid_n, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SWAP_AB: tl.constexpr):
    """SWIGLU's store: total the output block's fp32 sums in gemv_fwd_kernel's layout ([BLOCK_N] at one row,
    [BLOCK_N, BLOCK_M] swapped, else [BLOCK_M, BLOCK_N]), its columns gate and up interleaved (pair j at columns
    2j, 2j + 1), each rounded to out's dtype as F.linear's output would be, then silu(gate) * up as
    kernels/gates_triton.py's silu_mul computes and rounds it, at out[m, pid_n * BLOCK_N / 2 + j] (N / 2 columns;
    only where `last`: the block's last split)."""
    dtype: tl.constexpr = out.dtype.element_ty
    if BLOCK_M == 1:
        total = tl.reshape(total, [1, BLOCK_N])
    elif SWAP_AB:
        total = tl.trans(total)
    gate, up = tl.split(tl.reshape(total, [BLOCK_M, BLOCK_N // 2, 2]))
    act = _silu_mul(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask = m_m[:, None] & (offs_h < N // 2)[None, :]
    tl.store(out + offs_m[:, None] * stride_om + offs_h[None, :], act.to(dtype), mask=tl.where(last, mask, False))


@triton.jit
def _finish_block(acc, p_o, p_r, p_q, m_q, ws, counters, tile, offsets, mask, num_splits, i_s, split_numel,
                  rows, cols, conv_w, conv_states, conv_slots, conv_channels, stride_cw, stride_cs, stride_cc,
                  p_s, scale, early_r, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr, N_AXIS: tl.constexpr,
                  CONV: tl.constexpr, CONV_TAPS: tl.constexpr, CONV_BLOCK: tl.constexpr, PRESCALE: tl.constexpr,
                  EARLY_RESIDUAL: tl.constexpr):
    """Store the output block (summed over its splits first where K is split: _split_total). RESIDUAL: the block
    stored is the residual stream's, r = residual + y (at p_r; y rounded to the output dtype first, then the sum,
    as F.linear and then a bf16 add round them), and the block's sum of r^2 for each row (along N_AXIS) at p_q
    (m_q: the rows that exist), for the next GEMV's NORM (or ROW_SCALE); EARLY_RESIDUAL: the residual's block
    loaded before the loop (early_r, in the layout of acc) instead of from p_r here. PRESCALE (with RESIDUAL): r
    times the next norm's weight at each element's column (scale, fp32, broadcast along the layout's rows: 1 + g with
    UNIT_OFFSET, as rms_norm scales; the kernel loads it before its loop), rounded once, at p_s. CONV: the output
    columns below conv_channels are silu(conv) of y (rounded to the output dtype first, as the conv kernel would
    have read it) with each row's carried inputs (conv_states[conv_slots[row]], rolled in place) and conv_w's taps,
    by conv_update's own step; rows, cols: each element's row and column."""
    if RESIDUAL:
        total, last = _split_total(acc, ws, counters, tile, offsets, mask, num_splits, i_s, split_numel, SPLIT)
        y = total.to(p_o.dtype.element_ty).to(tl.float32)
        if EARLY_RESIDUAL:
            residual = early_r
        else:
            # (tl.where: see _split_total)
            residual = tl.load(p_r, mask=tl.where(last, mask, False), other=0.0)
        r = (residual.to(tl.float32) + y).to(p_o.dtype.element_ty)
        tl.store(p_o, r, mask=tl.where(last, mask, False))
        r = tl.where(mask, r.to(tl.float32), 0.0)
        tl.store(p_q, tl.sum(r * r, axis=N_AXIS), mask=tl.where(last, m_q, False))
        if PRESCALE:
            tl.store(p_s, (r * scale).to(p_s.dtype.element_ty), mask=tl.where(last, mask, False))
    elif CONV:
        total, last = _split_total(acc, ws, counters, tile, offsets, mask, num_splits, i_s, split_numel, SPLIT)
        y = total.to(p_o.dtype.element_ty).to(tl.float32)
        m_o = tl.where(last, mask, False)
        in_conv = cols < conv_channels
        m_c = tl.where(in_conv, m_o, False)
        slot = tl.load(conv_slots + rows, mask=m_c, other=0).to(tl.int64)
        stepped = conv_step(y, conv_states + slot * stride_cs + cols * stride_cc, conv_w + cols * stride_cw, m_c,
                            CONV_TAPS, CONV_BLOCK)
        tl.store(p_o, tl.where(in_conv, stepped, y).to(p_o.dtype.element_ty), mask=m_o)
    else:
        _finish_split(acc, p_o, ws, counters, tile, offsets, mask, num_splits, i_s, split_numel, SPLIT)


# num_parts (NORM: the blocks of the GEMV before; RESIDUAL: this one's) is no specialisation key: 160 and 40 blocks
# would be two compiles of the same kernel (Triton keys integer arguments on divisibility by 16).
@triton.jit(do_not_specialize=["num_parts"])
def gemv_fwd_kernel(
    x, up, w, out, ws, counters, M, N, K, k_per_split, num_splits, stride_xm, stride_um, stride_wn, stride_om,
    res, sumsq, num_parts, stride_rm, eps, norm_w, conv_w, conv_states, conv_slots, conv_channels, stride_cw,
    stride_cs, stride_cc, scaled, scale_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PAIRS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
    SWAP_AB: tl.constexpr, CORE_ROWS: tl.constexpr, ROW_SUM: tl.constexpr, PREFETCH: tl.constexpr = 1,
    NORM: tl.constexpr = False, UNIT_OFFSET: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
    GATED: tl.constexpr = False, HEAD: tl.constexpr = 1, CONV: tl.constexpr = False, CONV_TAPS: tl.constexpr = 4,
    CONV_BLOCK: tl.constexpr = 4, L2_PREFETCH: tl.constexpr = 0, SWIGLU: tl.constexpr = False,
    PRESCALE: tl.constexpr = False, ROW_SCALE: tl.constexpr = False, EARLY_RESIDUAL: tl.constexpr = False,
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
    the same order, as PREFETCH 1). NORM (RMSNorm fused in front, normed_gemv): x is the residual stream and `up`
    the norm's weight [K] (stride_um 0: every row reads the same), sumsq the [M, num_parts] partial sums of squares
    of x's rows; each x tile is normed as it is loaded (UNIT_OFFSET: Qwen3.5's 1 + weight). RESIDUAL (the
    residual add fused behind, residual_gemv): out = res + x @ w.T (res row stride stride_rm), and each output
    block's sums of squares of out's rows at sumsq[m, block] (num_parts blocks): the next GEMV's NORM input.
    Not both in one launch (sumsq is the one's input or the other's output). GATED (Gated DeltaNet's output norm
    fused in front, gated_gemv): x is the delta rule's output, `up` the gate z (row stride stride_um), norm_w the
    head norm's weight [HEAD]; x is normed by heads of HEAD elements, times silu(z), as each tile is loaded (every
    tile and split starts on a head and holds whole heads; RESIDUAL may join it). CONV (Gated DeltaNet's decode conv
    fused behind its in-projection, conv_gemv): the first conv_channels output columns go through the conv step of
    kernels/conv_update.py (CONV_TAPS taps, CONV_BLOCK their power of 2) with each row's state slot conv_slots[m]
    in conv_states (strides stride_cs, stride_cc; taps conv_w, row stride stride_cw), rolled in place; only NORM or
    ROW_SCALE may join it. SWIGLU (SwiGLU's gate|up projection, swiglu_gemv): w's rows are gate and up rows
    interleaved, and out [M, N / 2] takes silu(gate) * up of each output pair (_store_swiglu); only NORM or
    ROW_SCALE may join it.
    PRESCALE (with RESIDUAL: residual_prescaled_gemv): each output block also stores its columns of the sum times
    the next RMSNorm's weight, r * (1 + g) (UNIT_OFFSET; else r * g) rounded once, at scaled (row stride
    stride_om) with g = scale_w's: the next GEMV's input with the norm's 1 / rms factored out. ROW_SCALE (the
    other side, instead of NORM): x is such prescaled rows, multiplied as they are by the plain loop, and each
    output row is scaled by its 1 / rms from sumsq (as NORM's) before the epilogue, since W (r * rstd * g') =
    rstd * (W (r * g')): no norm kernel between two GEMVs and nothing normed in this one's loop (NORM's loop cost
    the several-row tensor-core tiles more than the norm launch, sessions 18 and 24)."""
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
    if GATED:
        # the head weight at each unit of a tile: the same at every tile (tiles start on heads; a model weight, so
        # loaded before the PDL wait)
        b_g = tl.load(norm_w + offs_u % (HEAD // UNIT))
        if BLOCK_M > 1:
            b_g = b_g[None, :]
    else:
        b_g = 0
    if PRESCALE:
        # the next norm's weight at the block's columns: a model weight, so loaded before the PDL wait, and its
        # round trip under the loop instead of in the last split's epilogue
        b_s = tl.load(scale_w + offs_n, mask=m_n, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            b_s = 1.0 + b_s
    else:
        b_s = 0.0
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
            if L2_PREFETCH > 0:
                _prefetch_l2(w + rows * (stride_wn // UNIT) + k_lo // UNIT, PREFETCH * BLOCK_U,
                             (k_hi - k_lo) // UNIT - 1, L2_PREFETCH * BLOCK_U)
            gdc_wait()
    # NORM: the rows' 1 / rms, from the sums the kernel before wrote (so after the PDL wait), before the first tile;
    # ROW_SCALE: the sums loaded now and summed only after the loop, their round trip under it
    if NORM:
        rstd = _row_rstd(sumsq, tl.minimum(offs_m, M - 1), num_parts, K, eps, BLOCK_M)
        if BLOCK_M > 1:
            rstd = rstd[:, None]
    else:
        rstd = 1.0
    if ROW_SCALE:
        first_parts = _first_parts(sumsq, tl.minimum(offs_m, M - 1), num_parts, BLOCK_M)
    # EARLY_RESIDUAL: the block's residual rows (the kernels before wrote them: after the wait), in the layout the
    # epilogue stores; every split loads them, the last adds them
    if RESIDUAL and EARLY_RESIDUAL:
        if BLOCK_M == 1:
            b_r = tl.load(res + offs_n, mask=m_n, other=0.0)
        elif SWAP_AB:
            b_r = tl.load(res + offs_m[None, :] * stride_rm + offs_n[:, None], mask=m_n[:, None] & m_m[None, :],
                          other=0.0)
        else:
            b_r = tl.load(res + offs_m[:, None] * stride_rm + offs_n[None, :], mask=m_m[:, None] & m_n[None, :],
                          other=0.0)
    else:
        b_r = 0.0
    if PDL or PREFETCH > 1:
        acc = _multiply_add(acc, b_w0, p_x, p_u, rstd, b_g, eps, 0, offs_u, m_m, k_hi - k_lo, BLOCK_M, EVEN_K, PAIRS,
                            UNIT, SILU_MUL, NORM, UNIT_OFFSET, GATED, HEAD, SWAP_AB, CORE_ROWS, ROW_SUM)
        if PREFETCH > 1:
            acc = _multiply_add(acc, b_w1, p_x, p_u, rstd, b_g, eps, BLOCK_U, offs_u, m_m, k_hi - k_lo - BLOCK_K,
                                BLOCK_M, EVEN_K, PAIRS, UNIT, SILU_MUL, NORM, UNIT_OFFSET, GATED, HEAD, SWAP_AB,
                                CORE_ROWS, ROW_SUM)
        if PREFETCH > 2:
            acc = _multiply_add(acc, b_w2, p_x, p_u, rstd, b_g, eps, 2 * BLOCK_U, offs_u, m_m,
                                k_hi - k_lo - 2 * BLOCK_K, BLOCK_M, EVEN_K, PAIRS, UNIT, SILU_MUL, NORM, UNIT_OFFSET,
                                GATED, HEAD, SWAP_AB, CORE_ROWS, ROW_SUM)
            acc = _multiply_add(acc, b_w3, p_x, p_u, rstd, b_g, eps, 3 * BLOCK_U, offs_u, m_m,
                                k_hi - k_lo - 3 * BLOCK_K, BLOCK_M, EVEN_K, PAIRS, UNIT, SILU_MUL, NORM, UNIT_OFFSET,
                                GATED, HEAD, SWAP_AB, CORE_ROWS, ROW_SUM)
        k_first = k_lo + PREFETCH * BLOCK_K
    for k0 in tl.range(k_first, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        step = (k0 - k_lo) // UNIT
        b_w = _weight_tile(p_w, step, offs_u, k_hi - k0, EVEN_K, UNIT)
        acc = _multiply_add(acc, b_w, p_x, p_u, rstd, b_g, eps, step, offs_u, m_m, k_hi - k0, BLOCK_M, EVEN_K, PAIRS,
                            UNIT, SILU_MUL, NORM, UNIT_OFFSET, GATED, HEAD, SWAP_AB, CORE_ROWS, ROW_SUM)
    # The block's accumulator in its layout's shape, with the offsets of its elements in out (and scaled), res and
    # the [M, N] split workspace (RESIDUAL: p_q its sums of squares at sumsq[m, pid_n]; one row's is a scalar).
    # ROW_SCALE: each row's 1 / rms applied to it here, along the layout's row axis.
    if ROW_SCALE:
        row_rstd = _rstd_from_parts(first_parts, 1, sumsq, tl.minimum(offs_m, M - 1), num_parts, K, eps, BLOCK_M)
    p_q, m_q = sumsq + offs_m * num_parts + pid_n, m_m
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)
        if ROW_SCALE:
            acc = acc * row_rstd
        o_offs, p_r, p_q, m_q = offs_n, res + offs_n, sumsq + pid_n, pid_n >= 0
        offsets, mask, numel, rows, cols = offs_n, m_n, N, offs_n * 0, offs_n
        scale_cols = b_s
    elif SWAP_AB:
        # acc is indexed [n, m]: the same elements of out and of the [M, N] workspace, addressed transposed (no
        # layout conversion of acc; quant_matmul's swap-AB kernel stores the same way)
        if ROW_SCALE:
            acc = acc * row_rstd[None, :]
        o_offs = offs_m[None, :] * stride_om + offs_n[:, None]
        p_r = res + offs_m[None, :] * stride_rm + offs_n[:, None]
        offsets, mask, numel = offs_m[None, :] * N + offs_n[:, None], m_n[:, None] & m_m[None, :], M * N
        rows, cols = offs_m[None, :] + offs_n[:, None] * 0, offs_n[:, None] + offs_m[None, :] * 0
        scale_cols = b_s[:, None] if PRESCALE else b_s
    else:
        if CORE_ROWS and not ROW_SUM:
            # [BLOCK_M, BLOCK_N, units] -> the tensor-core path's [BLOCK_M, BLOCK_N] (the launcher never sets
            # SWAP_AB with CORE_ROWS), stored the same way
            acc = tl.sum(acc, axis=2)
        if ROW_SCALE:
            acc = acc * row_rstd[:, None]
        o_offs = offs_m[:, None] * stride_om + offs_n[None, :]
        p_r = res + offs_m[:, None] * stride_rm + offs_n[None, :]
        offsets, mask, numel = offs_m[:, None] * N + offs_n[None, :], m_m[:, None] & m_n[None, :], M * N
        rows, cols = offs_m[:, None] + offs_n[None, :] * 0, offs_n[None, :] + offs_m[:, None] * 0
        scale_cols = b_s[None, :] if PRESCALE else b_s
    if SWIGLU:
        total, last = _split_total(acc, ws, counters, pid_n, offsets, mask, num_splits, pid_s, numel, SPLIT)
        _store_swiglu(total, last, out, stride_om, offs_m, m_m, pid_n, N, BLOCK_M, BLOCK_N, SWAP_AB)
    else:
        _finish_block(acc, out + o_offs, p_r, p_q, m_q, ws, counters, pid_n, offsets, mask, num_splits, pid_s, numel,
                      rows, cols, conv_w, conv_states, conv_slots, conv_channels, stride_cw, stride_cs, stride_cc,
                      scaled + o_offs, scale_cols, b_r, SPLIT, RESIDUAL, 1 if BLOCK_M > 1 and not SWAP_AB else 0,
                      CONV, CONV_TAPS, CONV_BLOCK, PRESCALE, EARLY_RESIDUAL)


@triton.jit
def _stream_total(acc, ws, counters, block, first, parts, pid, k_tiles, per_program, local, mask, TILE: tl.constexpr):
    """(A block's sum over the programs whose runs hold its K tiles, whether this program holds it): each parks its
    part in its own workspace slot (two a program: a run holds parts of at most two blocks, the first it touches
    and the last), and the last to arrive (the block's arrival counter) sums them in program order and resets the
    counter (quant_matmul's _split_total, with the workspace per program rather than per split and block, so it is
    the grid's size and not the output's)."""
    slot = tl.where(block == (pid * per_program) // k_tiles, 0, 1)
    tl.store(ws + (pid * 2 + slot) * TILE + local, acc, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + block, 1, sem="acq_rel")
    last = arrived == parts - 1
    total = tl.zeros(acc.shape, dtype=tl.float32)
    for j in range(0, parts):
        other = first + j
        other_slot = tl.where(block == (other * per_program) // k_tiles, 0, 1)
        total += tl.load(ws + (other * 2 + other_slot) * TILE + local, mask=tl.where(last, mask, False), other=0.0,
                         cache_modifier=".cg")
    tl.atomic_xchg(counters + block, 0, mask=last)
    return total, last


# per_program follows the shape and the GPU: no specialisation on it.
@triton.jit(do_not_specialize=["per_program"])
def gemv_stream_fwd_kernel(
    x, up, w, out, ws, counters, M, N, K, k_tiles, per_program, stride_xm, stride_um, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """Several rows on the tensor cores, stream-K: the (output block, K tile) iterations, block-major, are cut into
    equal runs of per_program, one a program, so every multiprocessor streams the same weight bytes whatever the
    block count (a grid of whole blocks leaves some multiprocessors a block more than others: 144 blocks of the
    4B model's gate|up on 132, and the several-row shapes whose blocks balanced badly ran at 2.3-3.5 TB/s where
    lm_head's 3,880 reached 4.35). A run ends a block, starts one, or both: a block whose K tiles fell to several
    programs is finished as a split is (_stream_total), a block one program holds whole is stored directly. x, up
    (SILU_MUL), the tiles and the store are gemv_fwd_kernel's (BLOCK_M at least 16, SWAP_AB or not)."""
    pid = tl.program_id(0)
    total = tl.cdiv(N, BLOCK_N) * k_tiles
    it = pid * per_program
    end = tl.minimum(it + per_program, total)
    offs_m = tl.arange(0, BLOCK_M)
    offs_u = tl.arange(0, BLOCK_K)
    m_m = offs_m < M
    p_x = x + offs_m[:, None] * stride_xm + offs_u[None, :]
    p_u = up + offs_m[:, None] * stride_um + offs_u[None, :]
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    while it < end:
        block = it // k_tiles
        k_stop = tl.minimum(end - block * k_tiles, k_tiles)
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = offs_n < N
        # (rows past N read row N - 1 again, as in gemv_fwd_kernel)
        p_w = w + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + offs_u[None, :]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in tl.range(it - block * k_tiles, k_stop, num_stages=NUM_STAGES):
            step = kt * BLOCK_K
            b_w = _weight_tile(p_w, step, offs_u, K - step, EVEN_K, 1)
            acc = _multiply_add(acc, b_w, p_x, p_u, 1.0, 0, 0.0, step, offs_u, m_m, K - step, BLOCK_M, EVEN_K,
                                False, 1, SILU_MUL, False, False, False, 1, SWAP_AB, False, False)
        # the programs whose runs hold some of this block's K tiles, and this one's place among them
        first = (block * k_tiles) // per_program
        parts = ((block + 1) * k_tiles - 1) // per_program - first + 1
        # (the tile's own element order for the workspace: any, the same for every program)
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        if SWAP_AB:
            p_o = out + offs_m[None, :] * stride_om + offs_n[:, None]
            mask = m_n[:, None] & m_m[None, :]
        else:
            p_o = out + offs_m[:, None] * stride_om + offs_n[None, :]
            local = tl.trans(local)
            mask = m_m[:, None] & m_n[None, :]
        if parts == 1:
            tl.store(p_o, acc.to(p_o.dtype.element_ty), mask=mask)
        else:
            acc, last = _stream_total(acc, ws, counters, block, first, parts, pid, k_tiles, per_program, local, mask,
                                      BLOCK_M * BLOCK_N)
            tl.store(p_o, acc.to(p_o.dtype.element_ty), mask=tl.where(last, mask, False))
        it = block * k_tiles + k_stop


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """x [M, K] (rows contiguous in K) @ w [N, K].T (contiguous) -> [M, N] in x's dtype; M at most 16 (2 to 8 on
    the CUDA cores with config.rows_on_cores). One launch also with a split over K: the last split of an output
    block to finish sums the others' fp32 partials."""
    return _launch(x, None, w, config)[0]


def silu_mul_gemv(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor,
                  config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """SwiGLU's down projection in one launch: (silu(gate) * up) @ w [N, K].T -> [M, N], the activation made as
    the GEMV loads it, so no silu_mul kernel runs and its [M, K] never goes to memory. gate, up [M, K] with a
    contiguous last dim: the column views of MergedLinear's one gate|up output (row stride 2K), or two tensors.
    Equal to gemv(silu_mul(gate, up), w, config) (the activation rounded as silu_mul rounds it; naive_silu_mul_gemv
    is the torch reference)."""
    _raise_if(_silu_mul_problem(gate, up))
    return _launch(gate, up, w, config)[0]


def naive_silu_mul_gemv(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference of silu_mul_gemv: the unfused path, silu_mul's rounded activation through F.linear."""
    from headroom.kernels.gates import naive_silu_mul

    return torch.nn.functional.linear(naive_silu_mul(gate, up), w)


def swiglu_gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = GemvConfig(),
                norm: RowNorm | None = None) -> torch.Tensor:
    """SwiGLU's gate|up projection with its activation in one launch: x [M, K] (normed first with norm, as
    normed_gemv) @ w [2I, K].T, w's rows gate and up interleaved (gate row i at 2i, up row i at 2i + 1), -> silu(gate)
    * up [M, I]: no silu_mul kernel, and the [M, 2I] projection never goes to memory. Equal to silu_mul of the plain
    GEMV's even and odd columns (naive_swiglu_gemv is the torch reference)."""
    if norm is not None:
        _raise_if(_norm_weight_problem(x, norm) or _norm_sums_problem(x, norm))
    return _launch(x, None, w, config, norm=norm, swiglu=True)[0]


def naive_swiglu_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference of swiglu_gemv: F.linear, then silu_mul's reference of its even (gate) and odd (up) columns."""
    from headroom.kernels.gates import naive_silu_mul

    y = torch.nn.functional.linear(x, w)
    return naive_silu_mul(y[:, 0::2], y[:, 1::2])


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm normed_gemv applies to its input rows as it loads them: the norm's weight [K] (the rows' dtype),
    eps, Qwen3.5's unit offset ((1 + weight) * x), and the rows' partial sums of squares [M, parts] fp32 that the
    residual_gemv writing the rows left (any number of parts: they are summed in order)."""

    sumsq: torch.Tensor
    weight: torch.Tensor
    eps: float
    unit_offset: bool
    # The rows come with the weight applied already (residual_prescaled_gemv's third output, r * (1 + weight)):
    # the loop multiplies them as they are and each output row is scaled by its 1 / rms (kernel ROW_SCALE).
    prescaled: bool = False


def normed_gemv(x: torch.Tensor, norm: RowNorm, w: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """rms_norm(x) @ w [N, K].T -> [M, N] in one launch: the decoder's norm fused in front of the projection that
    reads it (no norm kernel, no [M, K] normed rows written and read back). x [M, K] is the residual stream as
    residual_gemv left it, norm.sumsq its rows' sums of squares from the same launch. Each tile is normed and
    rounded as kernels/norm_triton.py's rms_norm would have stored it; the rows' 1 / rms comes from the parts'
    sum rather than the norm kernel's own, so it can differ from it in the last bit. norm.prescaled: x is
    residual_prescaled_gemv's rows with the weight applied, multiplied as they are, and each output row is scaled
    by its 1 / rms from norm.sumsq in fp32 before the one rounding (naive_normed_gemv is the reference of both)."""
    _raise_if(_norm_weight_problem(x, norm) or _norm_sums_problem(x, norm))
    return _launch(x, None, w, config, norm=norm)[0]


def naive_normed_gemv(x: torch.Tensor, norm: RowNorm, w: torch.Tensor) -> torch.Tensor:
    """The reference of normed_gemv: rms_norm's reference (its own sums), then F.linear; prescaled rows through
    F.linear in fp32, each output row times 1 / rms of norm.sumsq's total, rounded once."""
    from headroom.kernels.norm import naive_rms_norm

    if norm.prescaled:
        rstd = torch.rsqrt(norm.sumsq.sum(-1, keepdim=True) / x.shape[1] + norm.eps)
        return (torch.nn.functional.linear(x.float(), w.float()) * rstd).to(x.dtype)
    return torch.nn.functional.linear(naive_rms_norm(x, norm.weight, norm.eps, norm.unit_offset), w)


@dataclass(frozen=True)
class GatedNorm:
    """Gated DeltaNet's output norm, which gated_gemv applies to its input as it loads it: weight [head] (the
    rows' dtype) normed over each head of `head` elements, then times silu(gate) (gate [M, K], unit last stride:
    the z columns of the in-projection's output); eps."""

    gate: torch.Tensor
    weight: torch.Tensor
    eps: float


def gated_gemv(x: torch.Tensor, gated: GatedNorm, w: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """gated_rms_norm(x, gate) @ w [N, K].T -> [M, N] in one launch: Gated DeltaNet's output norm fused in front of
    its out-projection (no norm kernel, no [M, K] normed rows written and read back). x [M, K] the delta rule's
    output, K whole heads of gated.weight's length; each head's 1 / rms comes from the tile that holds it (the
    config's block_k a power-of-2 multiple of the head, so tiles and splits start on heads), each element rounded as
    norm_triton's gated_rms_norm stores it (naive_gated_gemv is the reference)."""
    _raise_if(_gated_problem(x, gated, config))
    return _launch(x, None, w, config, gated=gated)[0]


def naive_gated_gemv(x: torch.Tensor, gated: GatedNorm, w: torch.Tensor) -> torch.Tensor:
    """The reference of gated_gemv: gated_rms_norm's reference by heads, then F.linear."""
    from headroom.kernels.norm import naive_gated_rms_norm

    rows, k = x.shape
    head = gated.weight.shape[0]
    normed = naive_gated_rms_norm(x.reshape(rows, k // head, head), gated.gate.reshape(rows, k // head, head),
                                  gated.weight, gated.eps)
    return torch.nn.functional.linear(normed.reshape(rows, k), w)


def gated_gemv_fits(k: int, head: int, config: GemvConfig) -> bool:
    """Whether a GEMV of this K and config can norm heads of `head` elements as it loads them: every tile holds a
    power of 2 of whole heads (so does every split, a whole number of tiles)."""
    heads = config.block_k // head if head > 0 else 0
    return head > 0 and head % 2 == 0 and k % head == 0 and config.block_k % head == 0 and heads & (heads - 1) == 0 \
        and head & (head - 1) == 0


@dataclass(frozen=True)
class ConvStep:
    """Gated DeltaNet's decode conv, which conv_gemv runs on the first channels of its output: taps weight [C, W]
    (unit last stride), states [S, C, W - 1] the layer's carried inputs (the SSM pool's, unit last stride), rolled in
    place at rows slots [M] (int32 or int64; distinct, as a pass's sequences are)."""

    weight: torch.Tensor
    states: torch.Tensor
    slots: torch.Tensor


def conv_gemv(x: torch.Tensor, w: torch.Tensor, conv: ConvStep, config: GemvConfig = GemvConfig(),
              norm: RowNorm | None = None) -> torch.Tensor:
    """x @ w [N, K].T -> [M, N] in one launch with its first C = conv.weight.shape[0] columns through the decode
    conv step: silu(conv) of each row's projected channels and carried inputs, the states rolled in place, as
    kernels/conv_update.py's causal_conv1d_update would have done to the stored output (the same step, the same
    bits); the columns past C as gemv gives them. norm: x normed first, as normed_gemv norms it (a decode step's
    in-projection reads the layer's normed input). naive_conv_gemv is the reference."""
    _raise_if(_conv_problem(x, w, conv))
    if norm is not None:
        _raise_if(_norm_weight_problem(x, norm) or _norm_sums_problem(x, norm))
    return _launch(x, None, w, config, norm=norm, conv=conv)[0]


def naive_conv_gemv(x: torch.Tensor, w: torch.Tensor, conv: ConvStep, norm: RowNorm | None = None) -> torch.Tensor:
    """The reference of conv_gemv: the projection (naive_normed_gemv with norm), then the conv reference on its
    first C columns, which rolls conv.states."""
    from headroom.kernels.conv import naive_causal_conv1d_update

    out = naive_normed_gemv(x, norm, w) if norm is not None else torch.nn.functional.linear(x, w)
    channels = conv.weight.shape[0]
    out[:, :channels] = naive_causal_conv1d_update(out[:, :channels], conv.weight, conv.states, conv.slots)
    return out


def residual_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, config: GemvConfig = GemvConfig(),
                  up: torch.Tensor | None = None, gated: GatedNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x @ w [N, K].T, its rows' partial sums of squares [M, blocks] fp32) in one launch: the decoder's
    residual add fused behind a layer's last projection (up: SwiGLU's down projection, x the gate, as
    silu_mul_gemv; gated: Gated DeltaNet's out-projection, x normed first as gated_gemv norms it), with what the
    next normed_gemv needs to norm the sum. The product is rounded to the rows' dtype before the add, as F.linear
    and then the add round them. residual [M, N] in x's dtype, unit last stride."""
    _raise_if(_residual_problem(x, w, residual))
    if up is not None:
        _raise_if(_silu_mul_problem(x, up))
    if gated is not None:
        _raise_if(_gated_problem(x, gated, config))
    out, sumsq, _ = _launch(x, up, w, config, residual=residual, gated=gated)
    assert sumsq is not None
    return out, sumsq


def naive_residual_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, up: torch.Tensor | None = None,
                        gated: GatedNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of residual_gemv: the projection (naive_silu_mul_gemv with up, naive_gated_gemv with gated),
    the add, and each row's sum of squares as one part [M, 1]."""
    if gated is not None:
        y = naive_gated_gemv(x, gated, w)
    else:
        y = torch.nn.functional.linear(x, w) if up is None else naive_silu_mul_gemv(x, up, w)
    out = residual + y
    return out, out.float().pow(2).sum(-1, keepdim=True)


@dataclass(frozen=True)
class NextNorm:
    """The RMSNorm that follows a residual add, whose weight residual_prescaled_gemv applies to the sum it writes:
    weight [N] (the rows' dtype, contiguous) and Qwen3.5's unit offset ((1 + weight) * x). Its eps and 1 / rms
    belong to the GEMV that reads the rows (RowNorm with prescaled)."""

    weight: torch.Tensor
    unit_offset: bool


def residual_prescaled_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm: NextNorm,
                            config: GemvConfig = GemvConfig(), up: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r = residual + x @ w [N, K].T, its rows' partial sums of squares, r times the next norm's weight) in one
    launch: residual_gemv's sum and sums to the bit, and beside them the next GEMV's input with the norm's 1 / rms
    factored out, r * (1 + weight) (unit offset; else r * weight) rounded once to the rows' dtype (kernel
    PRESCALE). A GEMV given these rows and RowNorm(sums, weight, eps, unit_offset, prescaled=True) scales its
    output rows by 1 / rms: rms_norm(r) @ w2.T up to where the rounding falls (rms_norm rounds r * rstd * (1 + g),
    this r * (1 + g)), with no norm kernel between the two GEMVs and a plain loop in the second. up: SwiGLU's down
    projection, as residual_gemv. naive_residual_prescaled_gemv is the reference."""
    _raise_if(_residual_problem(x, w, residual) or _next_norm_problem(x, w, norm))
    if up is not None:
        _raise_if(_silu_mul_problem(x, up))
    out, sumsq, scaled = _launch(x, up, w, config, residual=residual, prescale=norm)
    assert sumsq is not None and scaled is not None
    return out, sumsq, scaled


def naive_residual_prescaled_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm: NextNorm,
                                  up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of residual_prescaled_gemv: naive_residual_gemv's sum and sums, then the sum times the
    weight (1 + weight with the unit offset) in fp32, rounded once."""
    out, sumsq = naive_residual_gemv(x, w, residual, up)
    g = norm.weight.float() + 1.0 if norm.unit_offset else norm.weight.float()
    return out, sumsq, (out.float() * g).to(out.dtype)


def _raise_if(problem: str | None) -> None:
    if problem is not None:
        raise ValueError(problem)


# Each operand check once, as its problem (None: none): the launchers raise it, the tuned_* variants fall back
# (None) on it.
def _silu_mul_problem(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    if up.shape != gate.shape or up.dtype != gate.dtype or up.stride(-1) != 1:
        return (f"silu_mul_gemv: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be the same [M, K] shape and "
                "dtype with a contiguous last dimension")
    return None


def _norm_weight_problem(x: torch.Tensor, norm: RowNorm) -> str | None:
    k = x.shape[1]
    if norm.weight.shape != (k,) or norm.weight.dtype != x.dtype or not norm.weight.is_contiguous():
        return (f"normed_gemv: the norm's weight {tuple(norm.weight.shape)} {norm.weight.dtype} must be [{k}] "
                f"contiguous in the rows' dtype {x.dtype}")
    return None


def _next_norm_problem(x: torch.Tensor, w: torch.Tensor, norm: NextNorm) -> str | None:
    n = w.shape[0]
    if norm.weight.shape != (n,) or norm.weight.dtype != x.dtype or not norm.weight.is_contiguous():
        return (f"residual_prescaled_gemv: the next norm's weight {tuple(norm.weight.shape)} {norm.weight.dtype} "
                f"must be [{n}] {x.dtype}, contiguous")
    return None


def _norm_sums_problem(x: torch.Tensor, norm: RowNorm) -> str | None:
    num_rows = x.shape[0]
    if norm.sumsq.dim() != 2 or norm.sumsq.shape[0] != num_rows or norm.sumsq.dtype != torch.float32 \
            or not norm.sumsq.is_contiguous():
        return (f"normed_gemv: sums of squares {tuple(norm.sumsq.shape)} {norm.sumsq.dtype} must be [{num_rows}, "
                "parts] contiguous float32, one row for each of x's")
    return None


def _gated_problem(x: torch.Tensor, gated: GatedNorm, config: GemvConfig) -> str | None:
    head = gated.weight.shape[0] if gated.weight.dim() == 1 else 0
    if not gated_gemv_fits(x.shape[1], head, config):
        return (f"gated_gemv: heads of {tuple(gated.weight.shape)} elements must be a power of 2 dividing "
                f"K={x.shape[1]} and the tile's block_k={config.block_k} a power of 2 of them")
    if gated.gate.shape != x.shape or gated.gate.dtype != x.dtype or gated.gate.stride(-1) != 1 \
            or gated.weight.dtype != x.dtype or not gated.weight.is_contiguous():
        return (f"gated_gemv: the gate {tuple(gated.gate.shape)} {gated.gate.dtype} must be x's {tuple(x.shape)} "
                f"{x.dtype} with a contiguous last dimension, the weight contiguous in x's dtype (got "
                f"{gated.weight.dtype})")
    return None


def _conv_problem(x: torch.Tensor, w: torch.Tensor, conv: ConvStep) -> str | None:
    taps, states, slots = conv.weight, conv.states, conv.slots
    if taps.dim() != 2 or not 1 <= taps.shape[0] <= w.shape[0] or taps.shape[1] < 2 or taps.stride(-1) != 1:
        return (f"conv_gemv: the conv's taps {tuple(taps.shape)} must be [C, W] with 1 <= C <= N={w.shape[0]}, "
                "W >= 2 and a contiguous last dimension")
    if states.dim() != 3 or states.shape[1:] != (taps.shape[0], taps.shape[1] - 1) or states.stride(-1) != 1:
        return (f"conv_gemv: the conv states {tuple(states.shape)} must be [slots, {taps.shape[0]}, "
                f"{taps.shape[1] - 1}] with a contiguous last dimension")
    if slots.shape != (x.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        return (f"conv_gemv: slots {tuple(slots.shape)} {slots.dtype} must be int32 or int64 [{x.shape[0]}], one for "
                "each of x's rows")
    return None


def _residual_problem(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> str | None:
    num_rows, n = x.shape[0], w.shape[0]
    if residual.shape != (num_rows, n) or residual.dtype != x.dtype or residual.stride(-1) != 1:
        return (f"residual_gemv: the residual {tuple(residual.shape)} {residual.dtype} must be [{num_rows}, {n}] in "
                f"x's dtype {x.dtype} with a contiguous last dimension")
    return None


def _launch(x: torch.Tensor, up: torch.Tensor | None, w: torch.Tensor, config: GemvConfig,
            norm: RowNorm | None = None, residual: torch.Tensor | None = None,
            gated: GatedNorm | None = None, conv: ConvStep | None = None,
            swiglu: bool = False, prescale: NextNorm | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """gemv (up None), silu_mul_gemv (x the gate), normed_gemv (norm; prescaled or not), gated_gemv (gated),
    residual_gemv (residual, with up, gated or neither), residual_prescaled_gemv (residual and prescale, with up
    or not), conv_gemv (conv, with norm or not) or swiglu_gemv (swiglu, with norm or not): (out, the sums of
    squares residual_gemv writes or None, with prescale the prescaled rows or None)."""
    num_rows, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or num_rows > MAX_ROWS or x.stride(-1) != 1 or not w.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} (at most {MAX_ROWS} rows, last dim contiguous) against w "
                         f"{tuple(w.shape)} (contiguous [N, K])")
    assert norm is None or (up is None and residual is None and gated is None), "NORM joins CONV alone"
    assert conv is None or (up is None and residual is None and gated is None), "CONV joins NORM alone"
    assert gated is None or up is None, "GATED's up operand is the gate"
    assert prescale is None or (residual is not None and gated is None), "PRESCALE joins RESIDUAL, not GATED"
    assert not swiglu or (up is None and residual is None and gated is None and conv is None), "SWIGLU joins NORM alone"
    if swiglu and (n % 2 or config.block_n % 2):
        raise ValueError(f"swiglu_gemv: w {tuple(w.shape)} needs whole gate / up pairs: an even N and block_n "
                         f"(config {config.block_n})")
    core_rows, block_m = _rows_tile(config, num_rows)
    # (stream-K's runs part blocks: its epilogue has no SWIGLU, so a stream-K entry runs as a grid of blocks there)
    if config.stream > 0 and num_rows > 1 and not core_rows and norm is None and residual is None and gated is None \
            and conv is None and not swiglu:
        return _launch_stream(x, up, w, config), None, None
    blocks = triton.cdiv(n, config.block_n)
    # Arrival counters are per output block (quant_matmul's, shared with the int4 kernels).
    split = max(1, config.split) if blocks <= _COUNTER_SLOTS else 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((num_rows, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, num_rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    sumsq = torch.empty((num_rows, blocks), dtype=torch.float32, device=x.device) if residual is not None else None
    scaled = torch.empty_like(out) if prescale is not None else None
    # bf16 pairs as int32 on the CUDA cores (see _accumulate); 4-byte alignment holds for any even K and any
    # allocation, but a view of x or w may start mid-pair (the up half of a gate|up row starts K elements in),
    # and several rows need even row strides too (the norm's weight is one row, read by every row)
    operands = (x, w) + ((up,) if up is not None else ()) + ((gated.gate,) if gated is not None else ())
    norm_weights = (norm.weight,) if norm is not None else (gated.weight,) if gated is not None else ()
    pairs = (num_rows == 1 or core_rows) and x.dtype == w.dtype == torch.bfloat16 and k % 2 == 0 \
        and all(t.data_ptr() % 4 == 0 for t in operands + norm_weights) \
        and (num_rows == 1 or all(t.stride(0) % 2 == 0 for t in operands))
    # (x[0]: the one row's view, whatever the row stride; an odd stride could not be viewed as pairs)
    x_arg = (x[0] if num_rows == 1 else x).view(torch.int32) if pairs else x
    if norm is not None:
        # every row reads the same weight (row stride 0)
        up_arg, stride_u = norm.weight.view(torch.int32) if pairs else norm.weight, 0
    elif up is not None or gated is not None:
        second = up if up is not None else gated.gate  # type: ignore[union-attr]
        up_arg = (second[0] if num_rows == 1 else second).view(torch.int32) if pairs else second
        stride_u = second.stride(0)
    else:
        up_arg, stride_u = x_arg, x.stride(0)
    if config.prefetch not in (1, 2, 4):
        raise ValueError(f"gemv: prefetch={config.prefetch} must be 1, 2 or 4 weight tiles")
    # Tiles before the wait: at most the last split's (the shortest; whole tiles when K is a multiple of block_k).
    last_split = k - (split - 1) * k_per_split
    prefetch = max(p for p in (1, 2, 4) if p == 1 or (p <= config.prefetch and p * config.block_k <= last_split))
    if config.l2_prefetch not in (0, 1, 2, 4, 8):
        raise ValueError(f"gemv: l2_prefetch={config.l2_prefetch} must be 0, 1, 2, 4 or 8 weight tiles")
    # a tile's units along K (pairs or elements)
    units = config.block_k // (2 if pairs else 1)
    # L2 prefetch only with PDL (it overlaps the wait) and tiles of whole 32-unit steps (a 128-byte line of pairs;
    # 64 bytes of bf16 elements, each line then asked for twice)
    l2_prefetch = config.l2_prefetch if pdl_launch(x.device)["PDL"] and units % 32 == 0 else 0
    # CORE_ROWS' accumulator [BLOCK_M, BLOCK_N, units], fp32 registers a thread
    acc_regs = block_m * config.block_n * units // (32 * config.num_warps)
    # NORM reads the parts of the GEMV before; RESIDUAL writes its own (one an output block)
    parts = norm.sumsq if norm is not None else sumsq if sumsq is not None else out
    gemv_fwd_kernel[(blocks, split)](
        # counters only for a split (a launch without one never touches them, nor allocates them)
        x_arg, up_arg, w.view(torch.int32) if pairs else w, out, ws,
        _counters(x.device) if split > 1 else out, num_rows, n, k, k_per_split, split, x.stride(0),
        stride_u, w.stride(0), out.stride(0),
        residual if residual is not None else out, parts, parts.shape[1] if parts.dim() == 2 else 0,
        residual.stride(0) if residual is not None else 0,
        norm.eps if norm is not None else gated.eps if gated is not None else 0.0,
        (gated.weight.view(torch.int32) if pairs else gated.weight) if gated is not None else out,
        *_conv_arguments(conv, out),
        scaled if scaled is not None else out, prescale.weight if prescale is not None else out,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, EVEN_K=k % config.block_k == 0, SPLIT=split > 1, PAIRS=pairs,
        SILU_MUL=up is not None, num_warps=config.num_warps,
        # (one row has no MMA: a swap_ab config runs the same one-row kernel, not a second compile of it)
        SWAP_AB=config.swap_ab and num_rows > 1 and not core_rows, CORE_ROWS=core_rows,
        ROW_SUM=core_rows and acc_regs > CORE_ROWS_ACC_REGS, PREFETCH=prefetch,
        NORM=norm is not None and not norm.prescaled, ROW_SCALE=norm is not None and norm.prescaled,
        # (ROW_SCALE reads no weight: one variant whatever the offset)
        UNIT_OFFSET=(norm is not None and not norm.prescaled and norm.unit_offset)
        or (prescale is not None and prescale.unit_offset),
        RESIDUAL=residual is not None, GATED=gated is not None,
        HEAD=gated.weight.shape[0] if gated is not None else 1, CONV=conv is not None,
        CONV_TAPS=conv.weight.shape[1] if conv is not None else 4,
        CONV_BLOCK=triton.next_power_of_2(conv.weight.shape[1]) if conv is not None else 4,
        L2_PREFETCH=l2_prefetch, SWIGLU=swiglu, PRESCALE=prescale is not None,
        EARLY_RESIDUAL=EARLY_RESIDUAL and residual is not None, **pdl_launch(x.device),
    )
    return out, sumsq, scaled


def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count (stream-K's grid is a multiple of it); 4 off the GPU (the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_stream(x: torch.Tensor, up: torch.Tensor | None, w: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """gemv / silu_mul_gemv of several rows by gemv_stream_fwd_kernel: config.stream programs a multiprocessor
    (fewer where the iterations run out), each per_program (block, K tile) iterations."""
    num_rows, k = x.shape
    n = w.shape[0]
    blocks, k_tiles = triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k)
    total = blocks * k_tiles
    per_program = triton.cdiv(total, config.stream * multiprocessors(x.device))
    programs = triton.cdiv(total, per_program)
    # a block's K tiles fall to at most this many programs' runs; a split block's parts are parked two a program
    most_parts = min(programs, triton.cdiv(k_tiles - 1, per_program) + 1)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((programs, 2, 16 * config.block_n), dtype=torch.float32, device=x.device) \
        if most_parts > 1 else out
    second = up if up is not None else x
    gemv_stream_fwd_kernel[(programs,)](
        x, second, w, out, ws, _counters(x.device) if most_parts > 1 else out, num_rows, n, k, k_tiles, per_program,
        x.stride(0), second.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        EVEN_K=k % config.block_k == 0, SILU_MUL=up is not None, SWAP_AB=config.swap_ab, num_warps=config.num_warps,
        **pdl_launch(x.device),
    )
    return out


def _conv_arguments(conv: ConvStep | None, out: torch.Tensor) -> tuple:
    """The kernel's conv_w, conv_states, conv_slots, conv_channels, stride_cw, stride_cs, stride_cc (out and zeros
    without a conv: never read)."""
    if conv is None:
        return out, out, out, 0, 0, 0, 0
    return (conv.weight, conv.states, conv.slots, conv.weight.shape[0], conv.weight.stride(0), conv.states.stride(0),
            conv.states.stride(1))


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
    if config is None or _silu_mul_problem(gate, up) is not None:
        return None
    return silu_mul_gemv(gate, up, w, config)


def tuned_swiglu_gemv(x: torch.Tensor, w: torch.Tensor, norm: RowNorm | None = None) -> torch.Tensor | None:
    """swiglu_gemv with the plain shape's shipped configuration (the epilogue adds no weight bytes: the same tiles
    stream), or None where none is shipped or it does not fit (an odd tile; the norm's weight): the caller
    projects, then runs silu_mul on the pairs."""
    config = _tuned_config(x, w, PLAIN_INPUT)
    if config is None or config.block_n % 2 or w.shape[0] % 2 \
            or (norm is not None and _norm_weight_problem(x, norm) is not None):
        return None
    return swiglu_gemv(x, w, config, norm)


def tuned_normed_gemv(x: torch.Tensor, norm: RowNorm, w: torch.Tensor) -> torch.Tensor | None:
    """normed_gemv with the plain shape's shipped configuration (the norm adds no weight bytes: the same tiles
    stream), or None where none is shipped or the norm's weight is not [K] in the rows' dtype: the caller norms
    first and then runs its linear."""
    config = _tuned_config(x, w, PLAIN_INPUT)
    if config is None or _norm_weight_problem(x, norm) is not None:
        return None
    return normed_gemv(x, norm, w, config)


def tuned_conv_gemv(x: torch.Tensor, w: torch.Tensor, conv: ConvStep, norm: RowNorm | None = None) -> torch.Tensor | None:
    """conv_gemv with the plain shape's shipped configuration (the step adds a few loads a conv channel, no weight
    bytes), or None where none is shipped or an operand does not fit (then nothing has run: the caller projects,
    then runs the conv kernel)."""
    config = _tuned_config(x, w, PLAIN_INPUT)
    if config is None or _conv_problem(x, w, conv) is not None \
            or (norm is not None and _norm_weight_problem(x, norm) is not None):
        return None
    return conv_gemv(x, w, conv, config, norm)


def tuned_residual_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, up: torch.Tensor | None = None,
                        gated: GatedNorm | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """residual_gemv with the shipped configuration of the projection it ends, or None where none is shipped or
    the residual is not [M, N] in x's dtype with unit last stride: the caller projects and adds apart. With up
    (SwiGLU's down projection) the fused shape's entry; at row counts where only the plain shape has one (the
    sweep's fused shape lost there), silu_mul's kernel makes the activation first and the plain GEMV adds. With
    gated (Gated DeltaNet's out-projection) the plain entry, where its tiles hold whole heads (gated_gemv_fits)."""
    chosen = _residual_config(x, w, residual, up)
    if chosen is None:
        return None
    x, up, config = chosen
    if gated is not None and _gated_problem(x, gated, config) is not None:
        return None
    return residual_gemv(x, w, residual, config, up, gated)


def tuned_residual_prescaled_gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm: NextNorm,
                                  up: torch.Tensor | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """residual_prescaled_gemv with the configuration tuned_residual_gemv would run (None where it would not run,
    or the norm's weight is not [N] in x's dtype): (the sum, its sums of squares, the prescaled rows)."""
    if _next_norm_problem(x, w, norm) is not None:
        return None
    chosen = _residual_config(x, w, residual, up)  # (which may make SwiGLU's activation first)
    if chosen is None:
        return None
    x, up, config = chosen
    return residual_prescaled_gemv(x, w, residual, norm, config, up)


def _residual_config(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, up: torch.Tensor | None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None, GemvConfig] | None:
    """(x, up, the entry) a residual GEMV runs with: with up the fused shape's entry, else (no fused entry at this
    row count) the activation made first by silu_mul's kernel and the plain entry; None where the table has
    neither or the operands do not fit."""
    if _residual_problem(x, w, residual) is not None or (up is not None and _silu_mul_problem(x, up) is not None):
        return None
    config = _tuned_config(x, w, SILU_MUL_INPUT) if up is not None else None
    if up is not None and config is None:
        # no fused entry at this row count: the activation first, then the plain shape's entry adds
        if _tuned_config(x, w, PLAIN_INPUT) is None:
            return None
        from headroom.kernels.gates_triton import silu_mul

        x, up = silu_mul(x, up), None
    if up is None:
        config = _tuned_config(x, w, PLAIN_INPUT)
    return None if config is None else (x, up, config)


def _table(device: torch.device) -> dict[tuple[int, int, int, str], GemvConfig]:
    """This process's table, loaded on first use."""
    global _tuned
    if _tuned is None:
        _tuned = load_tuned_configs(device)
    return _tuned


def _tuned_config(x: torch.Tensor, w: torch.Tensor, kind: str) -> GemvConfig | None:
    table = _table(x.device)
    rows = _entry_rows(table, w.shape[0], w.shape[1], x.shape[0], kind) if x.dim() == 2 else None
    if rows is None or x.dtype != torch.bfloat16 or w.dtype != x.dtype or x.stride(-1) != 1 or not w.is_contiguous():
        return None
    return table.get((w.shape[0], w.shape[1], rows, kind))


def _entry_rows(table: dict[tuple[int, int, int, str], GemvConfig], n: int, k: int, m: int, kind: str) -> int | None:
    """The row count of the entry that a launch of m rows takes: its own, or with NEAREST_ROWS the next larger one
    of its shape and input; None: cuBLAS."""
    if table.get((n, k, m, kind)) is not None:
        return m
    if NEAREST_ROWS and 1 < m < MAX_ROWS:
        return next((larger for larger in range(m + 1, MAX_ROWS + 1) if table.get((n, k, larger, kind)) is not None),
                    None)
    return None


def warm_up_rows(device: torch.device, already: tuple[int, ...] = (), keep: Callable[[int, int], bool] | None = None,
                 most: int = MAX_ROWS) -> tuple[int, ...]:
    """Row counts (1..most) whose launches, with those of `already`, take every GEMV variant that launches of 1 to
    `most` rows can take with this GPU's table, on the weight shapes (out, in) `keep` admits (all where None): each
    table entry in every variant Triton compiles of it across the row counts it serves (rows_variant). A warm-up
    that runs a pass of each compiles them all before /ready; with NEAREST_ROWS, 9-15 rows take the 16-row entries
    in a variant of their own, which a server capturing decode graphs up to 8 sequences (the int2 plan) otherwise
    met first in a request of that many tokens. () on a device without a table."""
    return rows_covering(_table(device), already, keep, most) if device.type == "cuda" else ()


def rows_covering(table: dict[tuple[int, int, int, str], GemvConfig], already: tuple[int, ...] = (),
                  keep: Callable[[int, int], bool] | None = None, most: int = MAX_ROWS) -> tuple[int, ...]:
    """warm_up_rows for a given table: the fewest row counts found greedily (the smallest first among equals)."""
    shapes = {(n, k, kind) for n, k, _, kind in table if keep is None or keep(n, k)}

    def launched(m: int) -> set[tuple]:
        return {(n, k, kind, rows, rows_variant(table[(n, k, rows, kind)], m)) for n, k, kind in shapes
                if (rows := _entry_rows(table, n, k, m, kind)) is not None}

    candidates = {m: launched(m) for m in range(1, most + 1)}
    missing = set().union(*candidates.values()) - set().union(*(candidates.get(m, set()) for m in already))
    chosen = []
    while missing:
        best = max(candidates, key=lambda m: (len(candidates[m] & missing), -m))
        chosen.append(best)
        missing -= candidates[best]
    return tuple(sorted(chosen))


def rows_variant(config: GemvConfig, num_rows: int) -> tuple[int, bool, int]:
    """What of a launch of num_rows rows with `config` Triton compiles a variant for: the class it specialises the
    row count on (1, a multiple of 16, the rest), whether the rows run on the CUDA cores, and BLOCK_M (the
    constexprs that follow them, PAIRS, SWAP_AB, ROW_SUM and the stream-K kernel, follow from these three and the
    config)."""
    core_rows, block_m = _rows_tile(config, num_rows)
    return 1 if num_rows == 1 else 16 if num_rows % 16 == 0 else 0, core_rows, block_m


def _rows_tile(config: GemvConfig, num_rows: int) -> tuple[bool, int]:
    """(CORE_ROWS, BLOCK_M) of a launch: the rows on the CUDA cores for rows_on_cores configs up to CORE_ROWS_MAX
    rows, in a tile of the next power of two; else one row, or a 16-row MMA tile."""
    core_rows = config.rows_on_cores and 1 < num_rows <= CORE_ROWS_MAX
    return core_rows, 1 if num_rows == 1 else triton.next_power_of_2(num_rows) if core_rows else 16


def load_tuned_configs(device: torch.device) -> dict[tuple[int, int, int, str], GemvConfig]:
    """The shipped table's entries for this GPU and Triton version (none for another version: timings differ),
    keyed (out_features, in_features, rows, input kind); an entry without "input" (tables before the fused
    down projection) is a plain one, one without "swap_ab" (tables before it) is not swapped, one without
    "rows_on_cores" runs several rows on the tensor cores, one without "prefetch" loads one tile before its
    PDL wait, one without "stream" is a grid of blocks and splits, and one without "l2_prefetch" asks L2 for
    nothing before its wait."""
    from headroom.kernels.tuned_table import entries_for

    return {(c["n"], c["k"], c["m"], c.get("input", PLAIN_INPUT)): config_of(c)
            for c in entries_for(TUNED_CONFIGS, device)}


def config_of(entry: dict) -> GemvConfig:
    """A table entry's GemvConfig (load_tuned_configs says what a missing field means)."""
    return GemvConfig(entry["block_n"], entry["block_k"], entry["split"], entry["num_warps"], entry["num_stages"],
                      entry.get("swap_ab", False), entry.get("rows_on_cores", False), entry.get("prefetch", 1),
                      entry.get("stream", 0), entry.get("l2_prefetch", 0))
