"""Prefill of the short causal conv1d (in front of Gated DeltaNet) for every sequence of a pass in one launch:
silu(depthwise conv) over each sequence's rows, the K-1 inputs before a sequence read from its carried state
in the SSM pool, and each sequence's new state (its last K-1 inputs) written to a separate [B, C, K-1] buffer,
since programs of the same sequence still read the old one. The reference is kernels/conv.py's
naive_causal_conv1d, per sequence. Replaces a per-sequence torch.cat + conv1d + silu + copy (about 30 ms of an
8,192-token pass of the 4B model on the H200).

causal_conv1d_varlen_qkv writes the output as three contiguous planes q | k | v instead of one [N, C] matrix,
and can L2-norm every q/k head in the epilogue: fla's chunked kernels copy a strided v whole (its input_guard,
~80 us a layer at 8K tokens on the H200), and the separate q/k L2 norm re-reads both."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_T rows, BLOCK_C channels, num_warps[, variant]) of a program; bench/prefill_gdn_kernels.py sweeps them on
# the GPU. A 4th element picks the kernel: "tile" (causal_conv1d_varlen_fwd_kernel, when absent) or "rows"
# (causal_conv1d_varlen_rows_kernel, each input row loaded once; KERNEL <= 4).
# H200, session 12 call 5 (bench/results/session12/call5/e/prefill_gdn_kernels.json, 8,192 x 8,192): rows 128 x 1024
# x 4 warps 0.089 ms, 64 x 1024 0.093, 32 x 512 0.094; the best tile config 0.177 (32 x 128 x 2, session 10's
# default: 255 registers, spilled). Rows against tile on the GPU: the unnormed output, v and the states bit-equal, the
# L2-normed q and k within 1 bf16 ulp (another order of the norm's sum), both 5-6 ulps from the fp32 reference.
TILE_CONFIG = (32, 128, 2)
DEFAULT_CONFIG = (128, 1024, 4, "rows")
VARIANTS = ("tile", "rows")


@triton.jit
def _window_input(x, states, row0, slot, p, o_c, m, stride_x, stride_ss, stride_sc, KERNEL: tl.constexpr):
    """Inputs at relative positions p [R] of one sequence (rows from row0 in x; p < 0 from its state) -> [R, C] fp32."""
    from_x = p >= 0
    b_x = tl.load(x + (row0 + p)[:, None].to(tl.int64) * stride_x + o_c[None, :], mask=m & from_x[:, None], other=0)
    b_s = tl.load(states + slot * stride_ss + o_c[None, :] * stride_sc + (KERNEL - 1 + p)[:, None],
                  mask=m & (~from_x)[:, None], other=0)
    return b_x.to(tl.float32) + b_s.to(tl.float32)


@triton.jit
def _store_new_state(x, states, new_states, row0, slot, length, i_b, o_c, m_c, stride_x, stride_ss, stride_sc,
                     stride_nb, stride_nc, KERNEL: tl.constexpr, BLOCK_S: tl.constexpr):
    """A sequence's last program: its new state is its last K-1 inputs (some still from the old state if the
    sequence is shorter than that), written to new_states[i_b] (programs of the same sequence still read the old)."""
    o_s = tl.arange(0, BLOCK_S)
    m_s = (o_s < KERNEL - 1)[:, None] & m_c[None, :]
    b_state = _window_input(x, states, row0, slot, length - (KERNEL - 1) + o_s, o_c, m_s, stride_x, stride_ss,
                            stride_sc, KERNEL)
    p_new = new_states + i_b * stride_nb + o_c[None, :] * stride_nc + o_s[:, None]
    tl.store(p_new, b_state.to(new_states.dtype.element_ty), mask=m_s)


@triton.jit
def causal_conv1d_varlen_fwd_kernel(
    x, weight, states, slots, offsets, out, new_states, stride_x, stride_wc, stride_ss, stride_sc, stride_nb,
    stride_nc, num_tokens, eps, CHANNELS: tl.constexpr, KEY_DIM: tl.constexpr, NORM_DIM: tl.constexpr,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Channel blocks fastest: the programs running together read whole rows of x, not one column strip.
    i_c, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(offsets + i_b).to(tl.int32)
    length = tl.load(offsets + i_b + 1).to(tl.int32) - row0
    t0 = i_t * BLOCK_T
    if t0 >= length:
        return
    slot = tl.load(slots + i_b).to(tl.int64)
    o_dt = tl.arange(0, BLOCK_T)
    o_t = t0 + o_dt
    c0 = i_c * BLOCK_C
    o_c = c0 + tl.arange(0, BLOCK_C)
    m_c = o_c < CHANNELS
    m = (o_t < length)[:, None] & m_c[None, :]
    b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if t0 >= KERNEL - 1:
        # Interior tile: every input is a row of x, at one pointer moved by whole rows.
        p_x = x + (row0 + t0).to(tl.int64) * stride_x + o_dt[:, None] * stride_x + o_c[None, :]
        for j in tl.static_range(KERNEL):
            b_w = tl.load(weight + o_c * stride_wc + j, mask=m_c, other=0).to(tl.float32)
            b_in = tl.load(p_x + (j - (KERNEL - 1)) * stride_x, mask=m, other=0).to(tl.float32)
            b_acc += b_in * b_w[None, :]
    else:
        for j in tl.static_range(KERNEL):
            b_w = tl.load(weight + o_c * stride_wc + j, mask=m_c, other=0).to(tl.float32)
            b_acc += _window_input(x, states, row0, slot, o_t - (KERNEL - 1) + j, o_c, m, stride_x, stride_ss,
                                   stride_sc, KERNEL) * b_w[None, :]
    # Rounded to the output dtype before any norm, as the conv-then-l2_norm references round.
    b_out = (b_acc / (1.0 + tl.exp(-b_acc))).to(out.dtype.element_ty).to(tl.float32)
    # Planes q [N, KEY_DIM] | k [N, KEY_DIM] | v [N, CHANNELS - 2 KEY_DIM] (one plane when KEY_DIM is 0); a block
    # never straddles two (the launcher keeps KEY_DIM a multiple of BLOCK_C).
    is_v = c0 >= 2 * KEY_DIM
    plane_c0 = tl.where(is_v, 2 * KEY_DIM, tl.where(c0 >= KEY_DIM, KEY_DIM, 0))
    width = tl.where(is_v, CHANNELS - 2 * KEY_DIM, KEY_DIM)
    if NORM_DIM > 0:
        if c0 < 2 * KEY_DIM:
            # L2 norm of each NORM_DIM-channel head, eps inside the square root (kernels/norm.py naive_l2_norm).
            if BLOCK_C == NORM_DIM:
                b_out = b_out * (1.0 / tl.sqrt(tl.sum(b_out * b_out, 1) + eps))[:, None]
            else:
                b_h = tl.reshape(b_out, [BLOCK_T, BLOCK_C // NORM_DIM, NORM_DIM])
                b_h = b_h * (1.0 / tl.sqrt(tl.sum(b_h * b_h, 2) + eps))[:, :, None]
                b_out = tl.reshape(b_h, [BLOCK_T, BLOCK_C])
    p_out = (out + plane_c0.to(tl.int64) * num_tokens + (row0 + t0).to(tl.int64) * width
             + o_dt[:, None] * width + (o_c - plane_c0)[None, :])
    tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m)
    if t0 + BLOCK_T >= length:
        _store_new_state(x, states, new_states, row0, slot, length, i_b, o_c, m_c, stride_x, stride_ss, stride_sc,
                         stride_nb, stride_nc, KERNEL, BLOCK_S)


@triton.jit
def _row_mask(o_c, ok, CHANNELS: tl.constexpr):
    """o_c < CHANNELS where the scalar ok holds, else nothing. (Not m_c & ok: the interpreter makes an int32 mask of
    a bool vector & a bool scalar and refuses it.)"""
    return o_c < tl.where(ok, CHANNELS, 0)


@triton.jit
def _input_row(x, states, row0, slot, p, o_c, stride_x, stride_ss, stride_sc, CHANNELS: tl.constexpr,
               KERNEL: tl.constexpr):
    """_window_input for one relative position p (a scalar) -> [C] fp32."""
    b_x = tl.load(x + (row0 + p).to(tl.int64) * stride_x + o_c, mask=_row_mask(o_c, p >= 0, CHANNELS), other=0)
    b_s = tl.load(states + slot * stride_ss + o_c * stride_sc + (KERNEL - 1 + p),
                  mask=_row_mask(o_c, p < 0, CHANNELS), other=0)
    return b_x.to(tl.float32) + b_s.to(tl.float32)


@triton.jit
def _conv_row(x_m3, x_m2, x_m1, x_t, w_3, w_2, w_1, w_0, KERNEL: tl.constexpr):
    """One output row's conv sum, taps in the tile kernel's order (j = 0..K-1: oldest input first); x_m<d> is the
    input d rows back, w_<d> its weight (weight[:, K-1-d])."""
    b_acc = tl.zeros_like(x_t)
    if KERNEL >= 4:
        b_acc += x_m3 * w_3
    if KERNEL >= 3:
        b_acc += x_m2 * w_2
    if KERNEL >= 2:
        b_acc += x_m1 * w_1
    b_acc += x_t * w_0
    return b_acc


@triton.jit
def _store_row(b_acc, p_out, m, eps, normed, BLOCK_C: tl.constexpr, NORM_DIM: tl.constexpr):
    """The tile kernel's epilogue for one row [C]: silu, rounded to the output dtype, the optional per-head L2 norm."""
    b_out = (b_acc / (1.0 + tl.exp(-b_acc))).to(p_out.dtype.element_ty).to(tl.float32)
    if NORM_DIM > 0:
        if normed:
            if BLOCK_C == NORM_DIM:
                b_out = b_out * (1.0 / tl.sqrt(tl.sum(b_out * b_out, 0) + eps))
            else:
                b_h = tl.reshape(b_out, [BLOCK_C // NORM_DIM, NORM_DIM])
                b_h = b_h * (1.0 / tl.sqrt(tl.sum(b_h * b_h, 1) + eps))[:, None]
                b_out = tl.reshape(b_h, [BLOCK_C])
    tl.store(p_out, b_out.to(p_out.dtype.element_ty), mask=m)


@triton.jit
def causal_conv1d_varlen_rows_kernel(
    x, weight, states, slots, offsets, out, new_states, stride_x, stride_wc, stride_ss, stride_sc, stride_nb,
    stride_nc, num_tokens, eps, CHANNELS: tl.constexpr, KEY_DIM: tl.constexpr, NORM_DIM: tl.constexpr,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """causal_conv1d_varlen_fwd_kernel's results (same grid, same arithmetic per element), each input row loaded
    once. The tile kernel loads KERNEL shifted [BLOCK_T, BLOCK_C] tiles (rows t-3..t), so every row of x is read 4
    times (from L1/L2) and BLOCK_T + 3 rows come from DRAM per BLOCK_T outputs. Triton cannot move a register tile
    by one row (that would be a layout conversion through shared memory), so here a program walks its BLOCK_T rows
    one [BLOCK_C] row vector at a time: every thread owns the same channels of all rows, and the window x[t-3],
    x[t-2], x[t-1], x[t] is four loop-carried register vectors that are renamed (x_m3, x_m2, x_m1 = x_m2, x_m1, x_t),
    never moved between threads. To keep enough loads in flight (one 16-byte vector a thread per row is too little
    to hide DRAM latency), rows go 4 at a time and the next 4 rows are loaded at the top of an iteration, before this
    one's stores (a store to out may alias x for the compiler, so it would not hoist a later load above it): 8 row
    loads a thread in flight. The K-1 rows before the program's first come from x or, at a sequence start, from its
    state (K-1 extra row loads a program). Wide channel blocks (BLOCK_C = 8 x 32 x num_warps: 16 bytes a thread
    at bf16) keep every row access one coalesced 512-byte segment a warp.
    Compiled for sm_90 on the CPU (4B shapes, the launcher's integer specializations, Triton's ptxas): at (64, 1024,
    4) 126 registers, no spills, a loop of 4 16-byte loads and 4 16-byte stores a thread with no shared memory; the
    tile kernel at TILE_CONFIG 255 registers with ~0.9 KB spilled, its shifted tiles converted to another register
    layout through shared memory (48 barriers a program). Normed q/k heads are summed in another order than the tile
    kernel's (8 channels in a thread, then a 16-lane butterfly), so those may differ from it in the last bit on the
    GPU; the unnormed outputs and the states should not."""
    i_c, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(offsets + i_b).to(tl.int32)
    length = tl.load(offsets + i_b + 1).to(tl.int32) - row0
    t0 = i_t * BLOCK_T
    if t0 >= length:
        return
    slot = tl.load(slots + i_b).to(tl.int64)
    n_rows = tl.minimum(length - t0, BLOCK_T)
    c0 = i_c * BLOCK_C
    o_c = c0 + tl.arange(0, BLOCK_C)
    m_c = o_c < CHANNELS
    # Weights by distance back: w_<d> multiplies x[t-d].
    w_0 = tl.load(weight + o_c * stride_wc + (KERNEL - 1), mask=m_c, other=0).to(tl.float32)
    w_1 = w_0
    w_2 = w_0
    w_3 = w_0
    x_m1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    x_m2 = x_m1
    x_m3 = x_m1
    if KERNEL >= 2:
        w_1 = tl.load(weight + o_c * stride_wc + (KERNEL - 2), mask=m_c, other=0).to(tl.float32)
        x_m1 = _input_row(x, states, row0, slot, t0 - 1, o_c, stride_x, stride_ss, stride_sc, CHANNELS, KERNEL)
    if KERNEL >= 3:
        w_2 = tl.load(weight + o_c * stride_wc + (KERNEL - 3), mask=m_c, other=0).to(tl.float32)
        x_m2 = _input_row(x, states, row0, slot, t0 - 2, o_c, stride_x, stride_ss, stride_sc, CHANNELS, KERNEL)
    if KERNEL >= 4:
        w_3 = tl.load(weight + o_c * stride_wc + (KERNEL - 4), mask=m_c, other=0).to(tl.float32)
        x_m3 = _input_row(x, states, row0, slot, t0 - 3, o_c, stride_x, stride_ss, stride_sc, CHANNELS, KERNEL)
    # Planes as in the tile kernel; the norm only for q/k blocks.
    is_v = c0 >= 2 * KEY_DIM
    plane_c0 = tl.where(is_v, 2 * KEY_DIM, tl.where(c0 >= KEY_DIM, KEY_DIM, 0))
    width = tl.where(is_v, CHANNELS - 2 * KEY_DIM, KEY_DIM)
    normed = c0 < 2 * KEY_DIM
    p_x = x + (row0 + t0).to(tl.int64) * stride_x + o_c
    p_out = out + plane_c0.to(tl.int64) * num_tokens + (row0 + t0).to(tl.int64) * width + (o_c - plane_c0)
    x_0 = tl.load(p_x, mask=m_c, other=0).to(tl.float32)
    x_1 = tl.load(p_x + stride_x, mask=_row_mask(o_c, 1 < n_rows, CHANNELS), other=0).to(tl.float32)
    x_2 = tl.load(p_x + 2 * stride_x, mask=_row_mask(o_c, 2 < n_rows, CHANNELS), other=0).to(tl.float32)
    x_3 = tl.load(p_x + 3 * stride_x, mask=_row_mask(o_c, 3 < n_rows, CHANNELS), other=0).to(tl.float32)
    for r in tl.range(0, n_rows, 4):
        p_n = p_x + (r + 4) * stride_x
        n_0 = tl.load(p_n, mask=_row_mask(o_c, r + 4 < n_rows, CHANNELS), other=0).to(tl.float32)
        n_1 = tl.load(p_n + stride_x, mask=_row_mask(o_c, r + 5 < n_rows, CHANNELS), other=0).to(tl.float32)
        n_2 = tl.load(p_n + 2 * stride_x, mask=_row_mask(o_c, r + 6 < n_rows, CHANNELS), other=0).to(tl.float32)
        n_3 = tl.load(p_n + 3 * stride_x, mask=_row_mask(o_c, r + 7 < n_rows, CHANNELS), other=0).to(tl.float32)
        p_o = p_out + r * width
        _store_row(_conv_row(x_m3, x_m2, x_m1, x_0, w_3, w_2, w_1, w_0, KERNEL), p_o, m_c, eps, normed,
                   BLOCK_C, NORM_DIM)
        _store_row(_conv_row(x_m2, x_m1, x_0, x_1, w_3, w_2, w_1, w_0, KERNEL), p_o + width,
                   _row_mask(o_c, r + 1 < n_rows, CHANNELS), eps, normed, BLOCK_C, NORM_DIM)
        _store_row(_conv_row(x_m1, x_0, x_1, x_2, w_3, w_2, w_1, w_0, KERNEL), p_o + 2 * width,
                   _row_mask(o_c, r + 2 < n_rows, CHANNELS), eps, normed, BLOCK_C, NORM_DIM)
        _store_row(_conv_row(x_0, x_1, x_2, x_3, w_3, w_2, w_1, w_0, KERNEL), p_o + 3 * width,
                   _row_mask(o_c, r + 3 < n_rows, CHANNELS), eps, normed, BLOCK_C, NORM_DIM)
        x_m3, x_m2, x_m1 = x_1, x_2, x_3
        x_0, x_1, x_2, x_3 = n_0, n_1, n_2, n_3
    if t0 + BLOCK_T >= length:
        _store_new_state(x, states, new_states, row0, slot, length, i_b, o_c, m_c, stride_x, stride_ss, stride_sc,
                         stride_nb, stride_nc, KERNEL, BLOCK_S)


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
    max_len: int, config: tuple | None = None,
) -> torch.Tensor:
    """x [N, C] (B sequences' rows, sequence b at cu_seqlens[b]..cu_seqlens[b+1]-1), weight [C, K], states
    [S, C, K-1] (the pool's), slots [B] -> silu(conv) [N, C] in x's dtype, contiguous; states[slots[b]] becomes
    sequence b's last K-1 inputs. config: (BLOCK_T, BLOCK_C, num_warps) or (BLOCK_T, BLOCK_C, num_warps, variant)
    with variant one of VARIANTS ("tile" when absent), DEFAULT_CONFIG when None."""
    out = x.new_empty(x.shape)
    _launch(x, weight, states, slots, cu_seqlens, max_len, out, 0, 0, 0.0, config or DEFAULT_CONFIG)
    return out


def causal_conv1d_varlen_qkv(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
    max_len: int, key_dim: int, norm_dim: int = 0, eps: float = 1e-6, config: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """causal_conv1d_varlen with x's channels q | k | v (key_dim, key_dim, the rest) -> (q [N, key_dim], k [N,
    key_dim], v [N, C - 2 key_dim]), each contiguous. norm_dim > 0 (a power of two dividing key_dim): each
    norm_dim-channel head of q and k L2-normed, x / sqrt(sum(x^2) + eps) over the output-dtype conv result."""
    num_tokens, channels = x.shape
    if not 0 < 2 * key_dim < channels or (norm_dim and (norm_dim & (norm_dim - 1) or key_dim % norm_dim)):
        raise ValueError(f"conv qkv: key_dim {key_dim} must leave v channels of {channels}, and norm_dim "
                         f"{norm_dim} be 0 or a power of two dividing it")
    block_t, block_c, num_warps, *variant = config or DEFAULT_CONFIG
    # A channel block must lie in one plane and hold whole heads: a power of two dividing key_dim.
    block_c = max(block_c, norm_dim)
    while key_dim % block_c:
        block_c //= 2
    out = x.new_empty(num_tokens * channels)
    _launch(x, weight, states, slots, cu_seqlens, max_len, out, key_dim, norm_dim, eps,
            (block_t, block_c, num_warps, *variant))
    planes = out.split([num_tokens * key_dim, num_tokens * key_dim, num_tokens * (channels - 2 * key_dim)])
    return planes[0].view(num_tokens, key_dim), planes[1].view(num_tokens, key_dim), planes[2].view(num_tokens, -1)


def _launch(x, weight, states, slots, cu_seqlens, max_len: int, out, key_dim: int, norm_dim: int, eps: float,
            config: tuple) -> None:
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_seqs = slots.shape[0]
    if states.shape[1:] != (channels, kernel - 1) or cu_seqlens.shape != (num_seqs + 1,) or x.stride(1) != 1:
        raise ValueError(f"conv: x {tuple(x.shape)} (stride {x.stride()}), weight {tuple(weight.shape)}, states "
                         f"{tuple(states.shape)}, cu_seqlens {tuple(cu_seqlens.shape)} for {num_seqs} slots")
    if num_tokens == 0:
        return
    block_t, block_c, num_warps, *variant = config
    variant = variant[0] if variant else "tile"
    if variant not in VARIANTS or (variant == "rows" and kernel > 4):
        raise ValueError(f"conv: variant {variant!r} (one of {VARIANTS}; rows takes kernel widths up to 4, not "
                         f"{kernel})")
    fwd = causal_conv1d_varlen_rows_kernel if variant == "rows" else causal_conv1d_varlen_fwd_kernel
    new_states = states.new_empty((num_seqs, channels, kernel - 1))
    grid = (triton.cdiv(channels, block_c), triton.cdiv(max_len, block_t), num_seqs)
    fwd[grid](
        x, weight, states, slots, cu_seqlens, out, new_states, x.stride(0), weight.stride(0), states.stride(0),
        states.stride(1), new_states.stride(0), new_states.stride(1), num_tokens, eps, CHANNELS=channels,
        KEY_DIM=key_dim, NORM_DIM=norm_dim, KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_S=triton.next_power_of_2(max(kernel - 1, 1)), num_warps=num_warps,
    )
    states[slots] = new_states
