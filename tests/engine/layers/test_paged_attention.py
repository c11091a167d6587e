"""paged_attention_over_pool (CPU, the naive ops) on a KIVI pool: the fused pass, the block path of a long chunk's
prefix and the residual window chained, against plain attention over each sequence's dequantized context."""

from __future__ import annotations

import os

import pytest
import torch
from headroom.engine.layers import paged_attention as layer
from headroom.engine.runtime.forward_batch import BatchItem, ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.engine.sequence import Sequence
from headroom.kernels import paged_kv
from headroom.kernels.attention import naive_prefix_attention

HEADS, KV_HEADS, DIM = 8, 2, 64


def _batch_over_pool(kv_dtype: str) -> tuple[KVPool, ForwardBatch, torch.Tensor]:
    """A 100-token chunk after 100 cached tokens, beside a decode step after 70: K/V stored, q random."""
    gen = torch.Generator().manual_seed(7)
    pool = KVPool(512, 1, KV_HEADS, DIM, kv_dtype, torch.float32, torch.device("cpu"), residual_rows=2)
    long, short = Sequence("long", list(range(300))), Sequence("short", list(range(71)))
    long.kv_slots, short.kv_slots = list(range(0, 224)), list(range(256, 352))
    for seq, done, new in ((long, 100, 100), (short, 70, 1)):
        k = torch.randn(done + new, KV_HEADS, DIM, generator=gen) * 2
        v = torch.randn(done + new, KV_HEADS, DIM, generator=gen)
        pool.store(0, seq, 0, k[:done], v[:done])
        seq.num_computed_tokens = done
        pool.store(0, seq, done, k[done:], v[done:])
    batch = ForwardBatch.build([BatchItem(long, list(range(100))), BatchItem(short, [5])], torch.device("cpu"))
    return pool, batch, torch.randn(101, HEADS, DIM, generator=gen)


def _reference(pool: KVPool, batch: ForwardBatch, q: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(q)
    for span in batch.spans:
        rows = slice(span.offset, span.offset + span.length)
        k, v = pool.context(0, span.seq, span.end)
        out[rows] = naive_prefix_attention(q[rows], k, v, batch.positions[rows], DIM**-0.5)
    return out


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
@pytest.mark.parametrize("workspace", [64, 96, 16384])
def test_block_path_and_window_chain_to_plain_attention(monkeypatch, kv_dtype, workspace):
    # The 100-token chunk (400 query rows) takes the block path at this threshold; its 192 closed keys are 3, 2 or
    # 1 blocks of the workspace; the decode step reads its 64 closed keys fused; both have open pages.
    monkeypatch.setattr(paged_kv, "BLOCKWISE_MIN_ROWS", 256)
    monkeypatch.setattr(paged_kv, "BLOCKWISE_WORKSPACE_TOKENS", workspace)
    pool, batch, q = _batch_over_pool(kv_dtype)
    kv = layer.PagedKV.from_store(pool.layers[0], pool.kv_dtype, pool.bits, pool.page_tokens, pool.value_group)
    blocks = batch.cached("paged_attention.blocks", lambda: layer._prefix_blocks(
        batch, [192, 64], kv, HEADS // KV_HEADS, q.device))
    assert blocks is not None and len(blocks.lens) == -(-192 // min(workspace, 16384))
    assert blocks.direct_lens.tolist() == [0, 64]
    got = layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5)
    torch.testing.assert_close(got, _reference(pool, batch, q), atol=1e-5, rtol=1e-5)


def test_without_the_block_path_the_answer_is_the_same(monkeypatch):
    pool, batch, q = _batch_over_pool("int4")
    monkeypatch.setattr(paged_kv, "BLOCKWISE_MIN_ROWS", 256)
    with_blocks = layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5)
    monkeypatch.setattr(paged_kv, "BLOCKWISE_MIN_ROWS", 10**9)
    _, batch, _ = _batch_over_pool("int4")
    fused = layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5)
    assert batch.cached("paged_attention.blocks", lambda: "unset") is None
    torch.testing.assert_close(with_blocks, fused, atol=1e-5, rtol=1e-5)


def test_plan_prefix_blocks_shares_the_workspace_in_whole_pages():
    plan = paged_kv.plan_prefix_blocks([4096, 1, 2048], [8192, 300, 4064], 4, 32, 256, 32, workspace_tokens=16384)
    assert plan is not None
    # Two long chunks share 16,384 tokens: 8,192 each; the decode step stays on the fused pass.
    assert plan.block_tokens == 8192 and plan.ws_rows == [0, 0, 1] and plan.direct_lens == [0, 300, 0]
    assert plan.block_lens == [[8192, 0, 4064]]
    odd = paged_kv.plan_prefix_blocks([4096, 4096, 4096], [100 * 32, 64, 0], 4, 32, 128, 32, workspace_tokens=1000)
    # 1000 // 2 long sequences (the third has no prefix) = 500 -> 480 tokens, 15 pages a block.
    assert odd is not None and odd.block_tokens == 480 and len(odd.block_lens) == 7
    assert [lens[0] for lens in odd.block_lens] == [480] * 6 + [320] and odd.block_lens[0][1] == 64
    assert paged_kv.plan_prefix_blocks([1, 1], [64, 64], 4, 32, 256, 32) is None
    # Heads the block dequantizer cannot tile (the value group must divide the head padded to a power of two, at
    # least 16): the fused kernel reads those prefixes, as the default model's 16-dim heads with 32-channel groups.
    for head_dim, value_group in ((16, 32), (8, 32), (96, 48)):
        assert paged_kv.plan_prefix_blocks([4096], [8192], 4, 32, head_dim, value_group) is None
    assert paged_kv.plan_prefix_blocks([4096], [8192], 4, 32, 70, 32) is not None


def _dense_batch(start: int, length: int, gen: torch.Generator):
    """A bf16-format pool (fp32 here) holding a `length`-token chunk after `start` cached tokens, beside a decode
    step after 70: K/V stored; returns the pool, the batch, q and the pass's own K/V."""
    pool = KVPool(512, 1, KV_HEADS, DIM, "auto", torch.float32, torch.device("cpu"))
    long, short = Sequence("long", list(range(start + length + 1))), Sequence("short", list(range(71)))
    long.kv_slots, short.kv_slots = list(range(400, 400 - start - length, -1)), list(range(0, 71))
    chunk_k, chunk_v = [], []
    for seq, done, new in ((long, start, length), (short, 70, 1)):
        k = torch.randn(done + new, KV_HEADS, DIM, generator=gen) * 2
        v = torch.randn(done + new, KV_HEADS, DIM, generator=gen)
        pool.store(0, seq, 0, k, v)
        seq.num_computed_tokens = done
        chunk_k.append(k[done:])
        chunk_v.append(v[done:])
    batch = ForwardBatch.build([BatchItem(long, list(range(length))), BatchItem(short, [5])], torch.device("cpu"))
    q = torch.randn(length + 1, HEADS, DIM, generator=gen)
    return pool, batch, q, (torch.cat(chunk_k), torch.cat(chunk_v))


def _dense_path_on(monkeypatch, prefix_block: int) -> list[tuple[int, bool]]:
    """The dense path on at test sizes (8-row spans, prefix_block-key blocks), cuDNN's CPU reference standing in for
    it and returning its layouts ([1, H, L, D], [1, H, L, 1]) through the same conversion; the (keys, causal) of
    every call are appended to the list returned."""
    from headroom.kernels import dense_attention

    monkeypatch.setattr(layer, "DENSE_MIN_ROWS", 8)
    monkeypatch.setattr(layer, "DENSE_ATTENTION", True)
    monkeypatch.setattr(dense_attention, "PREFIX_BLOCK", prefix_block)
    monkeypatch.setattr(dense_attention, "available", lambda q, heads: True)
    calls: list[tuple[int, bool]] = []
    real = dense_attention.dense_attention

    def as_cudnn_returns(q, k, v, causal, scale):
        calls.append((k.shape[0], causal))
        out, lse = real(q, k, v, causal, scale)
        return dense_attention.to_rows(out.transpose(0, 1)[None].contiguous(), lse.t()[None, ..., None].contiguous())

    monkeypatch.setattr(dense_attention, "dense_attention", as_cudnn_returns)
    return calls


@pytest.mark.parametrize("start", [0, 5, 16, 32, 40, 53])
def test_long_spans_on_the_dense_path_equal_plain_attention(monkeypatch, start):
    """The dense path's pieces (causal block, whole prefix blocks, the paged kernel's partial block, merged) give
    the attention of the whole context; the short span beside it goes through the paged kernel as before."""

    calls = _dense_path_on(monkeypatch, prefix_block=16)
    paged = layer.ops.paged_attention

    def checked_paged(*args, prev=None, **kwargs):
        # The GPU kernel's contract for a continued range (kernels/paged_attention.py), which the CPU path skips.
        assert prev is None or (prev[0].stride(-1) == 1 and prev[1].is_contiguous() and prev[1].dtype == torch.float32)
        return paged(*args, prev=prev, **kwargs)

    monkeypatch.setattr(layer.ops, "paged_attention", checked_paged)
    pool, batch, q, chunk_kv = _dense_batch(start, 30, torch.Generator().manual_seed(start))
    got = layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5, chunk_kv)
    torch.testing.assert_close(got, _reference(pool, batch, q), atol=1e-5, rtol=1e-5)
    # One causal block of the chunk's 30 keys, then one dense call per whole 16-key block of the prefix.
    assert calls == [(30, True)] + [(16, False)] * (start // 16)
    # The next layer of the pass reuses the span's prefix index (built once a pass) and gives the same answer.
    prefix = batch.cached(f"{layer.DENSE_PREFIX}.0", lambda: None)
    assert prefix is not None and len(prefix.blocks) == start // 16 and (prefix.partial is None) == (start % 16 == 0)
    torch.testing.assert_close(layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5, chunk_kv), got)


@pytest.mark.parametrize(("start", "end", "want"), [
    # the first chunk: its own keys only (an open page of 18 keys after them)
    (0, 50, ((0, 50), (), None, 18, 50)),
    # own keys plus two whole 64-key prefix blocks
    (128, 192, ((128, 64), (0, 64), None, 0, 64)),
    # the prefix's last 32 keys are no whole block: the paged kernel's rest
    (160, 224, ((160, 64), (0, 64), (128, 32), 0, 64)),
    # a chunk starting mid-page: its own keys take the workspace from their first page on (72: 128..199); the
    # rest's keys 128..149 take their page whole (128..159)
    (150, 200, ((150, 50), (0, 64), (128, 22), 8, 72)),
    (100, 200, ((100, 100), (0,), (64, 36), 8, 104)),
])
def test_plan_kivi_dense_gives_cudnn_the_chunk_and_whole_blocks_and_the_paged_kernel_the_rest(start, end, want):
    plan = layer.plan_kivi_dense(start, end, 32, 64, 128)
    assert plan is not None and (plan.own, plan.blocks, plan.rest, plan.window, plan.workspace_tokens) == want


def test_plan_kivi_dense_declines_what_the_workspace_cannot_hold():
    assert layer.plan_kivi_dense(0, 128, 32, 64, 128) is not None
    assert layer.plan_kivi_dense(0, 129, 32, 64, 128) is None  # own keys past the workspace
    assert layer.plan_kivi_dense(10, 130, 32, 64, 128) is None  # 0..129 from their first page
    assert layer.plan_kivi_dense(0, 64, 32, 256, 128) is not None  # no whole block yet: the block size is moot
    assert layer.plan_kivi_dense(256, 300, 32, 256, 128) is None  # a 256-key block past it
    assert layer.plan_kivi_dense(0, 64, 32, 48, 128) is None  # cuDNN blocks not whole pages


def _kivi_batch(kv_dtype: str, start: int, length: int, gen: torch.Generator):
    """A KIVI pool (32-token pages) holding a `length`-token chunk after `start` cached tokens, beside a decode step
    after 70; returns the pool, the batch and q."""
    pool = KVPool(1024, 1, KV_HEADS, DIM, kv_dtype, torch.float32, torch.device("cpu"), residual_rows=2)
    long, short = Sequence("long", list(range(start + length + 1))), Sequence("short", list(range(71)))
    long.kv_slots, short.kv_slots = list(range(0, 512)), list(range(512, 608))
    for seq, done, new in ((long, start, length), (short, 70, 1)):
        k = torch.randn(done + new, KV_HEADS, DIM, generator=gen) * 2
        v = torch.randn(done + new, KV_HEADS, DIM, generator=gen)
        pool.store(0, seq, 0, k[:done], v[:done])
        seq.num_computed_tokens = done
        pool.store(0, seq, done, k[done:], v[done:])
    batch = ForwardBatch.build([BatchItem(long, list(range(length))), BatchItem(short, [5])], torch.device("cpu"))
    return pool, batch, torch.randn(length + 1, HEADS, DIM, generator=gen)


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
@pytest.mark.parametrize(("start", "length"), [(0, 64), (0, 50), (128, 64), (160, 64), (128, 50), (150, 50),
                                                (100, 100), (32, 40)])
def test_long_kivi_spans_on_the_dense_path_equal_plain_attention(monkeypatch, kv_dtype, start, length):
    """A long KIVI chunk's ranges made dense in the workspace (closed pages dequantized, the open page's keys
    copied) and read by cuDNN (here its CPU reference) and the paged kernel, merged, give attention over the
    sequence's dequantized context, whether the chunk starts or ends mid-page; the decode step beside it takes the
    paged passes."""

    monkeypatch.setattr(paged_kv, "BLOCKWISE_WORKSPACE_TOKENS", 128)
    calls = _dense_path_on(monkeypatch, prefix_block=64)
    pool, batch, q = _kivi_batch(kv_dtype, start, length, torch.Generator().manual_seed(start + length))
    got = layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5)
    torch.testing.assert_close(got, _reference(pool, batch, q), atol=1e-5, rtol=1e-5)
    plan = layer.plan_kivi_dense(start, start + length, 32, 64, 128)
    assert plan is not None and calls == [(length, True)] + [(64, False)] * len(plan.blocks)
    assert list(batch.cached(layer.KIVI_DENSE, lambda: None)) == [0]
    # The next layer reuses the pass's index and gives the same answer.
    torch.testing.assert_close(layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5), got)


@pytest.mark.parametrize("kv_dtype", ["auto", "int2"])
def test_the_dense_path_switched_off_takes_the_paged_kernel(monkeypatch, kv_dtype):
    """The dense path is on by default (since session 19: layer.DENSE_ATTENTION says why); with
    HEADROOM_DENSE_ATTENTION=0 long spans take the paged kernel: no cuDNN call, the same answer."""
    from headroom.kernels import dense_attention

    assert layer.DENSE_ATTENTION is (os.environ.get("HEADROOM_DENSE_ATTENTION", "1") == "1")
    monkeypatch.setattr(layer, "DENSE_ATTENTION", False)
    monkeypatch.setattr(layer, "DENSE_MIN_ROWS", 8)
    monkeypatch.setattr(dense_attention, "available", lambda q, heads: True)
    calls = []
    monkeypatch.setattr(dense_attention, "dense_attention", lambda *args: calls.append(args))
    if kv_dtype == "auto":
        pool, batch, q, chunk_kv = _dense_batch(40, 30, torch.Generator().manual_seed(1))
    else:
        (pool, batch, q), chunk_kv = _kivi_batch(kv_dtype, 160, 64, torch.Generator().manual_seed(1)), None
    got = layer.paged_attention_over_pool(q, batch, pool, 0, DIM**-0.5, chunk_kv)
    assert calls == []
    torch.testing.assert_close(got, _reference(pool, batch, q), atol=1e-5, rtol=1e-5)


def test_page_aligned_prompts_and_mixed_batches_meet_no_kernel_variant_lone_mid_page_prompts_did_not():
    """An int2 pool at the 4B model's heads, through Triton's real JIT for sm_90 in a child (nothing launched). Lone
    prompts ending on a page (32 to 544 tokens) have no residual window, so their pool passes came last and wrote the
    model's dtype where prompts ending mid-page wrote fp32 (the split merge also compiled a tile for each power of
    two of the splits); in mixed batches a short span's direct pass comes first, so a long span's block passes
    continue it and wrote fp32 where a lone prompt's continuing pass (the window's) wrote the model's dtype. Serving
    compiled such variants inside requests (session 15's review). Every variant those launch is one that lone
    mid-page prompts or a batch-1 decode step (every warm-up's) launch: a one-page prompt's pool pass splits 64 ways,
    as that step does, and its merge reads them in one wide chunk (WIDE_SPLIT_CHUNK), which no mid-page prompt
    meets."""
    import tempfile
    from pathlib import Path

    from tests.engine.layers.attention_variants import variants_outside

    groups = {"mid_page": [[33], [65], [100], [129], [560]], "decode_bs1": [[560]],
              "aligned": [[32], [64], [96], [128], [544]], "mixed": [[48, 369], [98, 291], [3, 37, 300]]}
    with tempfile.TemporaryDirectory() as tmp:
        assert variants_outside(["mid_page", "decode_bs1"], groups, "int2", Path(tmp), decode={"decode_bs1": True}) \
            == {"aligned": [], "mixed": []}
