"""Gated DeltaNet decode step for B sequences, recurrent states updated in place in the SSM pool by slot; and
the same recurrence over the last rows of B prefill chunks, with state snapshots (gated_delta_tail).

Replaces, per layer and step, fla's fused recurrent kernel plus the gather of the states out of the pool,
their fp32 copies and the scatter back (about four passes over B x 2 MiB of state for the 4B model) with
one pass that reads and writes each state once. Same recurrence and L2 norms as naive_gated_delta_rule:
S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q, q/k L2-normalised (eps 1e-6; or by the prefill conv,
qk_normed), q scaled by Dk^-1/2. One program per (sequence, value head, block of value channels); the key
dimension is one tile. A decode step may also apply the layer's gated output norm (gate_norm) to o: one launch a
layer fewer where the out-projection's GEMV cannot fuse that norm. A head's value blocks then meet as split-K's do
(quant_matmul._split_total): each parks its rows and its sum of squares, and the last to arrive norms the head. The token-by-token paths (rows, tail) prefetch each next row's inputs during a row's math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.conv_update import conv_roll, conv_step, conv_window
from headroom.kernels.gates_triton import gdn_gate_values
from headroom.kernels.pdl import pdl_enter, pdl_launch
from headroom.kernels.quant_matmul import _COUNTER_SLOTS, _counters

# Launch configuration by kind of call: "decode_small" (fewer than SMALL_BATCH sequences, one token each), "decode"
# (more), "rows" (bounds given) and "tail" (gated_delta_tail). block_v: value channels a program (the key axis is
# one tile). Set from the H200 sweep
# (bench/gdn_decode_sweep.py); a call's own config= (the sweep's) overrides its entry for that call only, the
# engine passes none. Each distinct entry is one compiled variant.
SMALL_BATCH = 4
CONFIGS: dict[str, dict] = {
    # H200, session 10 (bench/results/session10/call2/gdn_decode_sweep.json), cold us a call in a 24-layer graph:
    # batch 1 3.66 (the old 16 x 4 warps 4.05), batch 8 12.4 (14.6), batch 16 21.3 (24.4); rows (a 30-, 1- and
    # 64-token chunk) 80 against 140; tail 248 against 441.
    # One warp keeps the key-axis sums inside the warp (2 barriers instead of 13-17). Every variant loaded a token's
    # inputs before its reductions; the order before (v, gate and beta behind the q/k norms' barriers) lost at
    # every width and batch of that sweep, and is gone.
    "decode_small": {"block_v": 16, "num_warps": 1},
    "decode": {"block_v": 64, "num_warps": 4},
    # Session 11 (bench/results/session11/call2/gdn_decode_sweep.json), the pipelined walks on normed q/k: rows
    # 50.7 us (bv8), tail 106.1 us at bv16 against 109.7 at bv8 (session 10: 80 and 248).
    "rows": {"block_v": 8, "num_warps": 1},
    "tail": {"block_v": 16, "num_warps": 1},
}


def _config(kind: str, override: dict | None) -> dict:
    return CONFIGS[kind] if override is None else {**CONFIGS[kind], **override}


@triton.jit
def _value_inputs(p_v, p_g, p_beta, o_v, m_v):
    """A token's value head, gate and beta (fp32)."""
    b_v = tl.load(p_v + o_v, mask=m_v, other=0).to(tl.float32)
    return b_v, tl.load(p_g).to(tl.float32), tl.load(p_beta).to(tl.float32)


@triton.jit
def _key_inputs(p_q, p_k, o_k, m_k):
    """A token's q and k heads (fp32), issued after every other load: were Triton to move them through shared
    memory into the tile's layout right after their load (3.6 does so when they are also used as vectors of
    their own), a warp issuing in order would hold every later load back until theirs arrived."""
    b_q = tl.load(p_q + o_k, mask=m_k, other=0).to(tl.float32)
    return b_q, tl.load(p_k + o_k, mask=m_k, other=0).to(tl.float32)


@triton.jit
def _delta_rule_math(b_s, b_q, b_k, b_v, b_g, b_beta, scale, QK_NORMED: tl.constexpr):
    """One token on a [BLOCK_K, BLOCK_V] fp32 state tile from its loaded inputs: q/k L2-normed (unless QK_NORMED:
    the prefill conv normed them), q scaled, decay, delta update; returns the new tile and the output row
    o = S^T q."""
    if QK_NORMED:
        b_q = b_q * scale
    else:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_s = b_s * tl.exp(b_g)
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    return b_s, tl.sum(b_s * b_q[:, None], 0)


@triton.jit
def _row_inputs(q, k, v, g, beta, t, live, i_hk, i_hv, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_gt, stride_betat, o_k, m_k, o_v, m_v):
    """Row t's q, k, v, gate and beta as loaded (not yet fp32), every load masked off unless live: the prefetch
    of the row after the last has none. Kept in their own dtype until the row's math: a conversion right here
    would wait for the loads before the current row's math, the very round trip the prefetch hides. v, gate and
    beta first, q and k last (_key_inputs). (tl.where, not m & live: the interpreter's & of a vector and a scalar
    mask makes int32, which its load refuses.)"""
    m_kt, m_vt = tl.where(live, m_k, False), tl.where(live, m_v, False)
    c_v = tl.load(v + t * stride_vt + i_hv * stride_vh + o_v, mask=m_vt, other=0)
    c_g = tl.load(g + t * stride_gt + i_hv, mask=live, other=0)
    c_beta = tl.load(beta + t * stride_betat + i_hv, mask=live, other=0)
    c_q = tl.load(q + t * stride_qt + i_hk * stride_qh + o_k, mask=m_kt, other=0)
    c_k = tl.load(k + t * stride_kt + i_hk * stride_kh + o_k, mask=m_kt, other=0)
    return c_q, c_k, c_v, c_g, c_beta


@triton.jit
def _row_math(b_s, c_q, c_k, c_v, c_g, c_beta, out, t, i_hv, stride_ot, stride_oh, o_v, m_v, scale,
              QK_NORMED: tl.constexpr):
    """_delta_rule_math on row t's inputs from _row_inputs, its output row stored; returns the new tile."""
    b_s, b_o = _delta_rule_math(b_s, c_q.to(tl.float32), c_k.to(tl.float32), c_v.to(tl.float32),
                                c_g.to(tl.float32), c_beta.to(tl.float32), scale, QK_NORMED)
    tl.store(out + t * stride_ot + i_hv * stride_oh + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
    return b_s


@triton.jit
def _gated_head_norm(b_o, b_z, b_w, rstd, dtype: tl.constexpr):
    """Output rows o (fp32, as stored in dtype) of a head through Gated DeltaNet's output norm with the head's
    1 / rms, rounded where and as norm_triton's gated_rms_norm rounds them: w * rmsnorm(o) * silu(z), z, w fp32."""
    b_y = ((b_o * rstd).to(dtype).to(tl.float32) * b_w).to(dtype).to(tl.float32)
    return b_y * (b_z / (1.0 + tl.exp(-b_z)))


@triton.jit
def _store_gate_normed(b_o, p_o, z, norm_w, ws, counters, o_v, m_v, eps, i_v, head, DV: tl.constexpr,
                       BLOCKS: tl.constexpr, HEAD_BLOCK: tl.constexpr):
    """Store a program's output rows o (fp32, channels o_v of the head at p_o; gate z and norm weight norm_w at
    the head's channels) gated-normed by the whole head's 1 / rms. One block a head (BLOCKS 1): at once. Else each
    block parks its rows, rounded as stored, at p_o and its sum of squares at ws[head, i_v]; the head's last block
    to arrive (counters[head], reset to 0 after) sums the parts in block order and norms the head's HEAD_BLOCK
    channels from p_o (the others' loads and stores masked off by tl.where: see quant_matmul._split_total)."""
    dtype: tl.constexpr = p_o.dtype.element_ty
    b_o = b_o.to(dtype).to(tl.float32)
    squares = tl.sum(b_o * b_o, 0)
    if BLOCKS == 1:
        b_z = tl.load(z + o_v, mask=m_v, other=0).to(tl.float32)
        b_w = tl.load(norm_w + o_v, mask=m_v, other=0).to(tl.float32)
        y = _gated_head_norm(b_o, b_z, b_w, 1.0 / tl.sqrt(squares / DV + eps), dtype)
        tl.store(p_o + o_v, y.to(dtype), mask=m_v)
    else:
        tl.store(p_o + o_v, b_o.to(dtype), mask=m_v)
        tl.store(ws + head * BLOCKS + i_v, squares)
        tl.debug_barrier()
        arrived = tl.atomic_add(counters + head, 1, sem="acq_rel")
        last = arrived == BLOCKS - 1
        o_h = tl.arange(0, HEAD_BLOCK)
        m_h = tl.where(last, o_h < DV, False)
        total = 0.0
        for j in tl.static_range(BLOCKS):
            total += tl.load(ws + head * BLOCKS + j, mask=last, other=0.0, cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(total / DV + eps)
        b_h = tl.load(p_o + o_h, mask=m_h, other=0, cache_modifier=".cg").to(tl.float32)
        b_z = tl.load(z + o_h, mask=m_h, other=0).to(tl.float32)
        b_w = tl.load(norm_w + o_h, mask=m_h, other=0).to(tl.float32)
        tl.store(p_o + o_h, _gated_head_norm(b_h, b_z, b_w, rstd, dtype).to(dtype), mask=m_h)
        tl.atomic_xchg(counters + head, 0, mask=last)


@triton.jit
def gated_delta_decode_fwd_kernel(
    q, k, v, g, beta, states, slots, bounds, out, neg_a, dt_bias, z, norm_w, ws, counters, conv_w, conv_states,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_betab,
    stride_ss, stride_sh, stride_sk, stride_ob, stride_oh, stride_zb, stride_zh, stride_cw, stride_cs, stride_cc,
    q_channel, k_channel, v_channel, scale, eps,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ROWS: tl.constexpr, QK_NORMED: tl.constexpr, RAW_GATES: tl.constexpr, PDL: tl.constexpr,
    GATE_NORM: tl.constexpr = False, HEAD_BLOCK: tl.constexpr = 1, CONV: tl.constexpr = False,
    CONV_TAPS: tl.constexpr = 4, CONV_BLOCK: tl.constexpr = 4,
):
    """ROWS False: row b is sequence b's one token. ROWS True: sequence b's tokens are rows bounds[b]..bounds[b+1]
    (row strides are the *_b ones), walked in order with the state held in registers. QK_NORMED: q and k come
    L2-normed (_delta_rule_math). RAW_GATES (ROWS False): g and beta hold the projection's a and b, and the step
    makes its gates from them with neg_a and dt_bias [Hv] (gdn_gate_values: the gates kernel's launch saved).
    GATE_NORM (ROWS False): the rows stored are gated-normed by value heads (_store_gate_normed) with the gate z
    (row strides stride_zb, stride_zh) and the norm's weight norm_w [DV]; ws [B * Hv * blocks] fp32 and counters
    (zeros, at least B * Hv) where a head has several value blocks; HEAD_BLOCK: DV's power of 2.
    CONV (ROWS False): q, k and v are the short conv's inputs, not its outputs: the step convolves them first
    (kernels/conv_update.py's own step, each row's carried inputs conv_states[slot] at channels q_channel +
    head * stride_qh + d and likewise for k and v; taps conv_w, CONV_TAPS of them, CONV_BLOCK their power of 2),
    each result rounded to the inputs' dtype as the conv kernel would have stored it. A value block's channels are
    its program's alone and rolled in place at once; a key head's q and k channels are read by its GROUP heads'
    value blocks, so the last of them to arrive (counters after the gate norm's, reset to 0 after) rolls them."""
    pdl_enter(PDL)
    i_b, i_hv, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_hk = i_hv // GROUP
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < DK
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    slot = tl.load(slots + i_b).to(tl.int64)
    if not ROWS:
        # The graphs' decode step. A program's time is a chain of memory round trips: the slot, then its state.
        # Every load goes out before any reduction (whose barriers would hold a later load back a round trip
        # each), q and k last (_key_inputs).
        b_v, b_g, b_beta = _value_inputs(v + i_b * stride_vb + i_hv * stride_vh, g + i_b * stride_gb + i_hv,
                                         beta + i_b * stride_betab + i_hv, o_v, m_v)
        if CONV:
            p_conv = conv_states + slot * stride_cs
            c_v = v_channel + i_hv * stride_vh + o_v
            b_v = conv_step(b_v, p_conv + c_v * stride_cc, conv_w + c_v * stride_cw, m_v, CONV_TAPS, CONV_BLOCK)
            b_v = b_v.to(v.dtype.element_ty).to(tl.float32)
        if RAW_GATES:
            b_beta, b_g = gdn_gate_values(b_beta, b_g, tl.load(dt_bias + i_hv).to(tl.float32), tl.load(neg_a + i_hv),
                                          beta.dtype.element_ty)
        p_s = states + slot * stride_ss + i_hv * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0).to(tl.float32)
        b_q, b_k = _key_inputs(q + i_b * stride_qb + i_hk * stride_qh, k + i_b * stride_kb + i_hk * stride_kh,
                               o_k, m_k)
        if CONV:
            x_q, x_k = b_q, b_k
            c_q, c_k = q_channel + i_hk * stride_qh + o_k, k_channel + i_hk * stride_kh + o_k
            b_q = conv_window(x_q, p_conv + c_q * stride_cc, conv_w + c_q * stride_cw, m_k, CONV_TAPS, CONV_BLOCK)
            b_k = conv_window(x_k, p_conv + c_k * stride_cc, conv_w + c_k * stride_cw, m_k, CONV_TAPS, CONV_BLOCK)
            b_q, b_k = b_q.to(q.dtype.element_ty).to(tl.float32), b_k.to(k.dtype.element_ty).to(tl.float32)
        b_s, b_o = _delta_rule_math(b_s, b_q, b_k, b_v, b_g, b_beta, scale, QK_NORMED)
        # the state first: the gate norm's last block waits on its head's other blocks
        tl.store(p_s, b_s.to(states.dtype.element_ty), mask=m_s)
        if GATE_NORM:
            _store_gate_normed(b_o, out + i_b * stride_ob + i_hv * stride_oh, z + i_b * stride_zb + i_hv * stride_zh,
                               norm_w, ws, counters, o_v, m_v, eps, i_v, i_b * tl.num_programs(1) + i_hv, DV,
                               (DV + BLOCK_V - 1) // BLOCK_V, HEAD_BLOCK)
        else:
            tl.store(out + i_b * stride_ob + i_hv * stride_oh + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
        if CONV:
            # Every reader of the key head's q / k carried inputs has read them once its count is in: the barrier
            # first, so that no warp of this program is still to read them when its count goes in (the atomic is
            # one thread's; without it the first device A/B's conv gave other tokens, session 29).
            tl.debug_barrier()
            readers = GROUP * tl.num_programs(2)
            head = tl.num_programs(0) * tl.num_programs(1) + i_b * (tl.num_programs(1) // GROUP) + i_hk
            arrived = tl.atomic_add(counters + head, 1, sem="acq_rel")
            last = arrived == readers - 1
            m_roll = tl.where(last, m_k, False)
            conv_roll(x_q, p_conv + c_q * stride_cc, m_roll, CONV_TAPS, CONV_BLOCK)
            conv_roll(x_k, p_conv + c_k * stride_cc, m_roll, CONV_TAPS, CONV_BLOCK)
            tl.atomic_xchg(counters + head, 0, mask=last)
    else:
        # Software-pipelined: row t+1's loads go out before row t's math, so a row waits on the math's chain
        # alone, not on a memory round trip as well (the first row's loads travel with the state's).
        lo, hi = tl.load(bounds + i_b).to(tl.int64), tl.load(bounds + i_b + 1).to(tl.int64)
        c_q, c_k, c_v, c_g, c_beta = _row_inputs(q, k, v, g, beta, lo, lo < hi, i_hk, i_hv, stride_qb, stride_qh,
                                                 stride_kb, stride_kh, stride_vb, stride_vh, stride_gb,
                                                 stride_betab, o_k, m_k, o_v, m_v)
        p_s = states + slot * stride_ss + i_hv * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0).to(tl.float32)
        for t in range(lo, hi):
            n_q, n_k, n_v, n_g, n_beta = _row_inputs(q, k, v, g, beta, t + 1, t + 1 < hi, i_hk, i_hv, stride_qb,
                                                     stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                                                     stride_gb, stride_betab, o_k, m_k, o_v, m_v)
            b_s = _row_math(b_s, c_q, c_k, c_v, c_g, c_beta, out, t, i_hv, stride_ob, stride_oh, o_v, m_v, scale,
                            QK_NORMED)
            c_q, c_k, c_v, c_g, c_beta = n_q, n_k, n_v, n_g, n_beta
        tl.store(p_s, b_s.to(states.dtype.element_ty), mask=m_s)


def gated_delta_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor | None = None, *, qk_normed: bool = False,
    raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    gate_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, config: dict | None = None,
) -> torch.Tensor:
    """q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv]; states [S, Hv, Dk, Dv] (updated in place at rows
    slots [B], int); strided rows allowed, last dims contiguous. Returns out [N, Hv, Dv] in v's dtype.
    bounds None: one token per sequence (N = B). bounds [B + 1] (int, device): sequence b's tokens are rows
    bounds[b]..bounds[b+1], run in order in one launch (short prefill chunks, engine/layers/linear_attention.py).
    qk_normed: q and k are L2-normed already (the prefill conv's fused norm), only scaled here.
    raw_gates (neg_a fp32, dt_bias) [Hv], one token per sequence only: g and beta are the projection's raw a and
    b, made into gates in the step (as naive_gdn_gates makes them).
    gate_norm (z [N, Hv, Dv] with strided rows allowed, weight [Dv], eps), one token per sequence only: out is
    gated_rms_norm(o, z, weight, eps) by value heads instead of o (Gated DeltaNet's output norm, as
    kernels/norm_triton.py computes it from o stored in v's dtype; a head's sum of squares is taken by value
    blocks, in block order).
    conv (mixed [N, C], weight [C, K], conv states [S, C, K-1]), one token per sequence only: q, k and v are views
    of mixed, the short conv's inputs (channel = column of mixed), convolved in the step with the carried inputs
    at the same slots, rolled in place (as kernels/conv_update.py's causal_conv1d_update before the step).
    config: keys of a CONFIGS entry, for this call only (the sweep's)."""
    num_rows, num_k_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1:]
    num_seqs = slots.shape[0] if slots.dim() == 1 else -1
    if k.shape != q.shape or v.shape[0] != num_rows or num_v_heads % num_k_heads \
            or g.shape != (num_rows, num_v_heads) or beta.shape != (num_rows, num_v_heads):
        raise ValueError(f"gated delta decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    rows_ok = bounds is None and num_seqs == num_rows or bounds is not None and bounds.shape == (num_seqs + 1,)
    if states.shape[1:] != (num_v_heads, key_dim, value_dim) or num_seqs < 0 or not rows_ok:
        raise ValueError(f"gated delta decode: states {tuple(states.shape)} must be [S, {num_v_heads}, {key_dim}, "
                         f"{value_dim}], slots {tuple(slots.shape)} [{num_rows if bounds is None else 'B'}], bounds "
                         f"{None if bounds is None else tuple(bounds.shape)} [B + 1] or none")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, beta, states)):
        raise ValueError("gated delta decode: every last dimension must be contiguous")
    if raw_gates is not None and (bounds is not None or any(t.shape != (num_v_heads,) for t in raw_gates)):
        raise ValueError(f"gated delta decode: raw gates take one token per sequence and neg_a, dt_bias [{num_v_heads}]")
    neg_a, dt_bias = raw_gates if raw_gates is not None else (g, g)
    z, norm_w, eps = gate_norm if gate_norm is not None else (v, v, 0.0)
    if gate_norm is not None and (bounds is not None or z.shape != v.shape or norm_w.shape != (value_dim,)
                                  or z.stride(-1) != 1):
        raise ValueError(f"gated delta decode: the gate norm takes one token per sequence, z {tuple(z.shape)} as v "
                         f"{tuple(v.shape)} (last dimension contiguous) and its weight {tuple(norm_w.shape)} "
                         f"[{value_dim}]")
    channels, conv_args = _conv_arguments(conv, q, k, v, bounds)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    # Small batches may want narrower value blocks (more programs share the state reads), rows too (each program
    # walks its rows one after another, so more of them shorten the pass): CONFIGS says, by measurement.
    kind = "rows" if bounds is not None else "decode_small" if num_seqs < SMALL_BATCH else "decode"
    cfg = _config(kind, config)
    blocks = triton.cdiv(value_dim, cfg["block_v"])
    ws, counters = out, out
    if (gate_norm is not None and blocks > 1) or conv is not None:
        # the gate norm's counters a value head, then the conv's a key head
        if num_seqs * (num_v_heads + num_k_heads) > _COUNTER_SLOTS:
            raise ValueError(f"gated delta decode: {num_seqs} sequences of {num_v_heads} + {num_k_heads} heads take "
                             f"more than the {_COUNTER_SLOTS} arrival counters")
        counters = _counters(v.device)
    if gate_norm is not None and blocks > 1:
        ws = torch.empty(num_seqs * num_v_heads * blocks, dtype=torch.float32, device=v.device)
    gated_delta_decode_fwd_kernel[(num_seqs, num_v_heads, blocks)](
        q, k, v, g, beta, states, slots, slots if bounds is None else bounds, out, neg_a, dt_bias, z, norm_w, ws,
        counters, conv_args[0], conv_args[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), g.stride(0), beta.stride(0), states.stride(0), states.stride(1), states.stride(2), out.stride(0),
        out.stride(1), z.stride(0), z.stride(1), *conv_args[2:], *channels, key_dim**-0.5, eps,
        GROUP=num_v_heads // num_k_heads, DK=key_dim, DV=value_dim, BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=cfg["block_v"], ROWS=bounds is not None, QK_NORMED=qk_normed, RAW_GATES=raw_gates is not None,
        GATE_NORM=gate_norm is not None, HEAD_BLOCK=triton.next_power_of_2(value_dim), CONV=conv is not None,
        CONV_TAPS=conv[1].shape[1] if conv is not None else 4,
        CONV_BLOCK=triton.next_power_of_2(conv[1].shape[1]) if conv is not None else 4, num_warps=cfg["num_warps"],
        **pdl_launch(q.device),
    )
    return out


def _conv_arguments(conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, bounds: torch.Tensor | None) -> tuple[tuple[int, int, int], tuple]:
    """((q, k, v's first channels in mixed), (conv_w, conv_states, stride_cw, stride_cs, stride_cc)) for the
    kernel's CONV; zeros and q's tensor without a conv. q, k and v must be views of mixed's rows, each head's
    channels contiguous."""
    if conv is None:
        return (0, 0, 0), (q, q, 0, 0, 0)
    mixed, weight, states = conv
    rows, channels = mixed.shape if mixed.dim() == 2 else (-1, -1)
    taps = weight.shape[1] if weight.dim() == 2 else 0
    first = [(t.data_ptr() - mixed.data_ptr()) // mixed.element_size() for t in (q, k, v)]
    # (a one-row view's row stride is whatever torch made it: only its channels matter)
    views = all(t.dtype == mixed.dtype and (rows == 1 or t.stride(0) == mixed.stride(0)) and t.shape[0] == rows and 0 <= c
                and c + (t.shape[1] - 1) * t.stride(1) + t.shape[2] <= channels
                for t, c in zip((q, k, v), first, strict=True))
    if bounds is not None or not views or mixed.stride(-1) != 1 or weight.shape != (channels, taps) or taps < 2 \
            or states.dim() != 3 or states.shape[1:] != (channels, taps - 1) or states.stride(-1) != 1 \
            or weight.stride(-1) != 1:
        raise ValueError(f"gated delta decode: the conv takes one token per sequence with q, k, v views of mixed "
                         f"{tuple(mixed.shape)} [N, C], its weight {tuple(weight.shape)} [C, K >= 2] and states "
                         f"{tuple(states.shape)} [S, C, K - 1] (last dimensions contiguous)")
    return (first[0], first[1], first[2]), (weight, states, weight.stride(0), states.stride(0), states.stride(1))


@triton.jit
def gated_delta_tail_fwd_kernel(
    q, k, v, g, beta, states, out, pool, row_lo, row_hi, snap_at, snap_slot,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
    stride_sb, stride_sh, stride_sk, stride_ot, stride_oh, stride_ps, stride_ph, stride_pk, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    MAX_SNAPS: tl.constexpr, QK_NORMED: tl.constexpr, PDL: tl.constexpr,
):
    """gated_delta_tail's walk, software-pipelined as the ROWS branch of gated_delta_decode_fwd_kernel."""
    pdl_enter(PDL)
    i_b, i_hv, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_hk = i_hv // GROUP
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < DK
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    lo = tl.load(row_lo + i_b).to(tl.int64)
    num_rows = tl.load(row_hi + i_b) - tl.load(row_lo + i_b)
    c_q, c_k, c_v, c_g, c_beta = _row_inputs(q, k, v, g, beta, lo, num_rows > 0, i_hk, i_hv, stride_qt, stride_qh,
                                             stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
                                             o_k, m_k, o_v, m_v)
    p_s = states + i_b * stride_sb + i_hv * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0).to(tl.float32)
    # The snapshots ascend (0 after the last): only the next one is compared a row, its table entries read when
    # it is taken, not MAX_SNAPS loads behind every row's math.
    snap = 0
    next_at = tl.load(snap_at + i_b * MAX_SNAPS)
    for i in range(0, num_rows):
        n_q, n_k, n_v, n_g, n_beta = _row_inputs(q, k, v, g, beta, lo + i + 1, i + 1 < num_rows, i_hk, i_hv,
                                                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                                 stride_gt, stride_betat, o_k, m_k, o_v, m_v)
        b_s = _row_math(b_s, c_q, c_k, c_v, c_g, c_beta, out, lo + i, i_hv, stride_ot, stride_oh, o_v, m_v, scale,
                        QK_NORMED)
        c_q, c_k, c_v, c_g, c_beta = n_q, n_k, n_v, n_g, n_beta
        if i + 1 == next_at:
            slot = tl.load(snap_slot + i_b * MAX_SNAPS + snap).to(tl.int64)
            p_p = pool + slot * stride_ps + i_hv * stride_ph + o_k[:, None] * stride_pk + o_v[None, :]
            tl.store(p_p, b_s.to(pool.dtype.element_ty), mask=m_s)
            snap += 1
            next_at = tl.load(snap_at + i_b * MAX_SNAPS + snap, mask=snap < MAX_SNAPS, other=0)
    tl.store(p_s, b_s, mask=m_s)


def gated_delta_tail(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, out: torch.Tensor, pool: torch.Tensor, row_lo: torch.Tensor, row_hi: torch.Tensor,
    snap_at: torch.Tensor, snap_slot: torch.Tensor, *, qk_normed: bool = False, config: dict | None = None,
) -> None:
    """kernels/gated_delta.py's naive_gated_delta_tail in one launch, snapshots given as snap_at / snap_slot
    [B, S] int32 (rows done before the snapshot, ascending, then 0s; pool slot). qk_normed: q and k are
    L2-normed already. One program per (sequence, value head, block of value channels) walks its rows in order;
    states [B, Hv, Dk, Dv] fp32 hold the final states."""
    num_k_heads, key_dim = q.shape[1:]
    num_v_heads, value_dim = v.shape[1:]
    num_seqs, max_snaps = snap_at.shape
    if k.shape != q.shape or v.shape[0] != q.shape[0] or out.shape != v.shape or num_v_heads % num_k_heads:
        raise ValueError(f"gated delta tail: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"out {tuple(out.shape)}")
    if states.shape != (num_seqs, num_v_heads, key_dim, value_dim) or states.dtype != torch.float32 \
            or pool.shape[1:] != states.shape[1:] or row_lo.shape != (num_seqs,) or row_hi.shape != (num_seqs,) \
            or snap_slot.shape != snap_at.shape:
        raise ValueError(f"gated delta tail: states {tuple(states.shape)} {states.dtype} (fp32 [B, Hv, Dk, Dv]), "
                         f"pool {tuple(pool.shape)}, rows {tuple(row_lo.shape)}/{tuple(row_hi.shape)}, snapshots "
                         f"{tuple(snap_at.shape)}/{tuple(snap_slot.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, beta, states, out, pool)) or not snap_at.is_contiguous() \
            or not snap_slot.is_contiguous():
        raise ValueError("gated delta tail: every last dimension must be contiguous, and the snapshot tables whole")
    if num_seqs == 0:
        return
    cfg = _config("tail", config)
    grid = (num_seqs, num_v_heads, triton.cdiv(value_dim, cfg["block_v"]))
    gated_delta_tail_fwd_kernel[grid](
        q, k, v, g, beta, states, out, pool, row_lo, row_hi, snap_at, snap_slot,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), key_dim**-0.5,
        GROUP=num_v_heads // num_k_heads, DK=key_dim, DV=value_dim, BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=cfg["block_v"], MAX_SNAPS=max_snaps, QK_NORMED=qk_normed, num_warps=cfg["num_warps"],
        **pdl_launch(q.device),
    )
