"""kernels/dense_attention.py off the GPU: the reference it falls back to, the query buckets, the in-place merge.
cuDNN itself is checked on the H200 (bench/engine_speed.py kernels: _dense_attention_check)."""

from __future__ import annotations

import torch
from headroom.kernels import dense_attention as dense
from headroom.kernels.attention import naive_prefix_attention


def _qkv(rows: int, keys: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 4, 16, generator=gen), torch.randn(keys, 2, 16, generator=gen) * 2,
            torch.randn(keys, 2, 16, generator=gen))


def test_the_cpu_path_is_plain_causal_or_full_attention():
    q, k, v = _qkv(9, 9)
    out, _ = dense.dense_attention(q, k, v, True, 0.25)
    torch.testing.assert_close(out, naive_prefix_attention(q, k, v, torch.arange(9), 0.25))
    q, k, v = _qkv(5, 12)
    out, _ = dense.dense_attention(q, k, v, False, 0.25)
    torch.testing.assert_close(out, naive_prefix_attention(q, k, v, torch.full((5,), 11), 0.25))


def test_a_causal_block_needs_square_keys():
    q, k, v = _qkv(5, 6)
    try:
        dense.dense_attention(q, k, v, True, 0.25)
    except ValueError as exc:
        assert "6 != 5" in str(exc)
    else:
        raise AssertionError("accepted a causal block of 5 queries over 6 keys")


def test_merging_two_key_ranges_gives_attention_over_both():
    q, k, v = _qkv(7, 20, seed=1)
    acc, lse = dense.dense_attention(q, k[:12], v[:12], False, 0.3)
    acc = acc.float()
    part, part_lse = dense.dense_attention(q, k[12:], v[12:], False, 0.3)
    dense.merge(acc, lse, part, part_lse, acc, lse)
    want, want_lse = dense.dense_attention(q, k, v, False, 0.3)
    torch.testing.assert_close(acc, want.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_queries_pad_to_whole_buckets_and_nothing_is_available_off_the_gpu():
    assert dense.padded_rows(1) == dense.QUERY_BUCKET and dense.padded_rows(dense.QUERY_BUCKET + 1) == 2 * dense.QUERY_BUCKET
    assert not dense.available(torch.empty(1, 4, 16), 2)
    assert dense.warm_up(torch.device("cpu"), torch.float32, 4, 2, 16, 100) == 0
