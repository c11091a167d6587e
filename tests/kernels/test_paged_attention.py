"""paged_attention (Triton, interpreter on CPU) against naive_paged_attention, every pool kind, GQA, odd sizes."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels import ops
from headroom.kernels.attention import naive_prefix_attention
from headroom.kernels.attention_merge import merge_two
from headroom.kernels.paged_attention import naive_paged_attention, paged_attention
from headroom.kernels.paged_kv import KeyWindow, naive_gather_kv

from tests.kernels.paged_pool import Recording, make_pool

# (kind, bits, pool dtype)
KINDS = [("dense", 16, torch.bfloat16), ("fp8", 8, torch.bfloat16), ("kivi", 8, torch.bfloat16),
         ("kivi", 4, torch.bfloat16), ("kivi", 2, torch.bfloat16), ("dense", 16, torch.float32)]


def _batch(kv_lens: list[int], q_lens: list[int], num_q_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1):
    """Each sequence's queries are its last q_len positions (their keys are already in the pool, as in the engine)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(kv_lens, q_lens, strict=True)])
    offsets = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, positions, offsets


def _close(out, ref, lse, ref_lse):
    tol = 1e-4 if out.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # The interpreter keeps dequantized tiles in fp32 where the reference rounds them to bf16.
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=1e-3)


@pytest.mark.parametrize("kind,bits,dtype", KINDS)
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,kv_lens,q_lens",
    [
        (1, 8, 64, [45], [1]),             # decode, GQA 8, a partly filled last page
        (3, 1, 128, [70, 9], [5, 9]),      # odd heads, extend chunks, one whole prompt
        (2, 2, 256, [33], [1]),            # head_dim 256 decode
        (1, 4, 64, [64, 1, 100], [3, 1, 1]),
    ],
)
def test_matches_naive(kind, bits, dtype, num_kv_heads, group, head_dim, kv_lens, q_lens):
    kv, table = make_pool(kind, bits, num_kv_heads, head_dim, kv_lens, dtype)
    q, positions, offsets = _batch(kv_lens, q_lens, num_kv_heads * group, head_dim, dtype)
    starts = torch.zeros(len(kv_lens), dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    out_lse = torch.full(q.shape[:2], float("nan"))
    paged_attention(q, positions, offsets, table, starts, lens, kv, scale, num_splits=1, out=out, out_lse=out_lse)
    ref, ref_lse = naive_paged_attention(q, positions, offsets, table, starts, lens, kv, scale)
    assert torch.isfinite(out).all() and torch.isfinite(out_lse).all()
    _close(out, ref, out_lse, ref_lse)


@pytest.mark.parametrize("num_splits", [3, 7])
def test_split_keys_merge_to_the_same_answer(num_splits):
    # More splits than key blocks leaves some empty (lse -inf): the merge must ignore them.
    kv, table = make_pool("kivi", 4, 2, 64, [96, 40], torch.bfloat16)
    q, positions, offsets = _batch([96, 40], [1, 2], 4, 64, torch.bfloat16)
    args = (q, positions, offsets, table, torch.zeros(2, dtype=torch.int32), torch.tensor([96, 40], dtype=torch.int32), kv, 0.125)
    out, lse = paged_attention(*args, num_splits=num_splits)
    ref, ref_lse = naive_paged_attention(*args)
    _close(out, ref, lse, ref_lse)


def _pool_and_window(bits: int):
    """64 closed KIVI tokens in the pool and 11 open ones in a dense window (positions 64..74), and a 13-token
    chunk at 62..74 that straddles both."""
    kv, table = make_pool("kivi", bits, 2, 64, [64], torch.bfloat16, seed=3)
    window, _ = make_pool("dense", 16, 2, 64, [11], torch.bfloat16, seed=4)
    q, positions, offsets = _batch([75], [13], 4, 64, torch.bfloat16)
    return kv, table, window, torch.arange(11, dtype=torch.int32)[None], q, positions, offsets, torch.ones(1, dtype=torch.int32)


def test_pool_prefix_merged_with_residual_window_equals_whole_context():
    # KIVI: 64 closed tokens in the pool, 11 open ones in a dense window at positions 64..74; a 13-token chunk
    # at 62..74 straddles both, so its first rows see no residual key at all.
    kv, table, window, window_table, q, positions, offsets, one = _pool_and_window(2)
    o_pool, lse_pool = paged_attention(q, positions, offsets, table, 0 * one, 64 * one, kv, 0.125)
    o_tail, lse_tail = paged_attention(q, positions, offsets, window_table, 64 * one, 11 * one, window, 0.125)
    assert torch.isinf(lse_tail[:2]).all() and (o_tail[:2] == 0).all()
    merged, _ = merge_two(o_pool, lse_pool, o_tail, lse_tail)
    k_pool, v_pool = naive_gather_kv(kv, table[0], 64, torch.bfloat16)
    k_tail, v_tail = naive_gather_kv(window, window_table[0], 11, torch.bfloat16)
    whole = naive_prefix_attention(q, torch.cat((k_pool, k_tail)), torch.cat((v_pool, v_tail)), positions, 0.125)
    torch.testing.assert_close(merged.float(), whole.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_window_as_one_more_split_equals_whole_context(num_splits):
    # Three decode rows over an int2 pool: 64 closed keys and a window of 7 of which the row sees 5 (its position
    # 68), 32 closed and an empty window (the step closed its page), none closed and 12 in the window; windows
    # scattered over the window slots, 48 of a row's table columns.
    closed, window_lens, seen = [64, 32, 0], [7, 0, 12], [5, 0, 12]
    kv, table = make_pool("kivi", 2, 2, 64, closed, torch.bfloat16, seed=5)
    window_kv, _ = make_pool("dense", 16, 2, 64, [96], torch.bfloat16, seed=6)
    first_slot = [40, 3, 70]
    window_table = torch.zeros(3, 48, dtype=torch.int32)
    for row, (slot, n) in enumerate(zip(first_slot, window_lens, strict=True)):
        window_table[row, :n] = torch.arange(slot, slot + n)
    ends = [c + n for c, n in zip(closed, seen, strict=True)]
    q, positions, offsets = _batch(ends, [1, 1, 1], 4, 64, torch.bfloat16, seed=7)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    window = KeyWindow(window_kv, window_table, as_int(closed), as_int(window_lens))
    out, lse = paged_attention(q, positions, offsets, table, as_int([0, 0, 0]), as_int(closed), kv, 0.125,
                               num_splits=num_splits, window=window)
    for row in range(3):
        k_pool, v_pool = naive_gather_kv(kv, table[row], closed[row], torch.bfloat16)
        k_win, v_win = naive_gather_kv(window_kv, window_table[row], seen[row], torch.bfloat16)
        whole = naive_prefix_attention(q[row : row + 1], torch.cat((k_pool, k_win)), torch.cat((v_pool, v_win)),
                                       positions[row : row + 1] * 0 + closed[row] + seen[row] - 1, 0.125)
        torch.testing.assert_close(out[row].float(), whole[0].float(), atol=2e-2, rtol=2e-2)
    # The CPU reference path (ops) gives the same rows and lses.
    ref, ref_lse = ops.paged_attention(q, positions, offsets, table, as_int([0, 0, 0]), as_int(closed), kv, 0.125,
                                       window=window)
    _close(out, ref, lse, ref_lse)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_gated_launch_is_sigmoid_mul_of_its_output(num_splits):
    """gate (Qwen3.5's output gate, a strided view): the launch's rows times sigmoid(gate), bit for bit what
    sigmoid_mul makes of the ungated launch's rows, through the split merge (4 splits) or after the launch (1); the
    CPU reference path (ops) gates the same way; a gated launch continuing an earlier range is refused."""
    from headroom.kernels.gates_triton import sigmoid_mul

    kv, table = make_pool("kivi", 2, 2, 64, [96, 40], torch.bfloat16)
    q, positions, offsets = _batch([96, 40], [1, 1], 4, 64, torch.bfloat16)
    gate = (torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()[..., 64:]
    args = (q, positions, offsets, table, torch.zeros(2, dtype=torch.int32), torch.tensor([96, 40], dtype=torch.int32),
            kv, 0.125)
    plain, plain_lse = paged_attention(*args, num_splits=num_splits)
    gated, gated_lse = paged_attention(*args, num_splits=num_splits, gate=gate)
    assert torch.equal(gated.view(2, -1), sigmoid_mul(plain.view(2, -1), gate))
    assert torch.equal(gated_lse, plain_lse)
    ref, _ = ops.paged_attention(*args, gate=gate)
    torch.testing.assert_close(ref.float(), gated.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="gate"):
        paged_attention(*args, prev=(plain.float(), plain_lse), gate=gate)


def test_a_decode_window_refuses_chunks():
    kv, table = make_pool("kivi", 2, 2, 64, [64], torch.bfloat16)
    window_kv, _ = make_pool("dense", 16, 2, 64, [8], torch.bfloat16)
    q, positions, offsets = _batch([66], [2], 4, 64, torch.bfloat16)
    one, two = torch.ones(1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    window = KeyWindow(window_kv, torch.arange(16, dtype=torch.int32).view(2, 8), 64 * two, 2 * two)
    with pytest.raises(ValueError, match="decode launches only"):
        paged_attention(q, positions, offsets, table, 0 * one, 64 * one, kv, 0.125, window=window)
    bad = KeyWindow(window_kv, torch.arange(8, dtype=torch.int32)[None], 64 * one, 2 * one.long())
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q[:1], positions[:1], torch.tensor([0, 1], dtype=torch.int32), table, 0 * one, 64 * one, kv,
                        0.125, window=bad)


def test_bad_shapes_name_the_field():
    kv, table = make_pool("dense", 16, 2, 64, [8], torch.bfloat16)
    q, positions, offsets = _batch([8], [1], 3, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv=2"):
        paged_attention(q, positions, offsets, table, torch.zeros(1, dtype=torch.int32), torch.full((1,), 8, dtype=torch.int32), kv, 0.1)
    q, positions, offsets = _batch([8], [1], 4, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        paged_attention(q, positions, offsets, table, torch.zeros(1, dtype=torch.int32), torch.full((1,), 8), kv, 0.1)


# The KIVI loads against the plain whole-page tiles (one load per packed byte, the magic exponent a literal): the
# per-element gather (page_tile 0), each packed byte loaded once per token it holds (load_per_token), that with the
# magic exponent in a register (the defaults, DECODE_DEFAULTS / EXTEND_DEFAULTS), all with fp32 tiles (decode's
# default half_tiles rounds each element to fp16: test_half_tiles_match_the_fp32_tiles).
FP32_TILES = {"half_tiles": 0}
PLAIN_PAGES = {"load_per_token": 0, "magic_register": 0, **FP32_TILES}


@pytest.mark.parametrize("tuning", [{"page_tile": 0}, {"load_per_token": 1, "magic_register": 0}, {}], ids=str)
@pytest.mark.parametrize("bits", [8, 2])
@pytest.mark.parametrize("head_dim,kv_lens,q_lens", [(64, [45], [1]), (70, [40, 9], [5, 9]), (256, [33, 64], [1, 1])])
def test_kivi_load_paths_agree_exactly(monkeypatch, tuning, bits, head_dim, kv_lens, q_lens):
    """Whole-page KIVI tiles (one load per packed byte, key scales per page, value scales per channel group) give
    exactly the per-element gathers' answer: decode and extend (64-key tiles, two pages), partial value groups (head_dim 70), pages past the key range inside a tile."""
    from headroom.kernels import paged_attention as pa

    kv, table = make_pool("kivi", bits, 2, head_dim, kv_lens, torch.bfloat16)
    q, positions, offsets = _batch(kv_lens, q_lens, 4, head_dim, torch.bfloat16)
    args = (q, positions, offsets, table, torch.zeros(len(kv_lens), dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32), kv, head_dim**-0.5)
    with pa.tuned(extend=PLAIN_PAGES, decode=PLAIN_PAGES):
        want, want_lse = paged_attention(*args)
    for table_ in (pa.DECODE_TUNING, pa.EXTEND_TUNING):
        for key, value in {**tuning, **FP32_TILES}.items():
            monkeypatch.setitem(table_, key, value)
    got, got_lse = paged_attention(*args)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


# The loop variants a tile sweep may turn on (kernels/paged_attention.py EXTEND_TUNING / DECODE_TUNING): every
# kind with both on, mask_split alone on a bf16 pool, lazy_rescale alone (mask_split, an extend default, off) on an
# int4 pool.
BOTH = {"mask_split": 1, "lazy_rescale": 1}
LOOP_CASES = [(BOTH, kind) for kind in (("dense", 16, torch.bfloat16), ("kivi", 2, torch.bfloat16),
                                        ("dense", 16, torch.float32))]
LOOP_CASES += [({"mask_split": 1}, ("dense", 16, torch.bfloat16)),
               ({"lazy_rescale": 1, "mask_split": 0}, ("kivi", 4, torch.bfloat16))]


def _running_max_steps(kv, table, q, positions, scale: float, tile: int = 64) -> torch.Tensor:
    """Each row's rise of its running maximum (log2 units) from one key tile to the next, over one sequence: what
    decides whether lazy rescaling rescales."""
    from headroom.kernels.paged_kv import naive_gather_kv

    keys, _ = naive_gather_kv(kv, table[0], int(positions.max()) + 1, torch.float32)
    group = q.shape[1] // keys.shape[1]
    s = torch.einsum("thd,khd->thk", q.float(), keys.repeat_interleave(group, dim=1)) * scale * 1.4426950408889634
    s = s.masked_fill(torch.arange(keys.shape[0])[None, None, :] > positions[:, None, None], float("-inf"))
    tile_max = torch.stack([s[..., j:j + tile].amax(-1) for j in range(0, keys.shape[0], tile)], -1)
    running = tile_max.cummax(-1).values
    return (running[..., 1:] - running[..., :-1])[running[..., :-1] > float("-inf")]


@pytest.mark.parametrize("tuning,kind", LOOP_CASES, ids=str)
@pytest.mark.parametrize("kv_lens,q_lens,spread", [
    ([300], [1], 0.0),           # decode over five tiles
    ([160, 40], [24, 40], 0.0),  # a chunk after a prefix (tiles it sees whole, then the diagonal) and a whole prompt
    ([200], [100], 0.0),         # two query tiles of 64 tokens (GROUP 2): the first sees one key tile whole
    ([300], [24], 12.0),         # queries of large norm: true running maxima that rise past 2^8 between tiles and
                                 # that rise by less (so tiles both rescale and keep a stale maximum)
])
def test_loop_variants_match_naive(monkeypatch, tuning, kind, kv_lens, q_lens, spread):
    """Tiles every row sees whole skip the masks; a row's maximum may lag by up to 2^8 before its accumulator is
    rescaled: the answer is as close to naive attention as the default loop's, and within rounding of it."""
    from headroom.kernels import paged_attention as pa

    kind, bits, dtype = kind
    kv, table = make_pool(kind, bits, 2, 64, kv_lens, dtype)
    q, positions, offsets = _batch(kv_lens, q_lens, 4, 64, dtype)
    if spread:
        q = (q.float() * 0.1 + spread).to(dtype)
        steps = _running_max_steps(kv, table, q, positions, 64**-0.5)
        assert (steps > 8).any() and ((steps > 0) & (steps <= 8)).any()
    args = (q, positions, offsets, table, torch.zeros(len(kv_lens), dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32), kv, 64**-0.5)
    # One split: each program walks every key tile (small grids split the keys, a tile a program). The baseline is
    # the plain loop (extend launches take mask_split by default, EXTEND_DEFAULTS).
    with pa.tuned(extend={"mask_split": 0}):
        want, want_lse = paged_attention(*args, num_splits=1)
    for table_ in (pa.DECODE_TUNING, pa.EXTEND_TUNING):
        for key, value in tuning.items():
            monkeypatch.setitem(table_, key, value)
    got, got_lse = paged_attention(*args, num_splits=1)
    ref, ref_lse = naive_paged_attention(*args)
    assert torch.isfinite(got).all() and torch.isfinite(got_lse).all()
    # As close to naive attention as the default loop is (bf16 outputs of magnitude 2-4 round by 0.016-0.031).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - ref.float()).abs().max() <= (want.float() - ref.float()).abs().max() + tol
    assert (got_lse - ref_lse).abs().max() <= (want_lse - ref_lse).abs().max() + 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind,bits,dtype", [("dense", 16, torch.bfloat16), ("kivi", 2, torch.bfloat16),
                                             ("fp8", 8, torch.bfloat16)])
def test_loop_variants_on_ranges_splits_and_continuations(monkeypatch, kind, bits, dtype):
    """What the engine's chained passes hand the kernel: a key range that starts past key 0 (kv_start, the
    residual window's and the block passes' ranges), a range split over programs, and a pass that continues an
    earlier range's answer (prev); GROUP 4 as the 4B model's. Both variants on give the default loop's answers."""
    from headroom.kernels import paged_attention as pa

    kv, table = make_pool(kind, bits, 1, 64, [320], dtype)
    plain, positions, offsets = _batch([320], [40], 4, 64, dtype)
    # Large scores for the split and the chain (rescales taken and skipped); plain ones for the late range, whose
    # keys then all weigh in (a key seen too early shows).
    q = (plain.float() * 0.1 + 12.0).to(dtype)
    one = torch.ones(1, dtype=torch.int32)

    def from_key(start: int) -> torch.Tensor:
        # A range's table starts at its first key (kv_start is that key's position).
        return table[:, start // kv.page_tokens:].contiguous()

    # The late range's queries: the first sees 105 of its keys, the last 144 (a tile it sees whole, then masked ones).
    early = torch.arange(200, 240)

    def runs() -> list[tuple[torch.Tensor, torch.Tensor]]:
        late = paged_attention(plain, early, offsets, from_key(96), 96 * one, 224 * one, kv, 0.125, num_splits=1)
        split = paged_attention(q[-1:], positions[-1:], torch.tensor([0, 1], dtype=torch.int32), table, 0 * one,
                                320 * one, kv, 0.125, num_splits=3)
        first = paged_attention(q, positions, offsets, table, 0 * one, 160 * one, kv, 0.125, num_splits=1)
        chained = paged_attention(q, positions, offsets, from_key(160), 160 * one, 160 * one, kv, 0.125,
                                  prev=(first[0].float(), first[1].clone()))
        return [late, split, chained]

    with pa.tuned(extend={"mask_split": 0}):  # the plain loop (extend launches default to mask_split)
        want = runs()
    for table_ in (pa.DECODE_TUNING, pa.EXTEND_TUNING):
        for key, value in BOTH.items():
            monkeypatch.setitem(table_, key, value)
    got = runs()
    for (o, lse), (want_o, want_lse) in zip(got, want, strict=True):
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o.float(), want_o.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    # The late range (keys at 96..319) against naive attention over those keys alone: as close as the default loop
    # (the interpreter's KIVI tiles are not rounded to bf16 as the reference's are).
    ref, ref_lse = naive_paged_attention(plain, early, offsets, from_key(96), 96 * one, 224 * one, kv, 0.125)
    assert (got[0][0].float() - ref.float()).abs().max() <= (want[0][0].float() - ref.float()).abs().max() + 1e-2
    assert (got[0][1] - ref_lse).abs().max() <= (want[0][1] - ref_lse).abs().max() + 1e-4
    if kind == "dense":
        _close(got[0][0], ref, got[0][1], ref_lse)


@pytest.mark.parametrize("kind,bits", [("dense", 16), ("kivi", 2)])
def test_the_defaults_reach_the_launches(monkeypatch, kind, bits):
    """EXTEND_DEFAULTS / DECODE_DEFAULTS: an extend launch with no tuning takes MASK_SPLIT (the H200's faster loop), a
    decode launch the plain one; both take the KIVI loads LOAD_PER_TOKEN and MAGIC_IN_REGISTER, and a KIVI decode launch
    HALF_TILES (its fp16 tiles; the interpreter's codes here); explicit zeros run the plain loop and loads, bit for bit
    the same answer."""
    from headroom.kernels import paged_attention as pa

    kv, table = make_pool(kind, bits, 2, 64, [45, 70], torch.bfloat16)
    lens = torch.tensor([45, 70], dtype=torch.int32)

    def run(q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        q, positions, offsets = _batch([45, 70], q_lens, 8, 64, torch.bfloat16)
        return paged_attention(q, positions, offsets, table, torch.zeros(2, dtype=torch.int32), lens, kv, 0.125)

    launched: list = []
    keys = ("MASK_SPLIT", "LOAD_PER_TOKEN", "MAGIC_IN_REGISTER", "HALF_TILES")
    monkeypatch.setattr(pa, "paged_attention_fwd_kernel", Recording(pa.paged_attention_fwd_kernel, launched, keys))
    got, got_lse = run([1, 9])
    run([1, 1])
    with pa.tuned(extend={"mask_split": 0, "load_per_token": 0, "magic_register": 0}):
        want, want_lse = run([1, 9])
    half = 1 if kind == "kivi" else 0
    assert launched == [(True, True, True, 0), (False, True, True, half), (False, False, False, 0)]
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_continuing_an_earlier_range_equals_merging_the_two():
    # The residual-window pass resumes the pool pass's softmax (prev) in place of a merge: same answer, written
    # over the fp32 accumulator it read, or into a fresh bf16 output.
    kv, table, window, window_table, q, positions, offsets, one = _pool_and_window(4)
    fp32 = (torch.empty(q.shape), torch.empty(q.shape[:2]))
    o_pool, lse_pool = paged_attention(q, positions, offsets, table, 0 * one, 64 * one, kv, 0.125, out=fp32[0],
                                       out_lse=fp32[1])
    o_tail, lse_tail = paged_attention(q, positions, offsets, window_table, 64 * one, 11 * one, window, 0.125,
                                       out=torch.empty(q.shape), out_lse=torch.empty(q.shape[:2]))
    want, want_lse = merge_two(o_pool, lse_pool, o_tail, lse_tail)
    acc, acc_lse = torch.empty(q.shape), torch.empty(q.shape[:2])
    paged_attention(q, positions, offsets, table, 0 * one, 64 * one, kv, 0.125, out=acc, out_lse=acc_lse)
    out = torch.empty_like(q)
    got, got_lse = paged_attention(q, positions, offsets, window_table, 64 * one, 11 * one, window, 0.125,
                                   prev=(acc, acc_lse), out=out, out_lse=acc_lse)
    assert got is out and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
    # In place over the accumulator, fp32 all the way: as exact as the merge.
    paged_attention(q, positions, offsets, table, 0 * one, 64 * one, kv, 0.125, out=acc, out_lse=acc_lse)
    paged_attention(q, positions, offsets, window_table, 64 * one, 11 * one, window, 0.125, prev=(acc, acc_lse),
                    out=acc, out_lse=acc_lse)
    torch.testing.assert_close(acc, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one split"):
        paged_attention(q, positions, offsets, window_table, 64 * one, 11 * one, window, 0.125, num_splits=2,
                        prev=(acc, acc_lse))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("head_dim", [64, 70])
def test_dequantize_block_matches_naive(bits, head_dim):
    # Two sequences' keys 32..95 (one short of a whole block: its last page is left alone) into rows 1 and 0.
    from headroom.kernels.paged_attention import dequantize_block, naive_dequantize_block

    kv, table = make_pool("kivi", bits, 2, head_dim, [128, 96], torch.bfloat16, seed=5)
    lens, rows = torch.tensor([64, 32], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    got_k, got_v = torch.full((192, 2, head_dim), float("nan")), torch.full((192, 2, head_dim), float("nan"))
    want_k, want_v = got_k.clone(), got_v.clone()
    dequantize_block(kv, table, lens, rows, 32, 96, got_k, got_v)
    naive_dequantize_block(kv, table, lens, rows, 32, 96, want_k, want_v)
    torch.testing.assert_close(got_k, want_k, equal_nan=True, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_v, want_v, equal_nan=True, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(got_k[96:160]).all() and torch.isfinite(got_k[:32]).all() and torch.isnan(got_k[32:96]).all()
    with pytest.raises(ValueError, match="multiples of the page"):
        dequantize_block(kv, table, lens, rows, 16, 96, got_k, got_v)


def test_tuned_sets_the_tunings_inside_and_restores_them_after():
    """paged_attention.tuned, the sweeps' way to run launches under a config: replaced inside the block (None leaves
    a table as it is), what each held before after it, an exception too."""
    from headroom.kernels import paged_attention as pa

    pa.DECODE_TUNING["num_warps"] = 4
    try:
        with pa.tuned(extend={"mask_split": 1}):
            assert pa.EXTEND_TUNING == {"mask_split": 1} and pa.DECODE_TUNING == {"num_warps": 4}
        with pytest.raises(RuntimeError), pa.tuned(decode={"d_chunks": 2}):
            assert pa.DECODE_TUNING == {"d_chunks": 2}
            raise RuntimeError
        assert pa.EXTEND_TUNING == {} and pa.DECODE_TUNING == {"num_warps": 4}
    finally:
        pa.DECODE_TUNING.clear()


_SPECIALISATION_CHILD = r'''
import importlib.util

from headroom.kernels import paged_attention as pa

spec = importlib.util.spec_from_file_location("paged_pool", PAGED_POOL)
paged_pool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paged_pool)
make_pool = paged_pool.make_pool

keys = {}


def skip(**kw):
    # Every launch that would compile: its kernel and specialisation key; neither compiled nor launched.
    keys.setdefault(kw["fn"].name, set()).add(str(kw["key"]))
    return True


triton.knobs.runtime.jit_cache_hook = skip
# 12 query heads over 4 KV heads: a decode tile's rows are 3 a token, and a pass's tokens times heads (the lses' split
# stride) is a multiple of 16 at 4 tokens, not at 1 or 3; table widths of 1, 16, 37 and 48 pages or slots; split
# counts of 3 to 64 (over a KIVI pool, enough for more programs than half the target, which the engine's split counts
# always give: fewer take 8 warps instead of 4, a designed second variant); the output in the model's dtype and in
# fp32 (an accumulator a pass continues).
for kind, bits, split_counts in (("dense", 16, (3, 4, 64, 16, 4)), ("kivi", 2, (35, 64, 48, 40, 36))):
    for (width, tokens), splits in zip(((1, 1), (16, 1), (37, 1), (37, 4), (48, 3)), split_counts, strict=True):
        page = 32 if kind == "kivi" else 1
        kv, table = make_pool(kind, bits, 4, 64, [width * page], torch.bfloat16)
        q = torch.zeros(tokens, 12, 64, dtype=torch.bfloat16)
        positions = torch.arange(width * page - tokens, width * page)
        offsets = torch.tensor([0, tokens], dtype=torch.int32)
        args = (q, positions, offsets, table, torch.zeros(1, dtype=torch.int32),
                torch.tensor([width * page], dtype=torch.int32), kv, 0.125)
        pa.paged_attention(*args, max_q_len=tokens, num_splits=splits)
        pa.paged_attention(*args, max_q_len=tokens, num_splits=splits, out=q.float())
        if kind == "kivi":
            with pa.tuned(decode={"d_chunks": 2}):
                pa.paged_attention(*args, max_q_len=tokens, num_splits=splits)
            if tokens == 1:
                # A graphed step's windows: the table one page wide, or any width; 0 to 31 keys.
                window_kv, _ = make_pool("dense", 16, 4, 64, [96], torch.bfloat16)
                for columns, seen in ((32, width % 32), (width, 1)):
                    window = pa.KeyWindow(window_kv, torch.zeros(1, columns, dtype=torch.int32), args[5],
                                          torch.tensor([seen], dtype=torch.int32))
                    pa.paged_attention(*args, max_q_len=1, num_splits=splits, window=window)
            workspace = torch.zeros(width * page, 4, 64, dtype=torch.bfloat16)
            pa.dequantize_block(kv, table, torch.tensor([width * page], dtype=torch.int32),
                                torch.zeros(1, dtype=torch.int32), 0, width * page, workspace, workspace.clone())
print(json.dumps({name: len(found) for name, found in keys.items()}))
'''


def test_pass_shapes_compile_one_variant_of_each_attention_kernel(tmp_path):
    """The table's width (the widest sequence's pages or slots), the lses' split stride (the pass's tokens times
    the query heads) and the split count follow the batch: as specialisation keys (or the merge's tile of the splits)
    they made up to three variants of each kernel (1, a multiple of 16, the rest; a power of two of the splits), and
    serving met the ones the warm-up had not. Decode launches of every class, through Triton's real JIT (compiled for
    sm_90, nothing launched) in a child process: one key per kernel and pool kind, and per output dtype and chunk
    of splits of the merge; one more for paged attention's decode launches with windows, whatever their table's
    width."""
    from pathlib import Path

    from tests.kernels.sm90_child import run_on_sm90

    # (The pool helper by its path: the repository root on the path would shadow the standard library's operator.)
    got = run_on_sm90(_SPECIALISATION_CHILD, tmp_path, PAGED_POOL=str(Path(__file__).with_name("paged_pool.py")))
    # One key a kernel, per pool kind where the kind is a constexpr (paged attention: dense and KIVI, and KIVI's
    # decode launches with windows, WINDOW), per output dtype where the output is a pointer's type (the merge: bf16
    # and fp32), and for the merge per chunk of splits (SPLIT_CHUNK, and WIDE_SPLIT_CHUNK for rows of more splits:
    # the split counts here above 32 and below).
    assert got == {"paged_attention_fwd_kernel": 3, "merge_splits_fwd_kernel": 4, "kivi_decode_fwd_kernel": 1,
                   "kivi_dequantize_block_kernel": 1}, got


@pytest.mark.parametrize("block_m,mask_split", [(16, False), (128, True)], ids=["decode", "extend"])
def test_the_default_kivi_loads_compile_for_sm90(block_m, mask_split):
    """The interpreter runs LOAD_PER_TOKEN's 4-D tile whatever the GPU compiler would say of it: compile the int2
    decode and extend launches as the defaults make them (the magic exponent in a register too) for the H200."""
    from tests.kernels.sm90 import compile_sm90

    pointers = {name: "*i32" for name in ("q_pos", "q_offsets", "kv_table", "kv_start", "kv_lens")}
    pointers.update(q="*bf16", o="*fp32", lse="*fp32", k="*u8", v="*u8", k_scale="*fp16", k_zero="*fp16",
                    v_scale="*fp16", v_zero="*fp16", prev_o="*fp32", prev_lse="*fp32", sm_scale="fp32")
    constants = {"GROUP": 4, "HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_M": block_m, "BLOCK_N": 64, "KIND": 2, "BITS": 2,
                 "PAGE": 32, "GROUP_D": 32, "DOT_FP32": False, "DOT_PRECISION": "tf32", "ROUND_TILES": True,
                 "PAGE_TILE": True, "CONTINUE": False, "PDL": False, "MASK_SPLIT": mask_split, "LAZY_RESCALE": False,
                 "MAGIC_IN_REGISTER": True, "LOAD_PER_TOKEN": True, "HALF_TILES": 0}
    [result] = compile_sm90([("headroom.kernels.paged_attention", "paged_attention_fwd_kernel", pointers, constants)],
                            num_warps=4 if block_m == 16 else 8, num_stages=2)
    assert result["ok"], result.get("error")


def test_the_graphed_int2_decode_launch_with_windows_compiles_for_sm90():
    """A graphed int2 decode step's launch as the defaults make it (fp16 tiles, the magic exponent in a register,
    per-token loads) with its windows' program (WINDOW: bf16 window rows in the model dtype's MMA), for the H200."""
    from headroom.kernels.paged_attention import DECODE_DEFAULTS

    from tests.kernels.sm90 import compile_sm90

    pointers = {name: "*i32" for name in ("q_pos", "q_offsets", "kv_table", "kv_start", "kv_lens", "w_table",
                                           "w_start", "w_lens")}
    pointers.update(q="*bf16", o="*fp32", lse="*fp32", k="*u8", v="*u8", k_scale="*fp16", k_zero="*fp16",
                    v_scale="*fp16", v_zero="*fp16", prev_o="*fp32", prev_lse="*fp32", sm_scale="fp32", w_k="*bf16",
                    w_v="*bf16")
    constants = {"GROUP": 4, "HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_M": 16, "BLOCK_N": 64, "KIND": 2, "BITS": 2,
                 "PAGE": 32, "GROUP_D": 32, "DOT_FP32": False, "DOT_PRECISION": "tf32", "ROUND_TILES": True,
                 "PAGE_TILE": True, "CONTINUE": False, "PDL": False,
                 "MAGIC_IN_REGISTER": bool(DECODE_DEFAULTS["magic_register"]),
                 "LOAD_PER_TOKEN": bool(DECODE_DEFAULTS["load_per_token"]),
                 "HALF_TILES": 2 * DECODE_DEFAULTS["half_tiles"], "WINDOW": 1}
    [result] = compile_sm90([("headroom.kernels.paged_attention", "paged_attention_fwd_kernel", pointers, constants)],
                            num_warps=4, num_stages=2)
    assert result["ok"], result.get("error")


@pytest.mark.parametrize("load_per_token", [1, 0])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("head_dim,kv_lens,q_lens", [(64, [45], [1]), (70, [40, 9], [5, 9]), (64, [33, 64], [1, 1])])
def test_half_tiles_match_the_fp32_tiles(monkeypatch, load_per_token, bits, head_dim, kv_lens, q_lens):
    """half_tiles (HALF_TILES; here its Triton codes, the interpreter's): KIVI tiles dequantized in fp16 give the
    fp32 tiles' answer up to fp16's rounding of each dequantized element, decode and extend, partial value groups,
    every code width; a wrong code (one bit off) would be off by a scale."""
    from headroom.kernels import paged_attention as pa

    kv, table = make_pool("kivi", bits, 2, head_dim, kv_lens, torch.bfloat16)
    q, positions, offsets = _batch(kv_lens, q_lens, 4, head_dim, torch.bfloat16)
    args = (q, positions, offsets, table, torch.zeros(len(kv_lens), dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32), kv, head_dim**-0.5)
    with pa.tuned(extend=FP32_TILES, decode=FP32_TILES):
        want, want_lse = paged_attention(*args)
    for table_ in (pa.DECODE_TUNING, pa.EXTEND_TUNING):
        monkeypatch.setitem(table_, "half_tiles", 1)
        monkeypatch.setitem(table_, "load_per_token", load_per_token)
    got, got_lse = paged_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=6e-3, rtol=6e-3)
    torch.testing.assert_close(got_lse, want_lse, atol=6e-3, rtol=1e-3)
    assert not torch.equal(got, want) or bits == 8, "the fp16 tiles ran (their rounding differs from fp32's)"


def _run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """The few PTX instructions of _HALF_CODES_ASM, bit for bit: registers are 32-bit ints."""
    import numpy as np

    regs = dict(inputs)
    value = lambda token: regs[token] if token in regs else int(token, 0)  # noqa: E731
    for line in asm.strip("{}\n").splitlines():
        op, rest = line.strip().rstrip(";").split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        if op == ".reg":
            continue
        src = [value(a) for a in args[1:]]
        if op == "shf.r.wrap.b32":
            wide, n = (src[1] << 32) | src[0], src[2] & 31
            out = (wide >> n) & 0xFFFFFFFF
        elif op == "and.b32":
            out = src[0] & src[1]
        elif op == "mov.b32":
            out = src[0]
        elif op == "prmt.b32":
            # (The default mode; a selector nibble with its top bit set would replicate a sign instead: none here.)
            assert all((src[2] >> (4 * i)) & 8 == 0 for i in range(4)), line
            pool = src[0] | (src[1] << 32)
            out = sum(((pool >> (8 * ((src[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "sub.f16x2":
            a, b = (np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16) for x in src)
            out = int.from_bytes((a - b).astype(np.float16).view(np.uint16).astype("<u2").tobytes(), "little")
        else:
            raise AssertionError(f"an instruction the emulator does not know: {line}")
        regs[args[0]] = out
    return regs


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_half_code_asm_unpacks_every_byte(bits):
    """The inline PTX of HALF_TILES (its own text, run by a small emulator): for words of four packed bytes, each
    byte with its own token's mask (whatever four elements Triton packs into an operand), the four fp16 outputs ($0
    low, $0 high, $1 low, $1 high) are the four bytes' codes times 2^offset."""
    import numpy as np
    from headroom.kernels import paged_attention as pa

    gen = np.random.default_rng(bits)
    words = [0, 0xFFFFFFFF, 0x80402010, *gen.integers(0, 2**32, 300).tolist()]
    for word in words:
        offsets = gen.choice(np.arange(0, 8, bits), 4).tolist()
        masks = sum((((1 << bits) - 1) << p) << (8 * i) for i, p in enumerate(offsets))
        regs = _run_ptx(pa.HALF_CODES_ASM.value, {"$2": word, "$3": masks})
        halves = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        got = np.array(halves, dtype=np.uint16).view(np.float16).tolist()
        want = [float(((word >> (8 * i + p)) & ((1 << bits) - 1)) << p) for i, p in enumerate(offsets)]
        assert got == want, (hex(word), offsets, got, want)


def _emulated_asm(groups: str):
    """The interpreter's create_inline_asm for HALF_CODES_ASM: _run_ptx on every four elements, grouped as Triton
    may group them for one asm operand ("strided": elements i, i + n/4, i + n/2, i + 3n/4, as Triton 3.6 packed
    them on sm_90; "adjacent": i .. i + 3)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def create_inline_asm(self, asm, constraints, values, ty, is_pure, pack):
        assert constraints == "=r,=r,r,r" and pack == 4
        codes, masks = (v.data.reshape(-1).astype(np.uint32) for v in values)
        n = codes.size
        index = (np.arange(n // 4)[:, None] + np.arange(4)[None, :] * (n // 4) if groups == "strided"
                 else np.arange(n).reshape(-1, 4))
        out = np.zeros(n, dtype=np.uint16)
        for group in index:
            regs = _run_ptx(asm, {"$2": sum(int(codes[j]) << (8 * k) for k, j in enumerate(group)),
                                  "$3": sum(int(masks[j]) << (8 * k) for k, j in enumerate(group))})
            out[group] = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        result = interpreter.TensorHandle(out.view(np.float16).reshape(values[0].data.shape), tl.float16)
        return type("Call", (), {"get_result": lambda self, i: result})()

    return create_inline_asm


@pytest.mark.parametrize("groups", ["strided", "adjacent"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kv_lens,q_lens", [([45], [1]), ([40, 9], [5, 9])], ids=["decode", "extend"])
def test_the_gpu_half_tiles_match_the_fp32_tiles(monkeypatch, groups, bits, kv_lens, q_lens):
    """HALF_TILES 2 and fp16 dots, the GPU's branch (masks, the asm, times 2^-offset, q scaled then cast), under the
    interpreter with the asm run by the emulator whichever four elements share an operand: the fp32 tiles' answer up
    to fp16 rounding."""
    from headroom.kernels import paged_attention as pa
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _emulated_asm(groups), raising=False)
    kernel = pa.paged_attention_fwd_kernel

    class OnTheGpuBranch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                assert kwargs["HALF_TILES"] == 1  # (the interpreter's own choice; the GPU's is 2)
                # The GPU's dots too: fp16 q (the softmax scale folded in) against the fp16 tiles, fp16 p.
                return kernel[grid](*args, **{**kwargs, "HALF_TILES": 2, "DOT_FP32": False, "ROUND_TILES": True})
            return launch

    head_dim = 70 if len(kv_lens) > 1 else 64
    kv, table = make_pool("kivi", bits, 2, head_dim, kv_lens, torch.bfloat16)
    q, positions, offsets = _batch(kv_lens, q_lens, 4, head_dim, torch.bfloat16)
    args = (q, positions, offsets, table, torch.zeros(len(kv_lens), dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32), kv, head_dim**-0.5)
    with pa.tuned(extend=FP32_TILES, decode=FP32_TILES):
        want, want_lse = paged_attention(*args)
    monkeypatch.setattr(pa, "paged_attention_fwd_kernel", OnTheGpuBranch())
    for table_ in (pa.DECODE_TUNING, pa.EXTEND_TUNING):
        monkeypatch.setitem(table_, "half_tiles", 1)
    got, got_lse = paged_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=6e-3, rtol=6e-3)
    torch.testing.assert_close(got_lse, want_lse, atol=6e-3, rtol=1e-3)


@pytest.mark.parametrize("block_m,load_per_token,bits", [(16, True, 2), (128, True, 2), (16, False, 2), (16, True, 4),
                                                       (128, True, 8)],
                         ids=["decode", "extend", "decode-one-load", "decode-int4", "extend-int8"])
def test_half_tiles_compile_for_sm90(block_m, load_per_token, bits):
    """HALF_TILES' GPU variant compiled for the H200 (PTX, no GPU needed), the inline asm in it: the interpreter
    runs the Triton codes instead and never sees the asm."""
    from tests.kernels.sm90 import compile_sm90

    pointers = {name: "*i32" for name in ("q_pos", "q_offsets", "kv_table", "kv_start", "kv_lens")}
    pointers.update(q="*bf16", o="*fp32", lse="*fp32", k="*u8", v="*u8", k_scale="*fp16", k_zero="*fp16",
                    v_scale="*fp16", v_zero="*fp16", prev_o="*fp32", prev_lse="*fp32", sm_scale="fp32")
    constants = {"GROUP": 4, "HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_M": block_m, "BLOCK_N": 64, "KIND": 2,
                 "BITS": bits, "PAGE": 32, "GROUP_D": 32, "DOT_FP32": False, "DOT_PRECISION": "tf32",
                 "ROUND_TILES": True, "PAGE_TILE": True, "CONTINUE": False, "PDL": False, "MASK_SPLIT": block_m > 16,
                 "LAZY_RESCALE": False, "MAGIC_IN_REGISTER": True, "LOAD_PER_TOKEN": load_per_token, "HALF_TILES": 2}
    [result] = compile_sm90([("headroom.kernels.paged_attention", "paged_attention_fwd_kernel", pointers, constants)],
                            num_warps=4 if block_m == 16 else 8, num_stages=2)
    assert result["ok"], result.get("error")
    assert "prmt.b32" in result["ptx"] and "sub.f16x2" in result["ptx"]


def test_a_register_cap_reaches_the_launch(monkeypatch):
    """max_registers in a tuning (half_tiles' decode loop fits three programs a multiprocessor under 168) reaches
    the general kernel's launch as ptxas' maxnreg, and only where set; the answer is the same."""
    from headroom.kernels import paged_attention as pa

    kv, table = make_pool("kivi", 2, 2, 64, [64], torch.bfloat16)
    q, positions, offsets = _batch([64], [1], 4, 64, torch.bfloat16)
    args = (q, positions, offsets, table, torch.zeros(1, dtype=torch.int32), torch.tensor([64], dtype=torch.int32),
            kv, 0.125)
    caps: list = []
    kernel = pa.paged_attention_fwd_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*a, **k):
                caps.append(k.get("maxnreg"))
                return kernel[grid](*a, **k)
            return launch

    monkeypatch.setattr(pa, "paged_attention_fwd_kernel", Recorded())
    want = paged_attention(*args)[0]
    monkeypatch.setitem(pa.DECODE_TUNING, "max_registers", 168)
    got = paged_attention(*args)[0]
    assert caps == [None, 168] and torch.equal(got, want)
