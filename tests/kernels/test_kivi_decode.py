"""kernels/kivi_decode.py (the Triton interpreter on CPU) against naive_paged_attention and against the general
paged kernel it replaces for KIVI decode launches."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels import paged_attention as pa
from headroom.kernels.paged_attention import kivi_decode_supported, naive_paged_attention, paged_attention
from headroom.kernels.paged_kv import PagedKV

from tests.kernels.paged_pool import make_pool


def _decode_batch(kv_lens, q_lens, num_q_heads, head_dim, dtype, seed=4):
    """The last q_len positions of each sequence (decode: q_len * group <= 16 rows a program)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(kv_lens, q_lens, strict=True)]).to(torch.int32)
    offsets = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, positions, offsets


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,seq_lens,closed,q_lens",
    [
        (2, 4, 64, [300], [288], [1]),                       # more than one tile of pages, a partly used last tile
        (1, 8, 64, [64, 7, 530, 33], [64, 0, 512, 32], [1, 1, 1, 1]),  # a sequence with no closed page
        (2, 4, 64, [100, 260], [96, 256], [2, 1]),           # two query tokens (8 rows), causal inside the range
        (1, 4, 256, [70], [64], [1]),                        # the 4B model's head
    ],
)
def test_matches_naive_and_the_general_kernel(monkeypatch, bits, dtype, num_kv_heads, group, head_dim, seq_lens,
                                              closed, q_lens):
    kv, table = make_pool("kivi", bits, num_kv_heads, head_dim, seq_lens, dtype)
    assert kivi_decode_supported(kv, head_dim)
    q, positions, offsets = _decode_batch(seq_lens, q_lens, num_kv_heads * group, head_dim, dtype)
    # The pool pass of a decode step: the closed pages only (the residual window is a pass of its own).
    args = (q, positions, offsets, table, torch.zeros(len(seq_lens), dtype=torch.int32),
            torch.tensor(closed, dtype=torch.int32), kv, head_dim**-0.5)
    ref, ref_lse = naive_paged_attention(*args)
    monkeypatch.setitem(pa.DECODE_TUNING, "kivi_decode", 0)
    general, general_lse = paged_attention(*args, num_splits=1)
    monkeypatch.delitem(pa.DECODE_TUNING, "kivi_decode")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for splits in (1, 3):
        out, lse = paged_attention(*args, num_splits=splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=1e-3)
        torch.testing.assert_close(out.float(), general.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, general_lse, atol=tol, rtol=1e-3)
    # A sequence without keys in range answers 0 and lse -inf, as the general kernel does.
    empty = [b for b, n in enumerate(closed) if n == 0]
    for b in empty:
        rows = slice(int(offsets[b]), int(offsets[b + 1]))
        assert (out[rows] == 0).all() and (lse[rows] == float("-inf")).all()


def test_sub_tile_sizes_agree(monkeypatch):
    """Tiles of one, two or four pages (the sweep's num_pages) give the same answer."""
    kv, table = make_pool("kivi", 2, 1, 64, [400], torch.float32, seed=6)
    q, positions, offsets = _decode_batch([400], [1], 4, 64, torch.float32)
    args = (q, positions, offsets, table, torch.zeros(1, dtype=torch.int32), torch.tensor([384], dtype=torch.int32), kv,
            0.125)
    results = []
    for pages in (2, 4, 8):
        monkeypatch.setitem(pa.DECODE_TUNING, "num_pages", pages)
        results.append(paged_attention(*args, num_splits=2))
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=1e-5)


def test_supported_geometries():
    kv, _ = make_pool("kivi", 2, 1, 64, [32], torch.float32)
    assert kivi_decode_supported(kv, 64)
    odd, _ = make_pool("kivi", 2, 1, 70, [32], torch.float32)
    assert not kivi_decode_supported(odd, 70)  # not a power of two: the general kernel reads it
    small, _ = make_pool("kivi", 4, 1, 32, [32], torch.float32)
    assert not kivi_decode_supported(small, 32)  # interleaved channel sets of 8 are below an MMA operand
    dense = PagedKV("dense", torch.zeros(4, 1, 64), torch.zeros(4, 1, 64))
    assert not kivi_decode_supported(dense, 64)
