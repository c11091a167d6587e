"""Fused Gated DeltaNet decode step and its rows path (interpreter on CPU) against the naive per-sequence
recurrence, q/k normed in the kernel or already (qk_normed); and the kernel's variants compiled for sm_90."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.gated_delta import naive_gated_delta_decode, naive_gated_delta_rule
from headroom.kernels.gdn_decode import CONFIGS, SMALL_BATCH, gated_delta_decode
from headroom.kernels.norm import naive_l2_norm

from tests.kernels.sm90 import compile_sm90

# Every launch variant the sweep (bench/gdn_decode_sweep.py) may pick: the shipped entries (None), value blocks
# narrower and wider than a head (masked), other warp counts.
VARIANTS = [None, {"block_v": 8, "num_warps": 1}, {"block_v": 32, "num_warps": 2}, {"block_v": 64, "num_warps": 8},
            {"block_v": 128, "num_warps": 4}]


@pytest.mark.parametrize("config", VARIANTS)
@pytest.mark.parametrize("num_seqs,hk,hv,dk,dv", [(3, 2, 4, 16, 24), (1, 1, 3, 8, 40), (5, 2, 2, 24, 8)])
def test_decode_matches_naive_in_place(num_seqs, hk, hv, dk, dv, config):
    gen = torch.Generator().manual_seed(num_seqs * 100 + dv)
    conv_out = torch.randn(num_seqs, 2 * hk * dk + hv * dv, generator=gen)
    # Strided views of one conv output, as the layer passes them.
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(num_seqs, hk, dk), k.reshape(num_seqs, hk, dk), v.reshape(num_seqs, hv, dv)
    g = -torch.rand(num_seqs, hv, generator=gen)
    beta = torch.rand(num_seqs, hv, generator=gen)
    states = torch.randn(7, hv, dk, dv, generator=gen)
    slots = torch.randperm(7, generator=gen)[:num_seqs]
    ref_states = states.clone()
    out = gated_delta_decode(q, k, v, g, beta, states, slots, config=config)
    want = naive_gated_delta_decode(q, k, v, g, beta, ref_states, slots)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # The slots' states advanced exactly as the reference's; the others untouched.
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)


def test_decode_takes_normed_qk():
    """qk_normed: q and k come L2-normed (the prefill conv's epilogue), only scaled in the kernel."""
    gen = torch.Generator().manual_seed(4)
    q, k = (naive_l2_norm(torch.randn(3, 2, 16, generator=gen), 1e-6) for _ in range(2))
    v, g, beta = torch.randn(3, 4, 24, generator=gen), -torch.rand(3, 4, generator=gen), torch.rand(3, 4, generator=gen)
    states = torch.randn(5, 4, 16, 24, generator=gen)
    slots = torch.tensor([4, 0, 2])
    ref_states = states.clone()
    out = gated_delta_decode(q, k, v, g, beta, states, slots, qk_normed=True)
    want = naive_gated_delta_decode(q, k, v, g, beta, ref_states, slots, qk_normed=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)


def test_decode_makes_its_gates_from_the_raw_projection():
    """raw_gates: a and b as the in-projection gives them (strided columns), gated in the step exactly as
    naive_gdn_gates gates them beforehand; refused with bounds."""
    from headroom.kernels.gates import naive_gdn_gates

    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    v = torch.randn(3, 4, 24, generator=gen)
    ba = torch.randn(3, 11, generator=gen) * 6
    b, a = ba[:, 1:5], ba[:, 6:10]
    neg_a, dt_bias = -torch.rand(4, generator=gen) * 8, torch.randn(4, generator=gen)
    states = torch.randn(5, 4, 16, 24, generator=gen)
    slots = torch.tensor([1, 4, 2])
    ref_states = states.clone()
    out = gated_delta_decode(q, k, v, a, b, states, slots, raw_gates=(neg_a, dt_bias))
    beta, g = naive_gdn_gates(b, a, neg_a, dt_bias)
    want = naive_gated_delta_decode(q, k, v, g, beta, ref_states, slots)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="raw gates"):
        gated_delta_decode(q, k, v, a, b, states, slots, torch.tensor([0, 1, 2, 3]), raw_gates=(neg_a, dt_bias))


@pytest.mark.parametrize("config", [None, {"block_v": 8, "num_warps": 1}, {"block_v": 32, "num_warps": 2},
                                    {"block_v": 64, "num_warps": 4}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs,hk,hv,dk,dv", [(4, 2, 4, 16, 32), (2, 1, 2, 8, 24)])
def test_decode_applies_the_gate_norm_by_heads(num_seqs, hk, hv, dk, dv, dtype, config):
    """gate_norm: the step stores gated_rms_norm(o, z) by value heads (z strided out of the in-projection), a head
    in one program or in several value blocks that meet at the last to arrive (3 blocks of 8 for 24 channels, a
    masked 32-wide one), the states advanced as without it and the arrival counters left at zero."""
    from headroom.kernels.norm import naive_gated_rms_norm
    from headroom.kernels.quant_matmul import _counters

    gen = torch.Generator().manual_seed(num_seqs * 10 + dv)
    conv_out = torch.randn(num_seqs, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(num_seqs, hk, dk), k.reshape(num_seqs, hk, dk), v.reshape(num_seqs, hv, dv)
    projected = torch.randn(num_seqs, 3 + hv * dv, generator=gen).to(dtype)
    z = projected[:, 3:].reshape(num_seqs, hv, dv)
    weight = (torch.rand(dv, generator=gen) + 0.5).to(dtype)
    g = -torch.rand(num_seqs, hv, generator=gen)
    beta = torch.rand(num_seqs, hv, generator=gen).to(dtype)
    states = torch.randn(6, hv, dk, dv, generator=gen)
    slots = torch.randperm(6, generator=gen)[:num_seqs]
    ref_states = states.clone()
    out = gated_delta_decode(q, k, v, g, beta, states, slots, gate_norm=(z, weight, 1e-6), config=config)
    assert not _counters(out.device).any()
    core = naive_gated_delta_decode(q, k, v, g, beta, ref_states, slots)
    want = naive_gated_rms_norm(core, z, weight, 1e-6)
    assert out.dtype == dtype
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, want, **tolerance)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [None, {"block_v": 8, "num_warps": 1}, {"block_v": 64, "num_warps": 4}])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("num_seqs,hk,hv,dk,dv,taps", [(4, 2, 4, 16, 32, 4), (3, 1, 3, 8, 24, 3), (1, 2, 4, 16, 32, 4)])
def test_decode_convolves_its_inputs_first(num_seqs, hk, hv, dk, dv, taps, gated, config):
    """conv: q, k, v are the in-projection's raw columns (mixed, strided rows) and the step convolves them itself:
    the same bits, output and recurrent states, and the same rolled conv states as the conv kernel
    (causal_conv1d_update) followed by the step; a key head's q / k carried inputs rolled once, by the last of
    its readers (3 value heads a key head, 1 to 4 value blocks each), the counters left at zero."""
    from headroom.kernels.conv_update import causal_conv1d_update
    from headroom.kernels.quant_matmul import _counters

    gen = torch.Generator().manual_seed(num_seqs * 7 + taps)
    channels = 2 * hk * dk + hv * dv
    projected = torch.randn(num_seqs, channels + 5, generator=gen).to(torch.bfloat16)
    mixed = projected[:, 2 : 2 + channels]
    weight = torch.randn(channels, taps, generator=gen).to(torch.bfloat16)
    conv_states = torch.randn(6, channels, taps - 1, generator=gen).to(torch.bfloat16)
    g, beta = -torch.rand(num_seqs, hv, generator=gen), torch.rand(num_seqs, hv, generator=gen).to(torch.bfloat16)
    states = torch.randn(6, hv, dk, dv, generator=gen)
    slots = torch.randperm(6, generator=gen)[:num_seqs]
    gate_norm = (torch.randn(num_seqs, hv, dv, generator=gen).to(torch.bfloat16),
                 (torch.rand(dv, generator=gen) + 0.5).to(torch.bfloat16), 1e-6) if gated else None

    def split(x):
        q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
        return q.reshape(num_seqs, hk, dk), k.reshape(num_seqs, hk, dk), v.reshape(num_seqs, hv, dv)

    ref_conv, ref_states = conv_states.clone(), states.clone()
    convolved = causal_conv1d_update(mixed, weight, ref_conv, slots)
    want = gated_delta_decode(*split(convolved), g, beta, ref_states, slots, gate_norm=gate_norm, config=config)
    out = gated_delta_decode(*split(mixed), g, beta, states, slots, gate_norm=gate_norm, config=config,
                             conv=(mixed, weight, conv_states))
    assert torch.equal(out, want)
    assert torch.equal(states, ref_states)
    assert torch.equal(conv_states, ref_conv)
    assert not _counters(out.device).any()


def test_conv_is_refused_unless_q_k_v_are_views_of_its_input():
    mixed = torch.zeros(2, 40)
    q, k, v = torch.split(mixed, [8, 8, 24], dim=-1)
    q, k, v = q.reshape(2, 1, 8), k.reshape(2, 1, 8), v.reshape(2, 3, 8)
    weight, conv_states = torch.zeros(40, 4), torch.zeros(3, 40, 3)
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 3, 8, 8), torch.arange(2))
    with pytest.raises(ValueError, match=r"q, k, v views of mixed \(2, 40\)"):
        gated_delta_decode(q, k, v.clone(), *args, conv=(mixed, weight, conv_states))
    with pytest.raises(ValueError, match=r"states \(3, 40, 2\) \[S, C, K - 1\]"):
        gated_delta_decode(q, k, v, *args, conv=(mixed, weight, torch.zeros(3, 40, 2)))
    with pytest.raises(ValueError, match=r"one token per sequence"):
        gated_delta_decode(q, k, v, *args, torch.tensor([0, 1, 2]), conv=(mixed, weight, conv_states))


def test_gate_norm_is_refused_with_rows_or_a_mismatched_gate():
    q, v = torch.zeros(3, 1, 8), torch.zeros(3, 2, 8)
    args = (q, q, v, torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(4, 2, 8, 8), torch.arange(3))
    with pytest.raises(ValueError, match=r"gate norm takes one token per sequence"):
        gated_delta_decode(*args, torch.tensor([0, 1, 2, 3]), gate_norm=(v, torch.ones(8), 1e-6))
    with pytest.raises(ValueError, match=r"z \(3, 2, 4\) as v \(3, 2, 8\)"):
        gated_delta_decode(*args, gate_norm=(torch.zeros(3, 2, 4), torch.ones(8), 1e-6))
    with pytest.raises(ValueError, match=r"weight \(4,\) \[8\]"):
        gated_delta_decode(*args, gate_norm=(v, torch.ones(4), 1e-6))


def test_bad_state_shape_is_named():
    q = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="states"):
        gated_delta_decode(q, q, torch.zeros(1, 2, 8), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(3, 2, 8, 9),
                           torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("qk_normed", [False, True], ids=["norm in kernel", "qk_normed"])
@pytest.mark.parametrize("config", [None, {"block_v": 16, "num_warps": 4}, {"block_v": 8, "num_warps": 1}])
@pytest.mark.parametrize("lengths", [[5, 1, 9], [1], [3, 2, 0, 7, 1]])
def test_rows_run_in_order_from_each_slot(lengths, config, qk_normed):
    """bounds: each sequence's rows token by token from its slot's state, as the plain recurrence runs them; each
    row's inputs loaded while the row before runs (the prefetch past a sequence's last row, and an empty
    sequence's only one, masked off: its slot left as it was)."""
    hk, hv, dk, dv = 2, 4, 16, 24
    gen = torch.Generator().manual_seed(sum(lengths))
    n = sum(lengths)
    conv_out = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen)
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    if qk_normed:  # as the prefill conv writes them: q | k planes, each head L2-normed
        q, k = naive_l2_norm(q, 1e-6), naive_l2_norm(k, 1e-6)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    states = torch.randn(6, hv, dk, dv, generator=gen) * 0.1
    slots = torch.randperm(6, generator=gen)[: len(lengths)]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    before = states.clone()
    out = gated_delta_decode(q, k, v, g, beta, states, slots, bounds, qk_normed=qk_normed, config=config)
    want_states = before.clone()
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b].item(), bounds[b + 1].item()
        want, final = naive_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], before[slot],
                                             qk_normed)
        torch.testing.assert_close(out[lo:hi], want, atol=2e-5, rtol=2e-5)
        want_states[slot] = final
    torch.testing.assert_close(states, want_states, atol=2e-5, rtol=2e-5)
    # The reference with bounds (the rows path's own) says the same.
    ref_states = before.clone()
    torch.testing.assert_close(naive_gated_delta_decode(q, k, v, g, beta, ref_states, slots, bounds, qk_normed), out,
                               atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref_states, states, atol=2e-5, rtol=2e-5)


def test_bounds_must_match_the_slots():
    q = torch.zeros(3, 1, 8)
    with pytest.raises(ValueError, match="bounds"):
        gated_delta_decode(q, q, torch.zeros(3, 2, 8), torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 2, 8, 8),
                           torch.zeros(2, dtype=torch.long), torch.tensor([0, 3]))


def test_config_picks_the_entry_of_the_call_and_overrides_one_call_only(monkeypatch):
    """The batch decides the entry (SMALL_BATCH), bounds the rows one; config= changes that launch, not the table."""
    from headroom.kernels import gdn_decode

    launched = []
    monkeypatch.setattr(gdn_decode, "gated_delta_decode_fwd_kernel",
                        type("K", (), {"__getitem__": lambda self, grid: lambda *a, **kw: launched.append((grid, kw))})())
    before = {name: dict(entry) for name, entry in CONFIGS.items()}

    def call(num_seqs, bounds=None, config=None, gated=False):
        q, v = torch.zeros(num_seqs, 1, 8), torch.zeros(num_seqs, 2, 64)
        gate_norm = (v, torch.ones(64), 1e-6) if gated else None
        gated_delta_decode(q, q, v, torch.zeros(num_seqs, 2), torch.zeros(num_seqs, 2), torch.zeros(20, 2, 8, 64),
                           torch.arange(num_seqs), bounds, config=config, gate_norm=gate_norm)
        grid, kw = launched.pop()
        return grid[2], kw["BLOCK_V"], kw["num_warps"]

    def entry(name):
        cfg = CONFIGS[name]
        return -(-64 // cfg["block_v"]), cfg["block_v"], cfg["num_warps"]

    assert call(SMALL_BATCH - 1) == entry("decode_small")
    assert call(SMALL_BATCH) == entry("decode")
    assert call(2, torch.tensor([0, 1, 2])) == entry("rows")
    assert call(1, config={"block_v": 8, "num_warps": 1}) == (8, 8, 1)
    # The gate norm keeps the batch's entry.
    assert call(SMALL_BATCH, gated=True) == entry("decode")
    assert call(1, gated=True) == entry("decode_small")
    assert CONFIGS == before


def _loop_body(ptx: str) -> str:
    """The PTX between the row loop's label and its backward branch (the one loop of a rows or tail kernel)."""
    import re

    for label in re.findall(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        start = ptx.index(label + ":")
        back = ptx.find(f"bra.uni \t{label};", start)
        back = back if back >= 0 else ptx.find(f"bra \t{label};", start)
        if back > start:
            return ptx[start:back]
    raise AssertionError("no backward branch in the PTX")


def test_token_by_token_kernels_compile_for_the_h200_with_the_next_row_loaded_first():
    """Every QK_NORMED variant of the decode step, its rows path and the tail compiles for sm_90 at the 4B shapes;
    in the rows and tail loops a row's first global load (the next row's inputs) comes before its first shuffle
    (the math's reductions), so the prefetch is not undone by the compiler; normed q/k drop the norms' shuffles."""
    bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    shape = dict(GROUP=2, DK=128, DV=128, BLOCK_K=128, BLOCK_V=8, PDL=True)
    decode = dict(q=bf, k=bf, v=bf, g=f32, beta=bf, states=f32, slots=i64, bounds=i64, out=bf, neg_a=f32, dt_bias=bf,
                  z=bf, norm_w=bf, conv_w=bf, conv_states=bf, scale="fp32", eps="fp32")
    tail = dict(q=bf, k=bf, v=bf, g=f32, beta=bf, states=f32, out=bf, pool=f32, row_lo=i32, row_hi=i32, snap_at=i32,
                snap_slot=i32, scale="fp32")
    variants = [("gated_delta_decode_fwd_kernel", decode, {**shape, "ROWS": rows, "QK_NORMED": normed,
                                                            "RAW_GATES": False})
                for rows in (False, True) for normed in (False, True)]
    # The graphs' step with its gates made in the kernel (g and beta pointers then hold the raw bf16 a and b).
    variants.append(("gated_delta_decode_fwd_kernel", {**decode, "g": bf},
                     {**shape, "ROWS": False, "QK_NORMED": False, "RAW_GATES": True}))
    # ... and with the gated output norm, the head's value blocks meeting at the last (BLOCK_V 8: 16 blocks) or a
    # program a whole head.
    variants += [("gated_delta_decode_fwd_kernel", {**decode, "g": bf, "ws": f32, "counters": i32},
                  {**shape, "BLOCK_V": block_v, "ROWS": False, "QK_NORMED": False, "RAW_GATES": True,
                   "GATE_NORM": True, "HEAD_BLOCK": 128}) for block_v in (8, 128)]
    # ... and with the short conv of its inputs in the step too (the key heads' carried inputs rolled by the last).
    variants.append(("gated_delta_decode_fwd_kernel", {**decode, "g": bf, "ws": f32, "counters": i32},
                     {**shape, "BLOCK_V": 64, "ROWS": False, "QK_NORMED": False, "RAW_GATES": True,
                      "GATE_NORM": True, "HEAD_BLOCK": 128, "CONV": True, "CONV_TAPS": 4, "CONV_BLOCK": 4}))
    variants += [("gated_delta_tail_fwd_kernel", tail, {**shape, "MAX_SNAPS": 8, "QK_NORMED": normed})
                 for normed in (False, True)]
    results = compile_sm90([("headroom.kernels.gdn_decode", name, pointers, constants)
                            for name, pointers, constants in variants], num_warps=1)
    shuffles = {}
    for (name, _, constants), result in zip(variants, results, strict=True):
        assert result["ok"], (name, constants, result.get("error"))
        if name == "gated_delta_decode_fwd_kernel" and not constants["ROWS"]:
            continue
        body = _loop_body(result["ptx"])
        assert -1 < body.find("ld.global") < body.find("shfl.sync"), (name, constants)
        shuffles[name, constants["QK_NORMED"]] = body.count("shfl.sync")
    for name in ("gated_delta_decode_fwd_kernel", "gated_delta_tail_fwd_kernel"):
        assert shuffles[name, True] < shuffles[name, False], shuffles
