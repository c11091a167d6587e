"""Fused norm, rotary and gate kernels (Triton interpreter on CPU) against their naive_* references, at small
odd shapes. fp32 inputs: the interpreter's fp32 -> bf16 cast truncates, so bf16 rounding is checked on the GPU
(bench/engine_speed.py's kernel section)."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.gates import naive_gdn_gates, naive_sigmoid_mul, naive_silu_mul
from headroom.kernels.gates_triton import gdn_gates, sigmoid_mul, silu_mul
from headroom.kernels.norm import naive_add_rms_norm, naive_gated_rms_norm, naive_rms_norm
from headroom.kernels.norm_triton import gated_rms_norm, rms_norm
from headroom.kernels.rotary import naive_rms_norm_rotary, rotary_inv_freq
from headroom.kernels.rotary_triton import rms_norm_rotary

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("tokens,dim", [(3, 37), (5, 160), (1, 8)])
def test_rms_norm_and_residual_step(tokens, dim, unit_offset):
    gen = _gen(dim)
    x, delta, w = torch.randn(tokens, dim, generator=gen), torch.randn(tokens, dim, generator=gen), torch.randn(dim, generator=gen)
    out, summed = rms_norm(x, w, 1e-6, unit_offset)
    assert summed is None
    torch.testing.assert_close(out, naive_rms_norm(x, w, 1e-6, unit_offset), **TOL)
    out, summed = rms_norm(x, w, 1e-6, unit_offset, delta=delta)
    want, want_sum = naive_add_rms_norm(delta, x, w, 1e-6, unit_offset)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(summed, want_sum, **TOL)


def test_rms_norm_reads_strided_heads():
    """q heads cut out of a wider projection ([T, H, 2D] chunked): rows strided, output contiguous."""
    gen = _gen(1)
    wide = torch.randn(4, 3, 2 * 24, generator=gen)
    q = wide.chunk(2, dim=-1)[0]
    w = torch.randn(24, generator=gen)
    out, _ = rms_norm(q, w, 1e-6, True)
    assert out.is_contiguous()
    torch.testing.assert_close(out, naive_rms_norm(q, w, 1e-6, True), **TOL)


@pytest.mark.parametrize("rotary_dim,dim", [(8, 24), (24, 24), (16, 40)])
@pytest.mark.parametrize("unit_offset", [True, False])
def test_rms_norm_rotary(rotary_dim, dim, unit_offset):
    gen = _gen(rotary_dim + dim)
    wide = torch.randn(5, 3, 2 * dim, generator=gen)
    x = wide.chunk(2, dim=-1)[1]
    w = torch.randn(dim, generator=gen)
    positions = torch.tensor([0, 7, 300, 4097, 65539])
    inv_freq = rotary_inv_freq(rotary_dim, 1e6)
    got = rms_norm_rotary(x, w, 1e-6, unit_offset, positions, inv_freq)
    torch.testing.assert_close(got, naive_rms_norm_rotary(x, w, 1e-6, unit_offset, positions, inv_freq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads,dim,rotary_dim", [(5, 24, 8), (1, 40, 16), (8, 16, 16), (3, 128, 64)], ids=str)
@pytest.mark.parametrize("config", [None, (1, 4), (2, 4), (4, 8)], ids=str)
def test_rms_norm_rotary_head_tiles(heads, dim, rotary_dim, config):
    """BLOCK_H heads of one token a program: head counts not a multiple of the tile, one head, head_dim not a
    power of two; rows strided (heads cut out of a wider projection)."""
    gen = _gen(heads * 1000 + dim)
    x = torch.randn(3, heads, 2 * dim, generator=gen)[..., dim:]
    w = torch.randn(dim, generator=gen)
    positions, inv_freq = torch.tensor([2, 300, 32769]), rotary_inv_freq(rotary_dim, 1e6)
    got = rms_norm_rotary(x, w, 1e-6, False, positions, inv_freq, config=config)
    assert got.is_contiguous()
    torch.testing.assert_close(got, naive_rms_norm_rotary(x, w, 1e-6, False, positions, inv_freq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", [None, (1, 4), (4, 2), (16, 4), (64, 8)], ids=str)
@pytest.mark.parametrize("shape", [(7, 3, 20), (1, 1, 20), (13, 5, 32), (9, 24)], ids=str)
def test_gated_rms_norm(shape, config):
    """Row blocks over odd row counts (a partial last block), one row, [T, D] and [T, H, D]."""
    gen = _gen(2)
    x, gate, w = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.randn(shape[-1], generator=gen)
    got = gated_rms_norm(x, gate, w, 1e-6, config=config)
    torch.testing.assert_close(got, naive_gated_rms_norm(x, gate, w, 1e-6), **TOL)


def test_gated_rms_norm_strided_gate():
    """z cut from the merged in-projection (rows of [T, wider] viewed as [T, H, D]) is read in place, as x may be;
    more rows than GATED_MANY_ROWS take the row-block config."""
    from headroom.kernels.norm_triton import GATED_MANY_ROWS

    gen = _gen(4)
    tokens, heads, dim = GATED_MANY_ROWS // 4 + 3, 4, 16
    wide = torch.randn(tokens, heads * dim + 40, generator=gen)
    gate = wide[:, 8 : 8 + heads * dim].view(tokens, heads, dim)
    x = torch.randn(tokens, 2 * heads * dim, generator=gen)[:, : heads * dim].view(tokens, heads, dim)
    w = torch.randn(dim, generator=gen)
    got = gated_rms_norm(x, gate, w, 1e-6)
    assert got.is_contiguous()
    torch.testing.assert_close(got, naive_gated_rms_norm(x, gate, w, 1e-6), **TOL)
    # A 4-d input (no [T, H, D] view) is still right.
    x4, g4 = x.reshape(tokens, 2, 2, dim), gate.reshape(tokens, 2, 2, dim)
    torch.testing.assert_close(gated_rms_norm(x4, g4, w, 1e-6, config=(8, 4)), naive_gated_rms_norm(x4, g4, w, 1e-6), **TOL)


def test_gates():
    gen = _gen(3)
    g, u = torch.randn(5, 1500, generator=gen), torch.randn(5, 1500, generator=gen)
    torch.testing.assert_close(silu_mul(g, u), naive_silu_mul(g, u), **TOL)
    # Column views of one merged gate|up GEMM output (strided rows).
    g, u = torch.randn(5, 3000, generator=gen).split(1500, dim=-1)
    torch.testing.assert_close(silu_mul(g, u), naive_silu_mul(g, u), **TOL)
    # The even and odd columns of an interleaved gate|up GEMM output (engine/layers/mlp.py, read as pairs; with
    # strided rows and a ragged last block), and two other stride-2 views (two loads).
    y = torch.randn(5, 3010, generator=gen)[:, 4:]
    torch.testing.assert_close(silu_mul(y[:, 0::2], y[:, 1::2]), naive_silu_mul(y[:, 0::2], y[:, 1::2]), **TOL)
    a, b = torch.randn(5, 3000, generator=gen), torch.randn(5, 3000, generator=gen)
    torch.testing.assert_close(silu_mul(a[:, 0::2], b[:, 1::2]), naive_silu_mul(a[:, 0::2], b[:, 1::2]), **TOL)
    x = torch.randn(6, 3 * 20, generator=gen)
    gate = torch.randn(6, 3, 40, generator=gen).chunk(2, dim=-1)[1]
    torch.testing.assert_close(sigmoid_mul(x, gate), naive_sigmoid_mul(x, gate), **TOL)


def test_gdn_gates_cover_softplus_range():
    """a + dt_bias from -30 (log1p of a tiny exp) through 0 to past softplus's threshold of 20."""
    heads = 5
    a = torch.linspace(-30, 30, 7 * heads).reshape(7, heads)
    b = torch.randn(7, heads, generator=_gen(4)) * 8
    neg_a, dt_bias = -torch.rand(heads, generator=_gen(5)) * 3, torch.randn(heads, generator=_gen(6))
    beta, g = gdn_gates(b, a, neg_a, dt_bias)
    want_beta, want_g = naive_gdn_gates(b, a, neg_a, dt_bias)
    assert g.dtype == torch.float32
    torch.testing.assert_close(beta, want_beta, **TOL)
    torch.testing.assert_close(g, want_g, atol=1e-6, rtol=1e-5)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6, True)
    with pytest.raises(ValueError, match="delta"):
        rms_norm(torch.zeros(2, 8), torch.zeros(8), 1e-6, True, delta=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="positions"):
        rms_norm_rotary(torch.zeros(2, 1, 8), torch.zeros(8), 1e-6, True, torch.zeros(3, dtype=torch.long), torch.zeros(2))
    with pytest.raises(ValueError, match="silu_mul"):
        silu_mul(torch.zeros(2, 8), torch.zeros(2, 9))


@pytest.mark.parametrize("tokens,heads,dim", [(3, 2, 16), (37, 3, 24), (1, 1, 128)])
def test_l2_norm_of_strided_heads(tokens, heads, dim):
    """Gated DeltaNet's q/k norm (eps inside the root, as fla and naive_gated_delta_rule): heads cut out of a
    wider [T, H, 2D] tensor, so rows are strided; more rows than one program's block."""
    from headroom.kernels.norm import naive_l2_norm
    from headroom.kernels.norm_triton import l2_norm

    q = torch.randn(tokens, heads, 2 * dim, generator=_gen(dim))[..., :dim]
    out = l2_norm(q, 1e-6)
    assert out.is_contiguous() and out.shape == q.shape
    torch.testing.assert_close(out, naive_l2_norm(q, 1e-6), **TOL)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(tokens, heads), **TOL)


@pytest.mark.parametrize("unit_offset", [True, False])
def test_qk_norm_rotary_store_matches_the_two_norms_and_the_row_stores(unit_offset):
    """q's heads then k's in one launch, k and v rows into the pool at the tokens' rows (strided q/k/v views of a
    fused projection, as the attention layer passes them); the pool's other rows untouched."""
    from headroom.kernels.rotary import naive_qk_norm_rotary_store
    from headroom.kernels.rotary_triton import qk_norm_rotary_store

    gen = _gen(11)
    tokens, hq, hkv, dim = 5, 6, 2, 24
    fused = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen)
    q, k, v = (part.view(tokens, -1, dim) for part in fused.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    wq, wk = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    positions, inv_freq = torch.tensor([3, 9, 40, 41, 1000]), rotary_inv_freq(16, 1e6)
    rows = torch.tensor([17, 2, 30, 9, 0])
    pools = [torch.randn(32, hkv, dim, generator=gen) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    got = qk_norm_rotary_store(q, k, v, wq, wk, 1e-6, unit_offset, positions, inv_freq, *pools, rows)
    want = naive_qk_norm_rotary_store(q, k, v, wq, wk, 1e-6, unit_offset, positions, inv_freq, *want_pools, rows)
    for a, b in zip((*got, *pools), (*want, *want_pools), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(pools[1][rows], v)


@pytest.mark.parametrize("hq,hkv,dim,rotary_dim", [(3, 1, 24, 8), (5, 2, 40, 16), (16, 4, 32, 32), (2, 2, 8, 8)], ids=str)
@pytest.mark.parametrize("config", [None, (1, 4), (2, 4), (4, 2)], ids=str)
def test_qk_norm_rotary_store_head_tiles(hq, hkv, dim, rotary_dim, config):
    """Programs of BLOCK_H heads of one token: head counts that are not a multiple of the tile (the last tile's
    heads past the count masked, q's and k's tiles apart), head_dim not a power of two (BLOCK_D's masked
    channels), whole and partial rotary; strided q/k/v views and a strided pool, whose other rows stay as they
    were."""
    from headroom.kernels.rotary import naive_qk_norm_rotary_store
    from headroom.kernels.rotary_triton import qk_norm_rotary_store

    gen = _gen(hq * 100 + hkv * 10 + dim)
    tokens = 4
    fused = torch.randn(tokens, (hq + 2 * hkv) * dim + 8, generator=gen)[:, 8:]
    q, k, v = (part.view(tokens, -1, dim) for part in fused.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    wq, wk = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    positions, inv_freq = torch.tensor([0, 5, 4097, 65539]), rotary_inv_freq(rotary_dim, 1e6)
    rows = torch.tensor([6, 1, 3, 0])
    pools = [torch.randn(8, 2, hkv, dim, generator=gen)[:, 1] for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    got = qk_norm_rotary_store(q, k, v, wq, wk, 1e-6, True, positions, inv_freq, *pools, rows, config=config)
    want = naive_qk_norm_rotary_store(q, k, v, wq, wk, 1e-6, True, positions, inv_freq, *want_pools, rows)
    for a, b in zip((*got, *pools), (*want, *want_pools), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(pools[1][rows], v)


@pytest.mark.parametrize("bits", [4, 2])
def test_qk_norm_rotary_store_closes_the_pages_its_tokens_fill(bits):
    """A graphed KIVI decode step's store (paged_kv.PageClose): three tokens into window rows 2, 1 and 0 of a
    [3 x 32]-token window, the first and third at their page's last slot (pool pages 1 and 3 close), the second
    mid-page (-1): after the launch the pool holds exactly what the reference close makes of the windows it left
    (codes and scales bit for bit), every other page untouched, and the stores are the naive ones."""
    from headroom.kernels.paged_kv import PageClose, naive_close_pages
    from headroom.kernels.rotary import naive_qk_norm_rotary_store
    from headroom.kernels.rotary_triton import qk_norm_rotary_store

    from tests.kernels.paged_pool import make_pool

    gen = _gen(30 + bits)
    tokens, hq, hkv, dim, page = 3, 4, 2, 64, 32
    q, k, v = (torch.randn(tokens, heads, dim, generator=gen) for heads in (hq, hkv, hkv))
    wq, wk = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    positions, inv_freq = torch.tensor([95, 40, 31]), rotary_inv_freq(16, 1e6)
    window_rows, pages = torch.tensor([2, 1, 0]), torch.tensor([1, -1, 3])
    slots = window_rows * page + positions % page
    windows = [torch.randn(3 * page, hkv, dim, generator=gen) * 2 for _ in range(2)]
    want_windows = [w.clone() for w in windows]
    kv, _ = make_pool("kivi", bits, hkv, dim, [4 * page], torch.bfloat16)
    ref, _ = make_pool("kivi", bits, hkv, dim, [4 * page], torch.bfloat16)
    for pool in (kv, ref):
        for t in (pool.k, pool.v):
            t.fill_(7)
    got = qk_norm_rotary_store(q, k, v, wq, wk, 1e-6, True, positions, inv_freq, *windows, slots,
                               close=PageClose(kv, window_rows, pages))
    want = naive_qk_norm_rotary_store(q, k, v, wq, wk, 1e-6, True, positions, inv_freq, *want_windows, slots)
    for a, b in zip((*got, *windows), (*want, *want_windows), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    naive_close_pages(PageClose(ref, window_rows, pages), *windows)
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(getattr(kv, name), getattr(ref, name)), name
    assert (kv.k[[0, 2]] == 7).all() and (kv.k[[1, 3]] != 7).any()


def test_a_page_close_for_other_tokens_is_refused():
    from headroom.kernels.paged_kv import PageClose
    from headroom.kernels.rotary_triton import qk_norm_rotary_store

    from tests.kernels.paged_pool import make_pool

    q, k = torch.zeros(2, 4, 64), torch.zeros(2, 2, 64)
    kv, _ = make_pool("kivi", 2, 2, 64, [64], torch.bfloat16)
    window = torch.zeros(64, 2, 64)
    with pytest.raises(ValueError, match="page close for 2 tokens: rows \\(3,\\)"):
        qk_norm_rotary_store(q, k, k, torch.ones(64), torch.ones(64), 1e-6, True, torch.tensor([1, 2]),
                             rotary_inv_freq(16, 1e6), window, window.clone(), torch.tensor([1, 2]),
                             close=PageClose(kv, torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long)))


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("close", [False, True])
def test_qk_norm_rotary_store_compiles_for_the_h200(pdl, close):
    """As the attention layer launches it over a bf16 pool's rows, and (close) into a graphed int2 step's windows with
    its page close (the 4B model's heads, pages of 32)."""
    from tests.kernels.sm90 import compile_sm90

    pointers = dict(q="*bf16", k="*bf16", v="*bf16", wq="*bf16", wk="*bf16", positions="*i64", inv_freq="*fp32",
                    q_out="*bf16", k_out="*bf16", pool_k="*bf16", pool_v="*bf16", rows="*i64", eps="fp32")
    constants = dict(BLOCK_H=4, BLOCK_D=256, VEC=2, UNIT_OFFSET=True, PDL=pdl)
    if close:
        pointers.update(close_rows="*i64", close_pages="*i64", k_packed="*u8", v_packed="*u8", k_scale="*fp16",
                        k_zero="*fp16", v_scale="*fp16", v_zero="*fp16", inv_levels="fp32")
        constants.update(CLOSE=True, HEAD_DIM=256, BITS=2, PAGE=32, GROUP_D=32, BLOCK_G=8, BLOCK_C=32, RECIPROCAL=True)
    [result] = compile_sm90([("headroom.kernels.rotary_triton", "qk_norm_rotary_store_fwd_kernel", pointers,
                              constants)])
    assert result["ok"], result.get("error")
    assert ("griddepcontrol.wait" in result["ptx"]) == pdl
