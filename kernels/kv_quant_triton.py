"""Quantize-on-write straight into the paged KV pool: fp8 per token per head, KIVI pages (int8/int4/int2).

Same arithmetic as kernels/kv_quant.py (round half to even, fp16 scale and zero point rounded before use), so
codes and scales are bit-identical to the naive path (naive_fp8_quantize_into / naive_kivi_quantize_pages in
kernels/paged_kv.py) on the same device: on CUDA torch divides by a Python
number as a multiplication by its fp32 reciprocal (IEEE division on the CPU), and the kernels follow; packing is pack_codes' layout
(token i of a page in byte i // (8 / bits), bits * (i % (8 / bits)) up). One program per token (fp8) or per
page, head and tensor (KIVI: keys and values in one launch); nothing but the pool is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.kv_quant import FP8_MAX
from headroom.kernels.paged_kv import PageClose, PagedKV


@triton.jit
def _round_half_even(x):
    """Round fp32 to the nearest integer, ties to even (torch.round), exactly: x - floor(x) is exact in fp32."""
    b_floor = tl.floor(x)
    frac = x - b_floor
    is_odd = (b_floor - 2.0 * tl.floor(b_floor * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & is_odd), b_floor + 1.0, b_floor)


@triton.jit
def _fp8_e4m3_bits(y):
    """|y| <= 448 fp32 -> e4m3fn bit pattern (int32), round to nearest even, the sign kept (also of -0)."""
    a = tl.abs(y)
    a_bits = a.to(tl.int32, bitcast=True)
    # Normal range: round the 23-bit mantissa to 3 bits (carry may bump the exponent), rebias 127 -> 7.
    r = a_bits + 0x7FFFF + ((a_bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormals step by 2**-9; a code of 8 is exactly the smallest normal, 2**-6.
    subnormal = _round_half_even(a * 512.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(a < 0.015625, subnormal, normal) | (sign << 7)


@triton.jit
def fp8_quantize_fwd_kernel(
    x, slots, codes, scales, inv_max, stride_xt, stride_xh, stride_ct, stride_ch, stride_st,
    RECIPROCAL: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_h, o_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    m_x = (o_h < NUM_HEADS)[:, None] & (o_d < HEAD_DIM)[None, :]
    b_x = tl.load(x + i_t * stride_xt + o_h[:, None] * stride_xh + o_d[None, :], mask=m_x, other=0).to(tl.float32)
    b_amax = tl.maximum(tl.max(tl.abs(b_x), 1), 1e-12)
    if RECIPROCAL:
        b_scale = b_amax * inv_max
    else:
        b_scale = tl.math.div_rn(b_amax, 448.0)
    b_y = tl.minimum(tl.maximum(tl.math.div_rn(b_x, b_scale[:, None]), -448.0), 448.0)
    i_slot = tl.load(slots + i_t).to(tl.int64)
    tl.store(codes + i_slot * stride_ct + o_h[:, None] * stride_ch + o_d[None, :], _fp8_e4m3_bits(b_y).to(tl.uint8), mask=m_x)
    tl.store(scales + i_slot * stride_st + o_h, b_scale, mask=o_h < NUM_HEADS)


@triton.jit
def _scale_zero(low, high, inv_levels, LEVELS: tl.constexpr, RECIPROCAL: tl.constexpr):
    """fp32 minima and maxima -> (scale, zero point) fp16, as kv_quant's quantizers round them."""
    # Channels or groups that are all padding: 0 rather than inf - inf (they are never stored).
    low = tl.where(low == float("inf"), 0.0, low)
    high = tl.where(high == float("-inf"), 0.0, high)
    if RECIPROCAL:
        b_step = (high - low) * inv_levels
    else:
        b_step = tl.math.div_rn(high - low, LEVELS * 1.0)
    return tl.maximum(b_step, 1e-6).to(tl.float16), low.to(tl.float16)


@triton.jit
def _codes(b_x, b_scale, b_zero, LEVELS: tl.constexpr):
    """fp32 values -> int32 codes in [0, LEVELS] under fp16 scale and zero point (round half to even)."""
    codes = _round_half_even(tl.math.div_rn(b_x - b_zero.to(tl.float32), b_scale.to(tl.float32)))
    return tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0).to(tl.int32)


@triton.jit
def quantize_page(
    x, i_page, i_dst, packed, scale, zero, inv_levels, stride_xt, stride_xh, stride_pp, stride_pr, stride_ph,
    stride_sp, stride_sh, i_h, IS_KEY: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr,
    GROUP_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """Page i_page of x (tokens i_page * PAGE ..), head i_h, into pool page i_dst: packed codes, and the keys'
    scales per channel or the values' per token and channel group. kivi_quantize_fwd_kernel's programs run it, and
    so does a graphed decode step's page close (paged_kv.PageClose), one program a head and tensor of the launch
    that stores the page's last token (rotary_triton's qk_norm_rotary_store), x then the flat window.

    The page's packed bytes (channel by channel, byte b holding tokens b * PB .. b * PB + PB - 1) are cut into W
    bands of RW bytes, and the page is walked one token of every band at a time as a [W, G, C] tile (a warp a band,
    a thread the same channels of its band's tokens): a byte is packed, and the keys' minima and maxima over a band's
    tokens are taken, in a thread's registers, the values' over a channel group in its registers and a few lanes;
    only the keys' bands meet, once, in shared memory. (As one [R, PB, G, C] tile every channel's reductions crossed
    lanes and warps: about 4,400 sm_90 instructions a thread for one head's keys or values, and a page close in the
    decode step's store took 0.03 ms a head on the H100, session 21.)"""
    PB: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    R: tl.constexpr = PAGE // PB
    W: tl.constexpr = 4 if R >= 4 else R
    RW: tl.constexpr = R // W
    o_w = tl.arange(0, W)[:, None, None]
    o_g = tl.arange(0, BLOCK_G)[None, :, None]
    o_c = tl.arange(0, BLOCK_C)[None, None, :]
    o_d = o_g * GROUP_D + o_c
    m_c = (o_c < GROUP_D) & (o_d < HEAD_DIM)
    m_x = m_c & (o_w >= 0)
    p_x = x + i_h * stride_xh + o_d
    p_packed = packed + i_dst * stride_pp + i_h * stride_ph + o_d
    # Token (o_w * RW + r) * PB + i of the page is byte o_w * RW + r's i-th.
    first = i_page * PAGE + o_w * (RW * PB)
    if IS_KEY:
        low = tl.full([W, BLOCK_G, BLOCK_C], float("inf"), tl.float32)
        high = tl.full([W, BLOCK_G, BLOCK_C], float("-inf"), tl.float32)
        for j in tl.static_range(RW * PB):
            b_x = tl.load(p_x + (first + j).to(tl.int64) * stride_xt, mask=m_x, other=0).to(tl.float32)
            low = tl.minimum(low, tl.where(m_x, b_x, float("inf")))
            high = tl.maximum(high, tl.where(m_x, b_x, float("-inf")))
        # scale, zero [1, G, C]: one per channel.
        b_scale, b_zero = _scale_zero(tl.min(low, 0)[None, :, :], tl.max(high, 0)[None, :, :], inv_levels, LEVELS,
                                      RECIPROCAL)
        for r in tl.static_range(RW):
            byte = tl.zeros([W, BLOCK_G, BLOCK_C], tl.int32)
            for i in tl.static_range(PB):
                b_x = tl.load(p_x + (first + r * PB + i).to(tl.int64) * stride_xt, mask=m_x, other=0).to(tl.float32)
                byte = byte | (_codes(b_x, b_scale, b_zero, LEVELS) << (i * BITS))
            tl.store(p_packed + (o_w * RW + r) * stride_pr, byte.to(tl.uint8), mask=m_x)
        p_s = i_dst * stride_sp + i_h * stride_sh + o_d
        tl.store(scale + p_s, b_scale, mask=m_c)
        tl.store(zero + p_s, b_zero, mask=m_c)
    else:
        m_s = (o_g * GROUP_D < HEAD_DIM) & (o_w >= 0)
        for r in tl.static_range(RW):
            byte = tl.zeros([W, BLOCK_G, BLOCK_C], tl.int32)
            for i in tl.static_range(PB):
                b_x = tl.load(p_x + (first + r * PB + i).to(tl.int64) * stride_xt, mask=m_x, other=0).to(tl.float32)
                # scale, zero [W, G, 1]: one per token per channel group.
                b_scale, b_zero = _scale_zero(tl.min(tl.where(m_x, b_x, float("inf")), 2)[:, :, None],
                                              tl.max(tl.where(m_x, b_x, float("-inf")), 2)[:, :, None], inv_levels,
                                              LEVELS, RECIPROCAL)
                byte = byte | (_codes(b_x, b_scale, b_zero, LEVELS) << (i * BITS))
                p_s = (i_dst * PAGE + (o_w * RW + r) * PB + i) * stride_sp + i_h * stride_sh + o_g
                tl.store(scale + p_s, b_scale, mask=m_s)
                tl.store(zero + p_s, b_zero, mask=m_s)
            tl.store(p_packed + (o_w * RW + r) * stride_pr, byte.to(tl.uint8), mask=m_x)


@triton.jit
def kivi_quantize_fwd_kernel(
    k, v, pages, k_packed, v_packed, k_scale, k_zero, v_scale, v_zero, inv_levels,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_pp, stride_pr, stride_ph, stride_ksp, stride_ksh,
    stride_vsp, stride_vsh, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr, GROUP_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """Program (page, head, 0) quantizes the page's keys, (page, head, 1) its values: one launch for both."""
    i_page = tl.program_id(0)
    i_dst = tl.load(pages + i_page).to(tl.int64)
    if tl.program_id(2) == 0:
        quantize_page(k, i_page, i_dst, k_packed, k_scale, k_zero, inv_levels, stride_kt, stride_kh, stride_pp,
                       stride_pr, stride_ph, stride_ksp, stride_ksh, tl.program_id(1), True, HEAD_DIM, BITS, PAGE,
                       GROUP_D, BLOCK_G, BLOCK_C, RECIPROCAL)
    else:
        quantize_page(v, i_page, i_dst, v_packed, v_scale, v_zero, inv_levels, stride_vt, stride_vh, stride_pp,
                       stride_pr, stride_ph, stride_vsp, stride_vsh, tl.program_id(1), False, HEAD_DIM, BITS, PAGE,
                       GROUP_D, BLOCK_G, BLOCK_C, RECIPROCAL)


def page_close_arguments(close: PageClose | None, window: torch.Tensor, tokens: int, placeholder: torch.Tensor,
                         ) -> tuple[tuple, tuple, dict]:
    """For a launch of `tokens` tokens that closes pages of `window` (the flat window [rows x page, H, D] the step
    stored into; its strides are the caller's) as quantize_page closes it: (pointers: the close's rows and pages, the
    pool's tensors and inv_levels; the pool's strides; constexprs). Without a close: placeholder pointers and zero
    strides, never read, and no constexprs."""
    if close is None:
        return (placeholder,) * 8 + (0.0,), (0,) * 7, {}
    if close.rows.shape != (tokens,) or close.pages.shape != (tokens,):
        raise ValueError(f"page close for {tokens} tokens: rows {tuple(close.rows.shape)}, pages "
                         f"{tuple(close.pages.shape)}")
    if window.dim() != 3 or window.shape[1:] != close.kv.k.shape[2:]:
        raise ValueError(f"page close: a window of {tuple(window.shape)} into a KIVI pool of {tuple(close.kv.k.shape)}")
    tensors, strides, constants = _pool_arguments(close.kv, window.shape[-1], window.is_cuda)
    return (close.rows, close.pages) + tensors, strides, constants


def _pool_arguments(kv: PagedKV, head_dim: int, on_cuda: bool) -> tuple[tuple, tuple, dict]:
    """quantize_page's pool side for both tensors: (k and v codes, their scales and zeros, inv_levels; the codes'
    page, row and head strides and the scales' slot and head strides, keys' then values'; the constexprs)."""
    if kv.kind != "kivi":
        raise ValueError(f"KIVI write into a {kv.kind} pool")
    if kv.k.stride() != kv.v.stride():
        raise ValueError(f"KIVI write: key and value codes with different strides {kv.k.stride()}, {kv.v.stride()}")
    assert kv.k_scale is not None and kv.k_zero is not None and kv.v_scale is not None and kv.v_zero is not None
    tensors = (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, _fp32_reciprocal(2**kv.bits - 1))
    strides = (kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), kv.k_scale.stride(0), kv.k_scale.stride(1),
               kv.v_scale.stride(0), kv.v_scale.stride(1))
    constants = dict(HEAD_DIM=head_dim, BITS=kv.bits, PAGE=kv.page_tokens, GROUP_D=kv.value_group,
                     BLOCK_G=triton.next_power_of_2(-(-head_dim // kv.value_group)),
                     BLOCK_C=triton.next_power_of_2(kv.value_group), RECIPROCAL=on_cuda)
    return tensors, strides, constants


def _fp32_reciprocal(divisor: float) -> float:
    """1 / divisor rounded to fp32, as torch's CUDA division by a Python number computes it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / divisor)


def fp8_quantize_into(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """x [T, H, D] -> codes[slots] (float8_e4m3fn [S, H, D]) and scales[slots] (fp32 [S, H]); slots [T] ints."""
    if x.dim() != 3 or codes.shape[1:] != x.shape[1:] or scales.shape != codes.shape[:2] or slots.shape != x.shape[:1]:
        raise ValueError(f"fp8 write: x {tuple(x.shape)}, slots {tuple(slots.shape)} into codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)}")
    if x.stride(-1) != 1 or codes.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("fp8 write: x, codes and scales need a contiguous last dimension")
    if x.shape[0] == 0:
        return
    _, num_heads, head_dim = x.shape
    fp8_quantize_fwd_kernel[(x.shape[0],)](
        x, slots, codes.view(torch.uint8), scales, _fp32_reciprocal(FP8_MAX), x.stride(0), x.stride(1), codes.stride(0), codes.stride(1),
        scales.stride(0), RECIPROCAL=x.is_cuda, NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def kivi_quantize_pages(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, kv: PagedKV) -> None:
    """k, v [num_pages * P, H, D] (whole pages, in order) -> the pool's pages `pages` [num_pages] (codes and scales)."""
    page = kv.page_tokens
    if kv.kind != "kivi" or k.shape != v.shape or k.dim() != 3 or k.shape[1:] != kv.k.shape[2:]:
        raise ValueError(f"KIVI write: k {tuple(k.shape)}, v {tuple(v.shape)} into a {kv.kind} pool of {tuple(kv.k.shape)}")
    if k.shape[0] != pages.shape[0] * page:
        raise ValueError(f"KIVI write: {k.shape[0]} tokens are not {pages.shape[0]} whole pages of {page}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("KIVI write: k and v need a contiguous last dimension")
    if pages.shape[0] == 0:
        return
    tensors, strides, constants = _pool_arguments(kv, k.shape[-1], k.is_cuda)
    kivi_quantize_fwd_kernel[(pages.shape[0], k.shape[1], 2)](
        k, v, pages, *tensors, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides, **constants,
    )
