"""Attention of query chunks of one or many sequences over their cached keys, read straight from the paged pool.

Dequantization (dense, fp8, KIVI int8/int4/int2) is fused into the key/value loads, so the workspace is
one tile per program: no dense copy of the prefix is ever made. Grouped-query attention: the
Hq // Hkv query heads of one KV head share each loaded tile (rows of a program are (token, head) pairs).
Causal by absolute positions; online softmax in fp32; returns the output and its log-sum-exp so that a
second key range (the KIVI residual window) merges in with merge_attention_states. Long key ranges with
few query tiles (decode) are split over programs (flash-decoding) and merged the same way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from headroom.kernels.attention_merge_triton import merge_splits_into
from headroom.kernels.gates_triton import sigmoid_mul
from headroom.kernels.int_float import exact_float

# The reference lives in the triton-free paged_kv so CPU callers never import (and compile-decorate) this module.
from headroom.kernels.paged_kv import (
    KeyWindow,
    PagedKV,
    blockwise_supported,
    naive_dequantize_block,
    naive_paged_attention,
)
from headroom.kernels.pdl import pdl_enter, pdl_launch

__all__ = ["dequantize_block", "naive_dequantize_block", "naive_paged_attention", "paged_attention",
           "paged_attention_fwd", "paged_attention_fwd_kernel"]

_KIND_CODE = {"dense": 0, "fp8": 1, "kivi": 2}
# Programs to aim for before splitting key ranges: two waves of an H200's 132 multiprocessors.
_TARGET_PROGRAMS = 264
_MAX_SPLITS = 32
# KIVI decode may split further: one sequence's 4 KV heads at 32 splits were one wave of 128 programs, each
# dequantizing 1,024 keys (H200, 32K keys, session 12 call 2's decode_tiles: 0.087 ms a layer; 64 splits with 4 warps
# 0.072, bf16's own 0.068). Batches of 2 or more still reach _TARGET_PROGRAMS under _MAX_SPLITS.
_MAX_SPLITS_KIVI = 64
# LAZY_RESCALE: the running maximum a row may fall behind by (log2 units) before its accumulator is rescaled; a
# tile's p is then at most 2^8, far inside fp32's range and exact to bf16's relative precision (FlashAttention-4's
# conditional rescaling).
RESCALE_LOG2: tl.constexpr = tl.constexpr(8.0)
# The exponent field of the float 2^23 (127 + 23): _load_kivi_pages turns codes into floats through it.
MAGIC_EXPONENT: tl.constexpr = tl.constexpr(150)
# Tile config overrides for extend (prefill) and decode launches, keys block_n, num_warps, num_stages (and
# block_m for extend), the loop variants mask_split (no causal or range mask on tiles every row sees whole)
# and lazy_rescale (RESCALE_LOG2), the KIVI loads magic_register (MAGIC_IN_REGISTER), load_per_token
# (LOAD_PER_TOKEN) and half_tiles (HALF_TILES: fp16 tiles, _load_kivi_pages), max_registers (a register cap
# for ptxas, also kernels/kivi_decode.py's), and for decode d_chunks (kernels/kivi_decode.py) and splits_x (that
# many times default_num_splits' key splits): set only by bench/engine_speed.py's tile sweeps and tuned rows; a key
# left out takes EXTEND_DEFAULTS / DECODE_DEFAULTS below, or 0.
EXTEND_TUNING: dict[str, int] = {}
DECODE_TUNING: dict[str, int] = {}
# What a launch takes where its tuning table is silent, measured on the H200 with the same output bit for bit
# (bench/results/session16):
# - mask_split, extend only: an 8,192-query chunk over 32K keys 11.0 -> 8.22 ms on a bf16 pool, 18.6 -> 17.5 ms on
#   int2 (call 2's tile sweep); at batch 8 decode its gain was within the sweep's noise.
# - load_per_token with magic_register (KIVI tiles, both kinds of launch; a bf16 pool ignores them): the int2 extend
#   tile 17.2 -> 14.4 ms, decode at batch 8 over 32K keys 0.404 -> 0.361 ms a layer, at batch 1 0.130 -> 0.119
#   (call 3's kivi_load sweep). Either alone gained less or lost (load_per_token alone 17.7 / 0.417).
# - half_tiles, decode only (session 19, H200, the int2 LLM API rows with it against without in one process): decode
#   at 32K of context 1,361 against 1,301 tok/s at batch 8, 307.8 against 303.3 at batch 1; in extend launches it moved
#   prefill by -2.7% (8K) to +0.4% (128K), so extend keeps the fp32 tiles.
# A tuning of 0 times the plain loop (the sweeps' {"mask_split": 0}).
EXTEND_DEFAULTS: dict[str, int] = {"mask_split": 1, "load_per_token": 1, "magic_register": 1}
DECODE_DEFAULTS: dict[str, int] = {"load_per_token": 1, "magic_register": 1, "half_tiles": 1}


@contextlib.contextmanager
def tuned(extend: dict[str, int] | None = None, decode: dict[str, int] | None = None) -> Iterator[None]:
    """EXTEND_TUNING and DECODE_TUNING holding these (None: as they are) inside the block, what they held after it."""
    saved = dict(EXTEND_TUNING), dict(DECODE_TUNING)
    for table, values in ((EXTEND_TUNING, extend), (DECODE_TUNING, decode)):
        if values is not None:
            table.clear()
            table.update(values)
    try:
        yield
    finally:
        for table, before in zip((EXTEND_TUNING, DECODE_TUNING), saved, strict=True):
            table.clear()
            table.update(before)


def _block_m(rows: int) -> int:
    """Query rows ((token, head) pairs) of one program: 16 for decode, 128 for prefill chunks."""
    return 16 if rows <= 16 else 64 if rows <= 64 else 128


@triton.jit
def _load_tile(
    base, scale_ptr, zero_ptr, page, row, i_h, o_d, m_rows, m_tile,
    stride_p, stride_r, stride_h, stride_sp, stride_sh,
    KIND: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr, PER_CHANNEL: tl.constexpr, GROUP_D: tl.constexpr,
):
    """A [BLOCK_N, BLOCK_D] fp32 tile of keys (PER_CHANNEL) or values, dequantized; one gathered address per
    element (any tile size, any page size). KIVI tiles of whole pages take _load_kivi_pages instead."""
    if KIND == 2:
        per_byte: tl.constexpr = 8 // BITS
        p_x = base + page[:, None] * stride_p + (row // per_byte)[:, None] * stride_r + i_h * stride_h + o_d[None, :]
        codes = (tl.load(p_x, mask=m_tile, other=0).to(tl.int32) >> ((row % per_byte) * BITS)[:, None]) & ((1 << BITS) - 1)
        if PER_CHANNEL:
            p_s = page[:, None] * stride_sp + i_h * stride_sh + o_d[None, :]
        else:
            p_s = (page * PAGE + row)[:, None] * stride_sp + i_h * stride_sh + (o_d // GROUP_D)[None, :]
        b_s = tl.load(scale_ptr + p_s, mask=m_tile, other=0).to(tl.float32)
        b_z = tl.load(zero_ptr + p_s, mask=m_tile, other=0).to(tl.float32)
        return exact_float(codes) * b_s + b_z
    p_x = base + page[:, None] * stride_p + i_h * stride_h + o_d[None, :]
    if KIND == 1:
        codes = tl.load(p_x, mask=m_tile, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b_s = tl.load(scale_ptr + page * stride_sp + i_h * stride_sh, mask=m_rows, other=0)
        return codes * b_s[:, None]
    return tl.load(p_x, mask=m_tile, other=0).to(tl.float32)


# HALF_TILES' codes: four packed bytes ($2) and a mask for each ($3: a byte's code bits, (2^BITS - 1) << p for the
# token at bit offset p) -> the four masked bytes as fp16 (code * 2^p, exactly) in two fp16x2 registers ($0: bytes 0
# and 1, $1: bytes 2 and 3). prmt puts each masked byte under 0x64 (fp16 1024.0's high byte: the byte is the
# mantissa's low 8 bits, each worth 1) and sub.f16x2 takes the 1024 off. Byte by byte, so whichever four elements
# Triton packs into an operand (its layouts differ between versions), each meets its own mask. Emulated bit for bit
# in tests/kernels/test_paged_attention.py.
HALF_CODES_ASM: tl.constexpr = tl.constexpr("""{
.reg .b32 t, m;
and.b32 t, $2, $3;
prmt.b32 $0, t, 0x64646464, 0x4140;
prmt.b32 $1, t, 0x64646464, 0x4342;
mov.b32 m, 0x64006400;
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
}""")


@triton.jit
def _load_kivi_pages(
    base, scale_ptr, zero_ptr, pages, m_pages, o_d, m_d,
    stride_p, stride_r, stride_sp,
    BITS: tl.constexpr, PAGE: tl.constexpr, PER_CHANNEL: tl.constexpr, GROUP_D: tl.constexpr,
    NUM_PAGES: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, D0: tl.constexpr, magic_exponent,
    LOAD_PER_TOKEN: tl.constexpr = False, HALF: tl.constexpr = 0,
):
    """A [NUM_PAGES * PAGE, BLOCK_D] fp32 tile of KIVI keys (PER_CHANNEL) or values: NUM_PAGES whole pages, channels
    o_d = D0 .. D0 + BLOCK_D - 1 (D0 a multiple of GROUP_D: a slice of the head for kivi_decode's chunks, else 0).
    magic_exponent: MAGIC_EXPONENT, as the literal (folded into immediates) or a kernel argument (in a register).
    HALF (HALF_TILES): an fp16 tile instead, code * scale + zero in one fp16 FMA (scale and zero are stored fp16),
    rounded once, two elements an instruction; 2: its codes by inline PTX (the GPU), 1: in Triton (the interpreter).

    base, scale_ptr, zero_ptr already point at this KV head; pages [NUM_PAGES] (m_pages: those inside the key
    range; the others load as zeros, never another page's memory). Each packed byte is loaded once ([pages,
    PAGE * BITS / 8, D] addresses, not the [PAGE * pages, D] of _load_tile's gather), or with LOAD_PER_TOKEN once
    per token it holds ([pages, PAGE * BITS / 8, 8 / BITS, D], the same addresses repeated: see there why), and
    its 8 / BITS codes are masked out in place (below); key scales are one [D] row per page and value scales one
    per (token, channel group), broadcast instead of gathered per element.
    """
    per_byte: tl.constexpr = 8 // BITS
    ROWS: tl.constexpr = PAGE // per_byte
    BLOCK_N: tl.constexpr = NUM_PAGES * PAGE
    o_r = tl.arange(0, ROWS)
    if LOAD_PER_TOKEN:
        # Each packed byte loaded once per token it holds, as a [pages, rows, tokens a byte, D] tile: the unpacking
        # then runs in the load's layout, D-contiguous runs a thread (16 bytes), and the dequantized tile reaches
        # shared memory for the MMA in 128-bit stores. Loaded once ([pages, rows, D]) and broadcast over the tokens
        # instead, Triton's default layout for the 4-D unpacking holds one channel a thread: a 16-bit store per
        # element (256 of a decode loop's 2,707 sm_90 instructions with Triton 3.6, bench/kernel_sass.py kivi_load).
        same = tl.zeros([per_byte], dtype=tl.int32)
        p_x = base + pages[:, None, None, None] * stride_p + (o_r[None, :, None, None] * stride_r
                                                              + same[None, None, :, None] + o_d[None, None, None, :])
        raw = tl.load(p_x, mask=m_pages[:, None, None, None] & m_d[None, None, None, :], other=0)
        packed = raw.to(tl.int32)
    else:
        p_x = base + pages[:, None, None] * stride_p + (o_r[None, :, None] * stride_r + o_d[None, None, :])
        raw = tl.load(p_x, mask=m_pages[:, None, None] & m_d[None, None, :], other=0)[:, :, None, :]
        packed = raw.to(tl.int32)
    if HALF == 2:
        # fp16 codes on the GPU, four a register (HALF_CODES_ASM: five instructions for four codes, where the fp32
        # path below spends about four an element and a conversion to bf16 a pair): code * 2^p, the 2^-p going
        # into the scales below (one multiply a scale, not an element).
        full: tl.constexpr = (NUM_PAGES, ROWS, per_byte, BLOCK_D)
        offsets = tl.arange(0, per_byte) * BITS
        masks = tl.broadcast_to((((1 << BITS) - 1) << offsets).to(tl.uint8)[None, None, :, None], full)
        codes = tl.inline_asm_elementwise(asm=HALF_CODES_ASM, constraints="=r,=r,r,r",
                                          args=[tl.broadcast_to(raw, full), masks], dtype=tl.float16, is_pure=True,
                                          pack=4)
    elif HALF:
        # The same fp16 codes where inline PTX cannot run (the interpreter): shifted down, OR-ed into the mantissa
        # of fp16 1024.0 (0x6400, where bit 0 weighs 1), minus 1024.
        shifts16 = (tl.arange(0, per_byte) * BITS).to(tl.int16)
        codes16 = ((packed.to(tl.int16) >> shifts16[None, None, :, None]) & ((1 << BITS) - 1)) | 0x6400
        codes = codes16.to(tl.float16, bitcast=True) - 1024.0
    else:
        # Token i of a page sits in byte i // per_byte at bit p = (i % per_byte) * BITS (kv_quant.pack_codes). The
        # code is masked in place, not shifted down: OR-ed into the mantissa of the float 2^(23 - p) (exponent
        # 150 - p), in which bit p weighs 1, the float minus 2^(23 - p) is the code, exactly (kernels/int_float.py's
        # trick with the magic per position; 10.2 -> 9.6 sm_90 instructions an element at int2, bench/kernel_sass.py
        # kivi). With the exponent a kernel argument (MAGIC_IN_REGISTER) the mask and the OR are one LOP3 (a LOP3
        # takes one immediate): 10.57 -> 9.55 an element with Triton 3.6, the same registers.
        shifts = tl.arange(0, per_byte) * BITS
        magic_bits = (magic_exponent - shifts) << 23
        codes = (packed & (((1 << BITS) - 1) << shifts)[None, None, :, None]) | magic_bits[None, None, :, None]
        codes = codes.to(tl.float32, bitcast=True) - magic_bits.to(tl.float32, bitcast=True)[None, None, :, None]
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_D))
    if PER_CHANNEL:
        p_s = pages[:, None] * stride_sp + o_d[None, :]
        m_s = m_pages[:, None] & m_d[None, :]
        shape: tl.constexpr = (NUM_PAGES, PAGE, BLOCK_D)
        b_s = tl.load(scale_ptr + p_s, mask=m_s, other=0)
        b_z = tl.load(zero_ptr + p_s, mask=m_s, other=0)
        if not HALF:
            b_s, b_z = b_s.to(tl.float32), b_z.to(tl.float32)
        if HALF == 2:
            # The codes are code * 2^p: each page's scales times 2^-p per token offset p, [pages, 1, offsets, D],
            # exact in fp16 (to the subnormal range, whose spacing is far below a KIVI code step).
            unit = tl.exp2(-(tl.arange(0, per_byte) * BITS).to(tl.float32)).to(tl.float16)
            b_s4 = b_s[:, None, None, :] * unit[None, None, :, None]
            b_s = tl.reshape(tl.broadcast_to(b_s4, (NUM_PAGES, ROWS, per_byte, BLOCK_D)), (BLOCK_N, BLOCK_D))
        else:
            b_s = tl.reshape(tl.broadcast_to(b_s[:, None, :], shape), (BLOCK_N, BLOCK_D))
        b_z = tl.reshape(tl.broadcast_to(b_z[:, None, :], shape), (BLOCK_N, BLOCK_D))
    else:
        BLOCK_G: tl.constexpr = BLOCK_D // GROUP_D
        o_g = D0 // GROUP_D + tl.arange(0, BLOCK_G)
        o_t = tl.arange(0, PAGE)
        # Value scales are per slot (page * PAGE + row), [slots, H, G].
        p_s = (pages[:, None, None] * PAGE + o_t[None, :, None]) * stride_sp + o_g[None, None, :]
        m_g = m_pages[:, None, None] & (o_g * GROUP_D < HEAD_DIM)[None, None, :]
        shape: tl.constexpr = (NUM_PAGES, PAGE, BLOCK_G, GROUP_D)
        b_s = tl.load(scale_ptr + p_s, mask=m_g, other=0)
        b_z = tl.load(zero_ptr + p_s, mask=m_g, other=0)
        if not HALF:
            b_s, b_z = b_s.to(tl.float32), b_z.to(tl.float32)
        if HALF == 2:
            # Token t's scales times 2^-p, p its offset in its byte (t % per_byte) * BITS (see the keys').
            b_s = b_s * tl.exp2(-((o_t % per_byte) * BITS).to(tl.float32)).to(tl.float16)[None, :, None]
        b_s = tl.reshape(tl.broadcast_to(b_s[:, :, :, None], shape), (BLOCK_N, BLOCK_D))
        b_z = tl.reshape(tl.broadcast_to(b_z[:, :, :, None], shape), (BLOCK_N, BLOCK_D))
    return codes * b_s + b_z


@triton.jit
def _program(q_offsets, NUM_SPLITS):
    """A paged attention program's (sequence, query tile, KV head, split) and its sequence's query rows
    q_offsets[b] .. q_offsets[b + 1] - 1: (i_b, i_m, i_h, i_s, q_lo, q_hi)."""
    i_b, i_m, i_hs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_lo, q_hi = tl.load(q_offsets + i_b), tl.load(q_offsets + i_b + 1)
    return i_b, i_m, i_hs // NUM_SPLITS, i_hs % NUM_SPLITS, q_lo, q_hi


@triton.jit
def _tile_rows(i_m, i_h, q_lo, q_hi, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query tile i_m's rows, row r being token q_lo + r // GROUP and query head i_h * GROUP + r % GROUP: (tokens,
    query heads, the rows inside q_lo .. q_hi - 1)."""
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_t = q_lo + o_m // GROUP
    return o_t, i_h * GROUP + o_m % GROUP, o_t < q_hi


@triton.jit
def _rows_and_keys(q_pos, kv_start, kv_lens, i_b, i_m, i_h, i_s, q_lo, q_hi, NUM_SPLITS, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's rows (_tile_rows) and this split's key range, cut at the last key any row may see: (o_t, o_hq,
    m_m, positions, kv_lo, lo, hi)."""
    o_t, o_hq, m_m = _tile_rows(i_m, i_h, q_lo, q_hi, GROUP, BLOCK_M)
    b_pos = tl.load(q_pos + o_t, mask=m_m, other=0).to(tl.int32)
    kv_lo, n_keys = tl.load(kv_start + i_b), tl.load(kv_lens + i_b)
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * per_split
    hi = tl.minimum(tl.minimum(n_keys, lo + per_split), tl.max(b_pos) - kv_lo + 1)
    return o_t, o_hq, m_m, b_pos, kv_lo, lo, hi


# Window keys a decode tile scores at a time (KeyWindow; a window is at most a page of the pool): the MMA's
# smallest K for p @ v, which leaves the pool loop's compile as it was (paged_attention_fwd_kernel's docstring).
WINDOW_BLOCK = 16


@triton.jit
def _window_split(q, q_pos, o, lse, w_table, w_start, w_lens, w_k, w_v, sm_scale, i_s, i_m, q_lo, q_hi, i_h, stride_qt,
                  stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_wt, stride_wks, stride_wkh,
                  stride_wvs, stride_wvh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Split i_s of decode tile i_m (token q_lo's query heads of KV head i_h): its rows over the token's window keys
    (KeyWindow: those at positions up to its own), in the model dtype's MMA as the pool's tiles, stored as
    _store_part stores a split."""
    # (one token: rows past its GROUP heads are masked)
    o_t, o_hq, m_m = _tile_rows(i_m, i_h, q_lo, q_hi, GROUP, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    t = q_lo.to(tl.int64)
    b_q = tl.load(q + t * stride_qt + o_hq[:, None] * stride_qh + o_d[None, :], mask=m_m[:, None] & m_d[None, :],
                  other=0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    first = tl.load(w_start + t)
    seen = tl.minimum(tl.load(w_lens + t), tl.load(q_pos + t).to(tl.int32) - first + 1)
    qk_scale = sm_scale * 1.4426950408889634
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(0, seen, BLOCK_W):
        o_j = j0 + tl.arange(0, BLOCK_W)
        m_j = o_j < seen
        slots = tl.load(w_table + t * stride_wt + o_j, mask=m_j, other=0).to(tl.int64)
        m_tile = m_j[:, None] & m_d[None, :]
        b_k = tl.load(w_k + slots[:, None] * stride_wks + i_h * stride_wkh + o_d[None, :], mask=m_tile, other=0)
        b_s = tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        b_s = tl.where(m_j[None, :], b_s, float("-inf"))
        # Every tile holds a visible key (j0 < seen), so m_new is finite.
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_p = tl.exp2(b_s - m_new[:, None])
        alpha = tl.exp2(b_m - m_new)
        b_v = tl.load(w_v + slots[:, None] * stride_wvs + i_h * stride_wvh + o_d[None, :], mask=m_tile, other=0)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype), input_precision=DOT_PRECISION)
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_m = m_new
    _store_part(o, lse, i_s, o_t, o_hq, m_m, o_d, m_d, b_acc, b_l, b_m, stride_os, stride_ot, stride_oh, stride_ls,
                stride_lt)


@triton.jit
def _store_part(o, lse, i_s, o_t, o_hq, m_m, o_d, m_d, b_acc, b_l, b_m, stride_os, stride_ot, stride_oh, stride_ls,
                stride_lt):
    """Split i_s's normalised output and lse (natural log) of the tile's rows from the online softmax's acc, l and
    m (log2 units); 0 and -inf for a row that saw no key."""
    seen = b_l > 0
    b_o = tl.where(seen[:, None], b_acc / tl.where(seen, b_l, 1.0)[:, None], 0.0)
    b_lse = tl.where(seen, (b_m + tl.log2(tl.where(seen, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    p_o = o + i_s * stride_os + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    tl.store(lse + i_s * stride_ls + o_t.to(tl.int64) * stride_lt + o_hq, b_lse, mask=m_m)


# Integer arguments that follow the pass's shape are no specialisation keys: Triton would compile a variant for 1,
# for multiples of 16 and for the rest of each, and serving would meet the ones the warm-up did not (a 30-token
# prompt alone compiled one while serving). NUM_SPLITS follows the batch; stride_table is the widest sequence's
# page (or slot) count; stride_ls is the pass's tokens times the query heads.
UNSPECIALISED = ["NUM_SPLITS", "stride_table", "stride_ls"]


# stride_wt is a window table's width (a page, or any width off the engine).
@triton.jit(do_not_specialize=UNSPECIALISED + ["stride_wt"])
def paged_attention_fwd_kernel(
    q, o, lse, q_pos, q_offsets, kv_table, kv_start, kv_lens,
    k, v, k_scale, k_zero, v_scale, v_zero, sm_scale, prev_o, prev_lse,
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_table,
    stride_pt, stride_ph, stride_plt,
    stride_kp, stride_kr, stride_kh, stride_ksp, stride_ksh, stride_vsp, stride_vsh, magic_exponent,
    w_table, w_start, w_lens, w_k, w_v, stride_wt, stride_wks, stride_wkh, stride_wvs, stride_wvh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    NUM_SPLITS, BLOCK_N: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
    PAGE: tl.constexpr, GROUP_D: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROUND_TILES: tl.constexpr, PAGE_TILE: tl.constexpr,
    CONTINUE: tl.constexpr, PDL: tl.constexpr, MASK_SPLIT: tl.constexpr = False, LAZY_RESCALE: tl.constexpr = False,
    MAGIC_IN_REGISTER: tl.constexpr = False, LOAD_PER_TOKEN: tl.constexpr = False, HALF_TILES: tl.constexpr = 0,
    WINDOW: tl.constexpr = 0, BLOCK_W: tl.constexpr = WINDOW_BLOCK,
):
    """Program (sequence, query tile, KV head x split): the tile's rows over the split's share of the sequence's
    pool keys. WINDOW (decode launches with a KeyWindow, w_*): each (sequence, KV head) has one program more, split
    NUM_SPLITS, which attends the window keys instead (_window_split) and stores them as one more split for the
    merge. Before, the merge attended them itself, one program a row with its loads in sequence: 12 us a launch at
    batch 1 against 3.7 for the plain merge (H200, session 20's profile_decode_int2). The window's branch comes
    before the pool's setup and its tiles are 16 keys: so placed and sized, the pool loop compiles as without it
    (sm_90, Triton 3.6: 1,307 instructions and 191 registers against 1,304 and 186; after the loop, or with 32-key
    tiles, ptxas gave the loop 168 registers and 1,367-1,389 instructions, and an H100 ran batch 8 over 32K keys 1%
    slower; bench/results/session20/window_split_sass_triton36.json)."""
    pdl_enter(PDL)
    # KIVI's int-to-float magic (_load_kivi_pages): folded into immediates, or magic_exponent's register.
    magic = MAGIC_EXPONENT
    if MAGIC_IN_REGISTER:
        magic = magic_exponent
    i_b, i_m, i_h, i_s, q_lo, q_hi = _program(q_offsets, NUM_SPLITS + WINDOW)
    if i_m * BLOCK_M >= (q_hi - q_lo) * GROUP:
        return
    if WINDOW:
        if i_s == NUM_SPLITS:
            _window_split(q, q_pos, o, lse, w_table, w_start, w_lens, w_k, w_v, sm_scale, i_s, i_m, q_lo, q_hi, i_h,
                          stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_wt,
                          stride_wks, stride_wkh, stride_wvs, stride_wvh, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_W,
                          DOT_FP32, DOT_PRECISION)
            return
    o_t, o_hq, m_m, b_pos, kv_lo, lo, hi = _rows_and_keys(q_pos, kv_start, kv_lens, i_b, i_m, i_h, i_s, q_lo, q_hi,
                                                         NUM_SPLITS, GROUP, BLOCK_M, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_q = q + o_t[:, None].to(tl.int64) * stride_qt + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    elif HALF_TILES:
        # fp16 for the MMA with fp16 tiles, the softmax scale folded in first: fp16's range (65,504) then bounds
        # q * scale (q / 16 at head_dim 256), not q.
        b_q = (b_q.to(tl.float32) * sm_scale).to(tl.float16)
    if CONTINUE:
        # Resume the online softmax of an earlier key range (its normalised output and lse): m = lse in log2
        # units and l = 1 reproduce its state exactly, so no merge pass is needed. prev may be o itself: each
        # row is read before this program writes it, and no other program touches it (one split).
        p_prev = prev_o + o_t[:, None].to(tl.int64) * stride_pt + o_hq[:, None] * stride_ph + o_d[None, :]
        b_prev = tl.load(prev_lse + o_t.to(tl.int64) * stride_plt + o_hq, mask=m_m, other=float("-inf"))
        had = b_prev > float("-inf")
        b_m = tl.where(had, b_prev * 1.4426950408889634, float("-inf"))
        b_l = tl.where(had, 1.0, 0.0)
        b_acc = tl.load(p_prev, mask=had[:, None] & m_d[None, :], other=0).to(tl.float32)
    else:
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if HALF_TILES and not DOT_FP32:
        qk_scale = 1.4426950408889634  # (q carries sm_scale already)
    if MASK_SPLIT:
        # Keys every row of the tile sees: a tile wholly below this bound skips the causal and range masks.
        first_pos = tl.min(tl.where(m_m, b_pos, 2147483647))
        seen_by_all = tl.minimum(hi, first_pos - kv_lo + 1)
    for j0 in range(lo, hi, BLOCK_N):
        o_j = j0 + tl.arange(0, BLOCK_N)
        m_j = o_j < hi
        if PAGE_TILE:
            # Tiles are page-aligned (splits are whole tiles), so this tile is BLOCK_N // PAGE whole pages, all
            # closed; keys past hi inside them are real data, masked out of the scores below.
            NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
            o_pg = j0 // PAGE + tl.arange(0, NUM_PAGES)
            m_pg = o_pg * PAGE < hi
            pages = tl.load(kv_table + i_b.to(tl.int64) * stride_table + o_pg, mask=m_pg, other=0).to(tl.int64)
            b_k = _load_kivi_pages(k + i_h * stride_kh, k_scale + i_h * stride_ksh, k_zero + i_h * stride_ksh, pages,
                                   m_pg, o_d, m_d, stride_kp, stride_kr, stride_ksp, BITS, PAGE, True, GROUP_D, NUM_PAGES,
                                   BLOCK_D, HEAD_DIM, 0, magic, LOAD_PER_TOKEN, HALF_TILES)
        else:
            page = tl.load(kv_table + i_b.to(tl.int64) * stride_table + o_j // PAGE, mask=m_j, other=0).to(tl.int64)
            row = o_j % PAGE
            m_tile = m_j[:, None] & m_d[None, :]
            b_k = _load_tile(k, k_scale, k_zero, page, row, i_h, o_d, m_j, m_tile, stride_kp, stride_kr, stride_kh,
                             stride_ksp, stride_ksh, KIND, BITS, PAGE, True, GROUP_D)
        if ROUND_TILES and not HALF_TILES:
            # Round to the model dtype, as a dense dequantized prefix would be.
            b_k = b_k.to(q.dtype.element_ty)
        b_s = tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if MASK_SPLIT:
            if j0 + BLOCK_N > seen_by_all:
                visible = ((kv_lo + o_j)[None, :] <= b_pos[:, None]) & m_j[None, :]
                b_s = tl.where(visible, b_s, float("-inf"))
        else:
            visible = ((kv_lo + o_j)[None, :] <= b_pos[:, None]) & m_j[None, :]
            b_s = tl.where(visible, b_s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        if LAZY_RESCALE:
            # Rescale the accumulator (BLOCK_D multiplies a row, against BLOCK_N for the scores) only when some
            # row's maximum grew by more than RESCALE_LOG2; otherwise keep the stale maximum, under which this
            # tile's p stays at most 2^RESCALE_LOG2 (the final division and lse undo any reference point exactly).
            grow = tl.max(tl.where(m_new > b_m, m_new - b_m, 0.0), 0)
            if grow > RESCALE_LOG2:
                alpha = tl.exp2(b_m - tl.where(m_new == float("-inf"), 0.0, m_new))
                b_acc = b_acc * alpha[:, None]
                b_l = b_l * alpha
                b_m = m_new
            m_new = b_m
        # Rows that have seen no key yet keep m = -inf; subtract 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.exp2(b_s - m_safe[:, None])
        if not LAZY_RESCALE:
            alpha = tl.exp2(b_m - m_safe)
        if PAGE_TILE:
            b_v = _load_kivi_pages(v + i_h * stride_kh, v_scale + i_h * stride_vsh, v_zero + i_h * stride_vsh, pages,
                                   m_pg, o_d, m_d, stride_kp, stride_kr, stride_vsp, BITS, PAGE, False, GROUP_D, NUM_PAGES,
                                   BLOCK_D, HEAD_DIM, 0, magic, LOAD_PER_TOKEN, HALF_TILES)
        else:
            b_v = _load_tile(v, v_scale, v_zero, page, row, i_h, o_d, m_j, m_tile, stride_kp, stride_kr, stride_kh,
                             stride_vsp, stride_vsh, KIND, BITS, PAGE, False, GROUP_D)
        if ROUND_TILES and not HALF_TILES:
            b_v = b_v.to(q.dtype.element_ty)
        if LAZY_RESCALE:
            b_acc = tl.dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype), b_acc, input_precision=DOT_PRECISION)
            b_l = b_l + tl.sum(b_p, 1)
        else:
            b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype), input_precision=DOT_PRECISION)
            b_l = b_l * alpha + tl.sum(b_p, 1)
        b_m = m_new
    _store_part(o, lse, i_s, o_t, o_hq, m_m, o_d, m_d, b_acc, b_l, b_m, stride_os, stride_ot, stride_oh, stride_ls,
                stride_lt)


def paged_attention_fwd(
    q: torch.Tensor, q_positions: torch.Tensor, q_offsets: torch.Tensor, kv_table: torch.Tensor,
    kv_start: torch.Tensor, kv_lens: torch.Tensor, kv: PagedKV, scale: float, max_q_len: int, num_splits: int,
    out: torch.Tensor, out_lse: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: KeyWindow | None = None, gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    if prev is not None and num_splits != 1:
        raise ValueError(f"continuing an earlier key range (prev) takes one split, got num_splits={num_splits}")
    group = num_q_heads // kv.num_kv_heads
    block_m = _block_m(max_q_len * group)
    extend = block_m > 16
    num_warps = 4 if head_dim <= 64 else 8
    # A window takes one program more a KV head (split num_splits; paged_attention_fwd_kernel's WINDOW).
    grid_splits = num_splits + (window is not None)
    programs = kv_table.shape[0] * triton.cdiv(max_q_len * group, block_m) * kv.num_kv_heads * grid_splits
    if extend:
        # H200 tile sweeps (bench/results/session5/call1, an 8,192-query chunk over 32K keys, head_dim 256):
        # 128 x 64 tiles, 3 stages for bf16 (351 TFLOP/s, 1.24x 2 stages); KIVI whole-page tiles of 64 keys
        # (two pages), 2 stages (208 TFLOP/s; 32 keys 176, the per-element gather 42).
        block_n, num_stages = 64, (2 if kv.kind == "kivi" else 3)
    else:
        # Decode (32K keys): bf16 64 keys, 3 stages; KIVI whole-page tiles of 64 keys, 2 stages, and 8 warps
        # when the launch is one wave or less but 4 when it is more (batch 8: 0.39 ms vs 0.60 with 8); batch 1
        # now splits into two waves (_MAX_SPLITS_KIVI) and takes 4.
        block_n, num_stages = 64, (2 if kv.kind == "kivi" else 3)
        if kv.kind == "kivi":
            num_warps = 8 if programs <= _TARGET_PROGRAMS // 2 else 4
    tuning = EXTEND_TUNING if extend else DECODE_TUNING
    defaults = EXTEND_DEFAULTS if extend else DECODE_DEFAULTS

    def flag(name: str) -> bool:
        return bool(tuning.get(name, defaults.get(name, 0)))

    # KIVI tiles of whole pages (_load_kivi_pages) unless a sweep turns them off (`page_tile: 0`).
    page_tile = bool(tuning.get("page_tile", 1))
    if tuning:
        block_m, block_n = tuning.get("block_m", block_m), tuning.get("block_n", block_n)
        num_warps, num_stages = tuning.get("num_warps", num_warps), tuning.get("num_stages", num_stages)
    block_d = triton.next_power_of_2(max(head_dim, 16))
    is_kivi = kv.kind == "kivi"
    # Value scales broadcast over a channel group by reshape (the group must tile BLOCK_D); key ranges start at
    # page-aligned offsets (splits are whole tiles), so a tile of PAGE * n keys is n pages.
    page_tile = page_tile and is_kivi and blockwise_supported(head_dim, kv.page_tokens, kv.value_group) \
        and block_n % kv.page_tokens == 0
    # Off the GPU (the Triton interpreter) dots run in fp32 and tiles skip the model-dtype rounding:
    # the interpreter's bf16 dot is wrong and its fp32 -> bf16 cast truncates.
    if grid_splits == 1:
        splits_out, lse = out[None], out_lse[None]
    else:
        # Flash-decoding workspace: O(splits x queries), independent of the key count.
        splits_out = q.new_empty((grid_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32)
        lse = q.new_empty((grid_splits, num_tokens, num_q_heads), dtype=torch.float32)
    k_scale = kv.k_scale if kv.k_scale is not None else kv.k
    v_scale = kv.v_scale if kv.v_scale is not None else kv.v
    k_zero = kv.k_zero if kv.k_zero is not None else k_scale
    v_zero = kv.v_zero if kv.v_zero is not None else v_scale
    # Without a range to continue the kernel never reads prev: hand it out_lse (fp32 whatever out is), so that the
    # pointer's type, part of the specialisation key, does not follow out's dtype into another variant.
    prev_o, prev_lse = prev if prev is not None else (out_lse, out_lse)
    dot_fp32 = q.dtype == torch.float32 or not q.is_cuda
    num_seqs = kv_table.shape[0]
    grid = (num_seqs, triton.cdiv(max_q_len * group, block_m), kv.num_kv_heads * grid_splits)
    # A decode sweep's d_chunks: the head in chunks (kernels/kivi_decode.py; whole-page KIVI tiles, no prev, no
    # window: its sweep times the pool's splits alone).
    chunks = 0 if extend or window is not None else tuning.get("d_chunks", 0)
    if chunks and page_tile and prev is None:
        from headroom.kernels.kivi_decode import kivi_decode

        kivi_decode(q, splits_out, lse, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale, grid,
                    block_m, block_n, chunks, num_warps, num_stages, bool(tuning.get("magic_register", 0)),
                    tuning.get("max_registers"))
    else:
        paged_attention_fwd_kernel[grid](
            q, splits_out, lse, q_positions, q_offsets, kv_table, kv_start, kv_lens,
            kv.k.view(torch.uint8) if kv.kind == "fp8" else kv.k, kv.v.view(torch.uint8) if kv.kind == "fp8" else kv.v,
            k_scale, k_zero, v_scale, v_zero, scale, prev_o, prev_lse,
            q.stride(0), q.stride(1), splits_out.stride(0), splits_out.stride(1), splits_out.stride(2),
            lse.stride(0), lse.stride(1), kv_table.stride(0), prev_o.stride(0), prev_o.stride(1), prev_lse.stride(0),
            kv.k.stride(0), kv.k.stride(1) if is_kivi else 0, kv.k.stride(-2),
            k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), MAGIC_EXPONENT.value,
            *_window_arguments(window, out_lse),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
            NUM_SPLITS=num_splits, BLOCK_N=block_n, KIND=_KIND_CODE[kv.kind], BITS=kv.bits, PAGE=kv.page_tokens,
            GROUP_D=max(kv.value_group, 1), DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32",
            ROUND_TILES=q.is_cuda, PAGE_TILE=page_tile, CONTINUE=prev is not None,
            MASK_SPLIT=flag("mask_split"), LAZY_RESCALE=flag("lazy_rescale"), MAGIC_IN_REGISTER=flag("magic_register"),
            LOAD_PER_TOKEN=flag("load_per_token"),
            HALF_TILES=(2 if q.is_cuda else 1) if flag("half_tiles") and page_tile else 0,
            WINDOW=int(window is not None), num_warps=num_warps, num_stages=num_stages,
            # A sweep's register cap (max_registers: ptxas' maxnreg), for a variant that fits one more program a
            # multiprocessor under it (half_tiles' decode loop: 186 registers, 168 under a cap of 168, no spills).
            **({"maxnreg": tuning["max_registers"]} if tuning.get("max_registers") else {}),
            **pdl_launch(q.device),
        )
    if grid_splits > 1:
        merge_splits_into(splits_out, lse, out, out_lse, gate)
    elif gate is not None:
        out.copy_(sigmoid_mul(out.reshape(num_tokens, -1), gate).view(out.shape))
    return out, out_lse


def _window_arguments(window: KeyWindow | None, placeholder: torch.Tensor) -> tuple:
    """paged_attention_fwd_kernel's w_table, w_start, w_lens, w_k, w_v and their strides (placeholder and zeros
    without a window: never read)."""
    if window is None:
        return (placeholder,) * 5 + (0,) * 5
    wk, wv = window.kv.k, window.kv.v
    return (window.table, window.start, window.lens, wk, wv, window.table.stride(0), wk.stride(0), wk.stride(1),
            wv.stride(0), wv.stride(1))


def _check(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv: PagedKV) -> None:
    if q.dim() != 3 or q.shape[-1] != kv.head_dim or q.shape[1] % kv.num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} must be [N, Hq, D] with D={kv.head_dim} and Hq a multiple of Hkv={kv.num_kv_heads}"
        )
    if q_positions.shape != (q.shape[0],):
        raise ValueError(f"q_positions {tuple(q_positions.shape)} must be [N={q.shape[0]}]")
    num_seqs = kv_table.shape[0]
    if q_offsets.shape != (num_seqs + 1,) or kv_start.shape != (num_seqs,) or kv_lens.shape != (num_seqs,):
        raise ValueError(
            f"for {num_seqs} sequences (kv_table rows) q_offsets must be [{num_seqs + 1}] (got {tuple(q_offsets.shape)}), "
            f"kv_start and kv_lens [{num_seqs}] (got {tuple(kv_start.shape)}, {tuple(kv_lens.shape)})"
        )
    for name, t in (("q_offsets", q_offsets), ("kv_table", kv_table), ("kv_start", kv_start), ("kv_lens", kv_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if kv_table.stride(-1) != 1 or q.stride(-1) != 1 or kv.k.stride(-1) != 1:
        raise ValueError("q, kv_table and the pool tensors need a contiguous last dimension")


def default_num_splits(num_seqs: int, max_q_len: int, group: int, num_kv_heads: int, kivi: bool = False) -> int:
    """Programs per key range: enough for _TARGET_PROGRAMS in all, at most _MAX_SPLITS (_MAX_SPLITS_KIVI over a KIVI
    pool), a power of two (the merge kernel's tile, BLOCK_S, then takes a few values, all met by the warm-up)."""
    tiles = num_seqs * math.ceil(max_q_len * group / _block_m(max_q_len * group)) * num_kv_heads
    most = _MAX_SPLITS_KIVI if kivi else _MAX_SPLITS
    return 1 << (max(1, min(most, _TARGET_PROGRAMS // tiles)).bit_length() - 1)


def paged_attention(
    q: torch.Tensor, q_positions: torch.Tensor, q_offsets: torch.Tensor, kv_table: torch.Tensor,
    kv_start: torch.Tensor, kv_lens: torch.Tensor, kv: PagedKV, scale: float,
    max_q_len: int | None = None, num_splits: int | None = None,
    out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
    prev: tuple[torch.Tensor, torch.Tensor] | None = None, window: KeyWindow | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of B sequences' query chunks over keys read from the paged pool.

    q [N, Hq, D]; q_positions [N] absolute positions; q_offsets [B+1] int32: sequence b owns rows
    q_offsets[b]..q_offsets[b+1]-1. kv_table [B, max_pages] int32 pages (slots when page_tokens is 1);
    sequence b's keys are j = 0..kv_lens[b]-1 at absolute positions kv_start[b] + j, in page kv_table[b, j // P]
    (KIVI: whole pages, as the engine's closed pages are; a tile reads every row of the pages it touches).
    A query at position p sees keys at positions <= p. Returns (out [N, Hq, D] in q's dtype, lse [N, Hq] fp32,
    natural log; -inf and out 0 where a row sees no key). max_q_len: longest chunk (read from q_offsets if None);
    num_splits: programs per key range (chosen from the tile count if None); out, out_lse: where to write (out
    may be fp32 for a range to be continued). prev: (out, lse) of the same rows over an earlier, disjoint key
    range: the result is then attention over both (as merge_two would give), in one split; out may be prev's.
    window: keys outside the pool (a KIVI pool's residual windows, KeyWindow), attended as one more split of the
    launch, for decode launches (one query row a sequence, no prev): the result is attention over both ranges.
    gate [N, Hq, D] (Qwen3.5's attention output gate, no prev, out in q's dtype): out comes back times
    sigmoid(gate), by the split merge where the launch splits (no launch of its own), else by sigmoid_mul; lse
    is never gated.
    """
    _check(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv)
    if gate is not None and (gate.shape != q.shape or gate.stride(-1) != 1 or prev is not None
                             or (out is not None and out.dtype != q.dtype)):
        raise ValueError(f"gate {tuple(gate.shape)} must be {tuple(q.shape)} with a contiguous last dimension, for a "
                         "launch without prev writing q's dtype")
    if max_q_len is None:
        max_q_len = int((q_offsets[1:] - q_offsets[:-1]).max().item()) if kv_table.shape[0] else 0
    if window is not None:
        window.check(q, kv.num_kv_heads)
        if q.shape[0]:
            window.require_decode(q.shape[0], kv_table.shape[0], max_q_len, prev is not None)
    out = torch.empty_like(q) if out is None else out
    out_lse = q.new_empty(q.shape[:2], dtype=torch.float32) if out_lse is None else out_lse
    if out.shape != q.shape or out.stride(-1) != 1 or out_lse.shape != q.shape[:2] or out_lse.dtype != torch.float32:
        raise ValueError(f"out {tuple(out.shape)} must be {tuple(q.shape)}; out_lse {tuple(out_lse.shape)} fp32 {tuple(q.shape[:2])}")
    if prev is not None and (prev[0].shape != q.shape or prev[1].shape != q.shape[:2] or prev[0].stride(-1) != 1
                             or prev[1].dtype != torch.float32 or prev[1].stride(-1) != 1):
        raise ValueError(f"prev out {tuple(prev[0].shape)} and lse {tuple(prev[1].shape)} ({prev[1].dtype}) must be "
                         f"{tuple(q.shape)} and fp32 {tuple(q.shape[:2])}, last dimensions contiguous")
    if q.shape[0] == 0 or max_q_len == 0:
        if prev is not None:
            # No key in this range: the earlier range's answer stands.
            return out.copy_(prev[0]), out_lse.copy_(prev[1])
        # (gated or not, a row that sees no key is 0)
        return out.zero_(), out_lse.fill_(float("-inf"))
    if num_splits is None:
        group = q.shape[1] // kv.num_kv_heads
        num_splits = 1 if prev is not None else default_num_splits(
            kv_table.shape[0], max_q_len, group, kv.num_kv_heads, kv.kind == "kivi")
        if prev is None and _block_m(max_q_len * group) <= 16:
            # A decode sweep's splits_x: more programs, for a variant that fits more of them a multiprocessor.
            num_splits *= DECODE_TUNING.get("splits_x", 1)
    return paged_attention_fwd(
        q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale, max_q_len, num_splits, out, out_lse, prev,
        window, gate,
    )


# Block offsets and sizes follow the batch (the workspace is shared by its long chunks), the table's width the
# longest sequence: no specialisation keys.
@triton.jit(do_not_specialize=["first_page", "block_tokens", "stride_table"])
def kivi_dequantize_block_kernel(
    k, v, k_scale, k_zero, v_scale, v_zero, kv_table, block_lens, ws_rows, k_ws, v_ws, first_page, block_tokens,
    stride_table, stride_kp, stride_kr, stride_kh, stride_ksp, stride_ksh, stride_vsp, stride_vsh, stride_wt, stride_wh,
    BITS: tl.constexpr, PAGE: tl.constexpr, GROUP_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """One page of one sequence and KV head: keys and values dequantized into the dense workspace."""
    i_b, i_pg, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_pg * PAGE >= tl.load(block_lens + i_b):
        return
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    pages = tl.load(kv_table + i_b.to(tl.int64) * stride_table + first_page + i_pg + tl.arange(0, 1)).to(tl.int64)
    m_pages = tl.full([1], 1, tl.int1)
    b_k = _load_kivi_pages(k + i_h * stride_kh, k_scale + i_h * stride_ksh, k_zero + i_h * stride_ksh, pages, m_pages,
                           o_d, m_d, stride_kp, stride_kr, stride_ksp, BITS, PAGE, True, GROUP_D, 1, BLOCK_D, HEAD_DIM, 0, MAGIC_EXPONENT)
    b_v = _load_kivi_pages(v + i_h * stride_kh, v_scale + i_h * stride_vsh, v_zero + i_h * stride_vsh, pages, m_pages,
                           o_d, m_d, stride_kp, stride_kr, stride_vsp, BITS, PAGE, False, GROUP_D, 1, BLOCK_D, HEAD_DIM, 0, MAGIC_EXPONENT)
    dst = tl.load(ws_rows + i_b).to(tl.int64) * block_tokens + i_pg * PAGE + tl.arange(0, PAGE)
    p_w = dst[:, None] * stride_wt + i_h * stride_wh + o_d[None, :]
    tl.store(k_ws + p_w, b_k.to(k_ws.dtype.element_ty), mask=m_d[None, :])
    tl.store(v_ws + p_w, b_v.to(v_ws.dtype.element_ty), mask=m_d[None, :])


def dequantize_block(
    kv: PagedKV, kv_table: torch.Tensor, block_lens: torch.Tensor, ws_rows: torch.Tensor, first_key: int,
    block_tokens: int, k_ws: torch.Tensor, v_ws: torch.Tensor,
) -> None:
    """Sequence b's KIVI keys first_key .. first_key + block_lens[b] - 1 (whole pages; first_key and block_tokens
    multiples of the page), dequantized into workspace slots ws_rows[b] * block_tokens + j of k_ws, v_ws [slots, H, D]
    (as naive_dequantize_block; block_lens, ws_rows int32 [B])."""
    page = kv.page_tokens
    if kv.kind != "kivi" or not blockwise_supported(kv.head_dim, page, kv.value_group) or first_key % page \
            or block_tokens % page:
        raise ValueError(f"dequantize_block: a KIVI pool whose pages and value groups tile ({kv.kind}, page {page}, "
                         f"head_dim {kv.head_dim}, value group {kv.value_group}), and first_key {first_key} and "
                         f"block_tokens {block_tokens} multiples of the page")
    block_d = triton.next_power_of_2(max(kv.head_dim, 16))
    assert kv.k_scale is not None and kv.k_zero is not None and kv.v_scale is not None and kv.v_zero is not None
    grid = (kv_table.shape[0], block_tokens // page, kv.num_kv_heads)
    kivi_dequantize_block_kernel[grid](
        kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, kv_table, block_lens, ws_rows, k_ws, v_ws,
        first_key // page, block_tokens, kv_table.stride(0), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2),
        kv.k_scale.stride(0), kv.k_scale.stride(1), kv.v_scale.stride(0), kv.v_scale.stride(1),
        k_ws.stride(0), k_ws.stride(1),
        BITS=kv.bits, PAGE=page, GROUP_D=kv.value_group, BLOCK_D=block_d, HEAD_DIM=kv.head_dim,
    )
