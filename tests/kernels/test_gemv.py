"""The decode GEMV (kernels/gemv.py, Triton interpreter on CPU) against torch's F.linear: one row and several, with and
without a split over K (summed in the same launch), shapes that no block divides; bf16 one row as int32 pairs, with
K a multiple of the tile (no K masks) and with a ragged tail, odd K and views that start mid-pair (2-byte loads).
The fused SwiGLU down projection (silu_mul_gemv) against silu_mul then the GEMV, and its own table entries. 2-8 rows
on the CUDA cores (rows_on_cores) in bf16 pairs and fp32, whole accumulator and summed every tile (ROW_SUM)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from headroom.kernels.gemv import GemvConfig, gemv  # noqa: E402


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_matches_naive(rows, split):
    gen = torch.Generator().manual_seed(rows * 10 + split)
    x = torch.randn(rows, 200, generator=gen)
    w = torch.randn(70, 200, generator=gen)
    out = gemv(x, w, GemvConfig(block_n=32, block_k=64, split=split, num_stages=2))
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)


def _case(seed: int, rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 operands for one row; fp32 for several: the interpreter's tl.dot gives garbage on bf16 operands (so did
    the kernel before this one's changes; the GPU sweep checks bf16 against cuBLAS at every shape)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if rows == 1 else torch.float32
    return (torch.randn(rows, k, generator=gen).to(dtype), (torch.randn(n, k, generator=gen) * 0.05).to(dtype))


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=0.02, rtol=0.01)


@pytest.mark.parametrize("rows", [1, 2, 16])
@pytest.mark.parametrize(("k", "block_k", "split"), [
    (512, 128, 1),  # K a multiple of the tile: EVEN_K
    (512, 128, 3),  # ... split over K unevenly (2, 1 and 1 tiles)
    (1152, 128, 9),  # K long against the rows (the MLP down projection's 9216 / 8): a tile a split
    (328, 64, 2),  # ragged tail, K even: the last pair tile masked
    (203, 64, 2),  # odd K: no pairs
])
def test_gemv_bf16_tiles_tails_and_splits(rows, k, block_k, split):
    x, w = _case(rows * 1000 + k + split, rows, 40, k)  # 40 rows: the last block of 16 is partial
    _check(gemv(x, w, GemvConfig(block_n=16, block_k=block_k, split=split, num_stages=2)), x, w)


@pytest.mark.parametrize("rows", [2, 8, 16])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k", "split"), [
    (200, 256, 64, 128, 1),  # EVEN_K; the last block of 64 weight rows partial
    (130, 328, 128, 64, 1),  # K not a multiple of the tile: the last tile masked along K
    (72, 600, 64, 128, 3),  # split over K with a ragged tail: fp32 partials parked [M, N] and summed
])
def test_gemv_swap_ab(rows, n, k, block_n, block_k, split):
    """swap_ab (the weight tile the MMA's M operand, the accumulator out.T's block) against F.linear, and against
    the same tiles unswapped: stored back as [M, N], through the split workspace too, rows past M left out."""
    x, w = _case(rows * 100 + k + split, rows, n, k)
    swapped = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2, swap_ab=True)
    got = gemv(x, w, swapped)
    _check(got, x, w)
    plain = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2)
    torch.testing.assert_close(got, gemv(x, w, plain), atol=1e-4, rtol=1e-4)


def test_gemv_swap_ab_one_row_is_the_row_kernel():
    """One row has no MMA: a swap_ab config runs the one-row kernel, the same result bit for bit."""
    x, w = _case(9, 1, 70, 256)
    config = GemvConfig(block_n=16, block_k=64, split=2, num_stages=2)
    assert torch.equal(gemv(x, w, GemvConfig(**{**vars(config), "swap_ab": True})), gemv(x, w, config))


def _row_sum(rows: int, config: GemvConfig, pairs: bool) -> bool:
    """Whether the launch sums rows_on_cores' products every tile (its accumulator over the register budget)."""
    import triton
    from headroom.kernels.gemv import CORE_ROWS_ACC_REGS

    units = config.block_k // (2 if pairs else 1)
    return triton.next_power_of_2(rows) * config.block_n * units // (32 * config.num_warps) > CORE_ROWS_ACC_REGS


# (n, k, block_n, block_k, split, num_warps): the tiles of test_gemv_rows_on_cores.
CORE_ROW_TILES = [
    (40, 512, 16, 128, 1, 4),  # EVEN_K; the last block of 16 weight rows partial
    (130, 328, 8, 64, 2, 4),  # ragged K (the last tile masked along K), split over K
    (72, 600, 8, 128, 3, 2),  # split over K unevenly with a ragged tail: fp32 partials parked [M, N] and summed
    (200, 512, 32, 256, 1, 1),  # accumulator past CORE_ROWS_ACC_REGS even at 2 rows: ROW_SUM
    (64, 203, 16, 64, 2, 4),  # odd K: no pairs
]


@pytest.mark.parametrize("rows", [2, 3, 5, 8])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k", "split", "warps"), CORE_ROW_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_rows_on_cores(rows, n, k, block_n, block_k, split, warps, dtype):
    """Several rows on the CUDA cores (no dot, so bf16 runs in the interpreter: int32 pairs for even K), rows
    rounded up to a power of two (rows past M repeat the last and are not stored) against F.linear; swap_ab
    ignored."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + split)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_warps=warps, num_stages=2,
                        rows_on_cores=True)
    pairs = dtype == torch.bfloat16 and k % 2 == 0
    assert _row_sum(rows, config, pairs) == (block_n == 32)
    got = gemv(x, w, config)
    if dtype == torch.float32:
        torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)
    else:
        _check(got, x, w)
    assert torch.equal(got, gemv(x, w, GemvConfig(**{**vars(config), "swap_ab": True})))


def test_gemv_rows_on_cores_strided_rows_and_the_rows_it_leaves():
    """Rows of a wider tensor: an even row stride and a pair-aligned start take pairs, an odd stride 2-byte loads
    (the same result); one row and 9-16 rows ignore rows_on_cores (the one-row kernel, the tensor cores)."""
    gen = torch.Generator().manual_seed(21)
    wide = torch.randn(4, 260, generator=gen).to(torch.bfloat16)
    w = (torch.randn(24, 256, generator=gen) * 0.05).to(torch.bfloat16)
    config = GemvConfig(block_n=16, block_k=64, split=2, num_stages=2, rows_on_cores=True)
    even = wide[:, 2:258]  # row stride 260, starts on a pair
    _check(gemv(even, w, config), even, w)
    odd = torch.cat([wide, wide[:, :1]], dim=1)[:, :256]  # row stride 261: no pairs
    torch.testing.assert_close(gemv(odd, w, config).float(), F.linear(odd.float(), w.float()), atol=0.02, rtol=0.01)
    plain = GemvConfig(block_n=16, block_k=64, split=2, num_stages=2)
    assert torch.equal(gemv(even[:1], w, config), gemv(even[:1], w, plain))
    x16, w32 = _case(22, 12, 24, 256)
    assert torch.equal(gemv(x16, w32, config), gemv(x16, w32, plain))


def test_gemv_split_counters_return_to_zero():
    """Each output block's last split sums the partials and resets its counter, so the next launch (or another
    kernel sharing quant_matmul's counters) starts from zero."""
    from headroom.kernels.quant_matmul import _counters

    x, w = _case(7, 1, 48, 256)
    for _ in range(2):
        _check(gemv(x, w, GemvConfig(block_n=16, block_k=64, split=4, num_stages=2)), x, w)
    assert not _counters(x.device).any()


def test_gemv_strided_and_misaligned_rows():
    """Rows of a wider tensor (stride over K) for several rows; one row whose view starts mid-pair takes 2-byte
    loads, one that starts on a pair takes pairs: the same result."""
    x_wide, w = _case(11, 4, 24, 258)
    x = x_wide[:, :256]
    w = w[:, :256].contiguous()
    _check(gemv(x, w, GemvConfig(block_n=16, block_k=64, split=2, num_stages=2)), x, w)
    x_wide, w = x_wide.to(torch.bfloat16), w.to(torch.bfloat16)
    row = x_wide[1, 1:257].unsqueeze(0)  # data_ptr 2 bytes past a pair
    assert row.data_ptr() % 4 == 2
    _check(gemv(row, w, GemvConfig(block_n=16, block_k=64, num_stages=2)), row, w)
    odd = torch.cat([x_wide, x_wide[:, :1]], dim=1)  # rows of 259 elements: an odd row stride
    aligned = odd[1:2, 1:257]  # starts at element 260, on a pair: pairs, though [1, K] could not be viewed so
    assert aligned.data_ptr() % 4 == 0 and aligned.stride(0) == 259
    torch.testing.assert_close(gemv(aligned, w, GemvConfig(block_n=16, block_k=64, num_stages=2)).float(),
                               F.linear(aligned.float(), w.float()), atol=0.02, rtol=0.01)


def test_gemv_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"w \(4, 9\)"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 9))


def test_tuned_gemv_runs_only_the_shipped_shapes(monkeypatch):
    from headroom.kernels import gemv as module

    monkeypatch.setattr(module, "_tuned", {(70, 200, 1, "x"): GemvConfig(block_n=32, block_k=64, num_stages=2)})
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(70, 200, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 200, generator=gen).to(torch.bfloat16)
    got = module.tuned_gemv(x[:1], w)
    assert got is not None
    torch.testing.assert_close(got.float(), F.linear(x[:1].float(), w.float()), atol=0.05, rtol=0.02)
    assert module.tuned_gemv(x, w) is None  # two rows: not in the table, cuBLAS runs
    assert module.tuned_gemv(x[:1].float(), w.float()) is None  # fp32: the table is for bf16


def test_tuned_configs_are_per_gpu_and_triton_version(monkeypatch, tmp_path):
    import json

    import triton
    from headroom.kernels import gdn_fla
    from headroom.kernels import gemv as module

    entry = {"n": 8, "k": 16, "m": 1, "block_n": 16, "block_k": 128, "split": 2, "num_warps": 4, "num_stages": 3}
    # (an entry may carry l2_prefetch; one without it asks L2 for nothing)
    prefetching = {**entry, "n": 24, "l2_prefetch": 2}
    table = tmp_path / "gemv_tuned_configs.json"
    table.write_text(json.dumps({"GPU_A": {"triton": triton.__version__, "configs": [entry, prefetching]},
                                 "GPU_B": {"triton": "0.0.1", "configs": [entry]}}))
    monkeypatch.setattr(module, "TUNED_CONFIGS", table)
    cuda = torch.device("cuda")
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_A")
    assert module.load_tuned_configs(cuda) == {(8, 16, 1, "x"): GemvConfig(16, 128, 2, 4, 3),
                                               (24, 16, 1, "x"): GemvConfig(16, 128, 2, 4, 3, l2_prefetch=2)}
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_B")
    assert module.load_tuned_configs(cuda) == {}  # another Triton version's timings
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_C")
    assert module.load_tuned_configs(cuda) == {}
    assert module.load_tuned_configs(torch.device("cpu")) == {}


def test_a_row_count_without_an_entry_takes_the_next_larger_ones_only_with_nearest_rows(monkeypatch):
    from headroom.kernels import gemv as module

    one, eight, sixteen = GemvConfig(8, 64), GemvConfig(32, 128, swap_ab=True), GemvConfig(64, 128, swap_ab=True)
    fused = GemvConfig(16, 64, rows_on_cores=True)
    monkeypatch.setattr(module, "_tuned", {(24, 64, 1, "x"): one, (24, 64, 8, "x"): eight, (24, 64, 16, "x"): sixteen,
                                           (24, 64, 8, "silu_mul"): fused, (40, 64, 16, "x"): sixteen})
    w = torch.zeros(24, 64, dtype=torch.bfloat16)

    def config(rows: int, kind: str = "x", weight: torch.Tensor = w):
        return module._tuned_config(torch.zeros(rows, 64, dtype=torch.bfloat16), weight, kind)

    monkeypatch.setattr(module, "NEAREST_ROWS", False)
    assert [config(m) for m in (1, 3, 8, 12, 16)] == [one, None, eight, None, sixteen]
    monkeypatch.setattr(module, "NEAREST_ROWS", True)
    assert [config(m) for m in (1, 2, 7, 8, 9, 15, 16)] == [one, eight, eight, eight, sixteen, sixteen, sixteen]
    assert [config(m, "silu_mul") for m in (1, 5, 9)] == [None, fused, None]  # the same input kind only
    assert config(3, weight=torch.zeros(40, 64, dtype=torch.bfloat16)) == sixteen
    assert config(17) is None


def _launched_variants(monkeypatch, module, table, rows, keep=lambda n, k: True) -> set:
    """What Triton would compile for launches of `rows` rows on every shape of `table` through the real lookup and
    launcher: the kernel, the entry, the class of the row count (1, a multiple of 16, the rest) and every
    constexpr the launch passes. The kernels are stand-ins that record their launches and run nothing."""
    launches: list = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                launches.append((self.name, tuple(sorted((key, str(value)) for key, value in constexprs.items()))))
            return launch

    monkeypatch.setattr(module, "gemv_fwd_kernel", Recorder("gemv"))
    monkeypatch.setattr(module, "gemv_stream_fwd_kernel", Recorder("stream"))
    monkeypatch.setattr(module, "_tuned", table)
    got = set()
    for n, k, kind in {(n, k, kind) for n, k, _, kind in table if keep(n, k)}:
        w = torch.zeros(n, k, dtype=torch.bfloat16)
        for m in rows:
            x = torch.zeros(m, 2 * k if kind == "silu_mul" else k, dtype=torch.bfloat16)
            gate, up = x.split([k, k], dim=-1) if kind == "silu_mul" else (x, None)
            config = module._tuned_config(gate, w, kind)
            if config is None:
                continue
            launches.clear()
            if up is None:
                module.gemv(x, w, config)
            else:
                module.silu_mul_gemv(gate, up, w, config)
            got |= {(id(config), m == 1, m % 16 == 0, *launch) for launch in launches}
    return got


def test_warm_up_rows_launch_every_variant_a_pass_of_up_to_16_rows_can_take(monkeypatch):
    """Every variant that launches of 1-16 rows compile through the real lookup and launcher (their constexprs
    recorded) is launched at one of the warm-up's row counts (those already run plus warm_up_rows'), NEAREST_ROWS
    on and off, for the H100's kind of table (2- and 4-row entries on one shape, a CUDA-core 8-row entry, whose
    tile follows the row count) and random ones with CUDA-core and stream-K entries; also with shapes left out
    (the LM head's, covered by batches) and with fewer rows than 16 (max_running_requests)."""
    import random

    from headroom.kernels import gemv as module

    def config(m, rng=None):
        if rng is None:
            return GemvConfig(8 * m, 64, rows_on_cores=m == 8)
        return GemvConfig(rng.choice([8, 16]), 64, split=rng.choice([1, 2]), rows_on_cores=rng.random() < 0.4,
                          swap_ab=rng.random() < 0.5, stream=rng.choice([0, 0, 1]))

    h100_like = {(n, 64, m, "x"): config(m) for n in (24, 40) for m in (1, 8, 16)}
    h100_like.update({(24, 64, 2, "x"): config(2), (24, 64, 4, "x"): config(4), (40, 64, 8, "silu_mul"): config(8)})
    already = (1, 3, 7, 16, 37)
    monkeypatch.setattr(module, "NEAREST_ROWS", True)
    # 2 rows: the 2-row entry and the CUDA-core 8-row entry's tile of 2 rows (3 and 7 launch its tiles of 4 and
    # 8); 9-15: the 16-row entries in their non-multiple-of-16 variant.
    assert module.rows_covering(h100_like, already) == (2, 9)
    assert module.rows_covering(h100_like, already, keep=lambda n, k: n == 40, most=8) == (2,)
    monkeypatch.setattr(module, "NEAREST_ROWS", False)
    assert module.rows_covering(h100_like, already) == (2, 4, 8)
    assert module.rows_covering({}, already) == ()
    rng = random.Random(7)
    for nearest in (True, False):
        monkeypatch.setattr(module, "NEAREST_ROWS", nearest)
        for case in range(25):
            table = {(n, 64, m, kind): config(m, rng) for n in (24, 40) for kind in ("x", "silu_mul")
                     for m in rng.sample(range(1, 17), rng.randint(0, 5))}
            start = tuple(rng.sample(range(1, 17), rng.randint(0, 4)))
            keep, most = (lambda n, k: n == 24, rng.randint(1, 16)) if case % 3 == 0 else (lambda n, k: True, 16)
            rows = module.rows_covering(table, start, keep, most) + start
            assert _launched_variants(monkeypatch, module, table, [m for m in rows if m <= most], keep) == \
                _launched_variants(monkeypatch, module, table, range(1, most + 1), keep), (nearest, table, start)
    assert module.warm_up_rows(torch.device("cpu"), already) == ()


def test_the_shipped_table_gives_each_shape_one_config(monkeypatch, tmp_path):
    """Two layers of one shape (gdn_out_proj and attn_o_proj are both 2560 x 4096) share a key: entries that
    disagree would leave the engine running whichever the loader read last, whatever the other's figures say
    (session 23's in-step tuning rewrote such pairs together)."""
    import json

    import triton
    from headroom.kernels import gdn_fla
    from headroom.kernels import gemv as module

    shipped_path, cuda = module.TUNED_CONFIGS, torch.device("cuda")

    def load(path):
        monkeypatch.setattr(module, "TUNED_CONFIGS", path)
        return module.load_tuned_configs(cuda)

    shipped = json.loads(shipped_path.read_text())
    assert shipped
    for gpu, table in shipped.items():
        monkeypatch.setattr(triton, "__version__", table["triton"])
        monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None, gpu=gpu: gpu)
        loaded = load(shipped_path)
        for entry in table["configs"]:
            alone = tmp_path / "one.json"
            alone.write_text(json.dumps({gpu: {**table, "configs": [entry]}}))
            (key, config), = load(alone).items()
            assert loaded[key] == config, (gpu, entry.get("layer"), key)
            assert config.prefetch in (1, 2, 4) and config.l2_prefetch in (0, 1, 2, 4, 8), (gpu, key)


def _gate_up(seed: int, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A gate|up projection's output [rows, 2K] (gate first), as MergedLinear returns it before the split."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * k, generator=gen) * 2).to(dtype)


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize(("k", "block_k", "split"), [
    (512, 128, 1),  # EVEN_K, no split
    (512, 128, 3),  # split over K unevenly
    (1152, 128, 9),  # the down projection's long K (9216 / 8): a tile a split
    (328, 64, 2),  # ragged tail, K even: the up half starts on a pair, the last pair tile masked
    (203, 64, 2),  # odd K: no pairs, the up half starts mid-pair
])
def test_silu_mul_gemv_is_silu_mul_then_gemv(rows, k, block_k, split):
    """The fused down projection reads gate and up as column views of one gate|up output and equals, bit for
    bit, silu_mul's output (gates_triton, same fp32 silu and roundings) through the same GEMV configuration; and
    the torch reference within bf16 error. bf16 for one row, fp32 for several (see _case)."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import naive_silu_mul_gemv, silu_mul_gemv

    dtype = torch.bfloat16 if rows == 1 else torch.float32
    gate_up = _gate_up(rows * 1000 + k + split, rows, k, dtype)
    gate, up = torch.split(gate_up, [k, k], dim=-1)
    _, w = _case(k + split, rows, 40, k)
    config = GemvConfig(block_n=16, block_k=block_k, split=split, num_stages=2)
    got = silu_mul_gemv(gate, up, w, config)
    assert got.dtype == dtype and got.shape == (rows, 40)
    assert torch.equal(got, gemv(silu_mul(gate, up), w, config))
    want = naive_silu_mul_gemv(gate.float(), up.float(), w.float())
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [2, 5, 8])
@pytest.mark.parametrize(("k", "block_k", "split", "block_n"), [
    (256, 128, 1, 16),  # EVEN_K
    (328, 64, 2, 8),  # ragged tail, split
    (512, 256, 3, 32),  # ROW_SUM (with 1 warp), split
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_gemv_rows_on_cores(rows, k, block_k, split, block_n, dtype):
    """The fused down projection with rows on the CUDA cores (gate and up column views of one gate|up output, as
    pairs in bf16): equal to silu_mul then the same GEMV bit for bit, and to the reference within bf16 error."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import naive_silu_mul_gemv, silu_mul_gemv

    gate, up = torch.split(_gate_up(rows * 10 + k, rows, k, dtype), [k, k], dim=-1)
    w = (torch.randn(70, k, generator=torch.Generator().manual_seed(k)) * 0.05).to(dtype)
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2,
                        num_warps=1 if block_n == 32 else 4, rows_on_cores=True)
    got = silu_mul_gemv(gate, up, w, config)
    assert got.dtype == dtype and got.shape == (rows, 70)
    assert torch.equal(got, gemv(silu_mul(gate, up), w, config))
    want = naive_silu_mul_gemv(gate.float(), up.float(), w.float())
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [2, 16])
@pytest.mark.parametrize(("k", "block_k", "split"), [(256, 128, 1), (328, 64, 2)])
def test_silu_mul_gemv_swap_ab(rows, k, block_k, split):
    """The fused down projection with swap_ab: equal to silu_mul then the swapped GEMV, and to the reference."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import naive_silu_mul_gemv, silu_mul_gemv

    gate, up = torch.split(_gate_up(rows * 10 + k, rows, k, torch.float32), [k, k], dim=-1)
    _, w = _case(k + split, rows, 100, k)
    config = GemvConfig(block_n=64, block_k=block_k, split=split, num_stages=2, swap_ab=True)
    got = silu_mul_gemv(gate, up, w, config)
    assert got.shape == (rows, 100)
    assert torch.equal(got, gemv(silu_mul(gate, up), w, config))
    want = naive_silu_mul_gemv(gate, up, w)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_silu_mul_gemv_separate_and_misaligned_halves():
    """gate and up as two tensors of different row strides (an unmerged gate / up), and one bf16 row whose
    gate|up view starts mid-pair (2-byte loads, not pairs): the same result as silu_mul then gemv."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import naive_silu_mul_gemv, silu_mul_gemv

    config = GemvConfig(block_n=16, block_k=64, split=2, num_stages=2)
    _, w = _case(3, 4, 24, 256)
    gate = _gate_up(1, 4, 131, torch.float32)[:, :256]  # row stride 262
    up = _gate_up(2, 4, 256, torch.float32)[:, 256:]  # row stride 512: the up half of another buffer
    assert gate.stride(0) != up.stride(0)
    assert torch.equal(silu_mul_gemv(gate, up, w, config), gemv(silu_mul(gate, up), w, config))
    wide = _gate_up(4, 1, 257, torch.bfloat16)
    row = wide[:, 1:513]  # starts 2 bytes past a pair
    gate, up = row[:, :256], row[:, 256:]
    assert gate.data_ptr() % 4 == 2
    w = w.to(torch.bfloat16)
    got = silu_mul_gemv(gate, up, w, config)
    torch.testing.assert_close(got.float(), naive_silu_mul_gemv(gate, up, w).float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(got.float(), gemv(silu_mul(gate, up), w, config).float(), atol=1e-2, rtol=1e-2)


def test_silu_mul_gemv_refuses_mismatched_halves():
    from headroom.kernels.gemv import silu_mul_gemv

    with pytest.raises(ValueError, match="same"):
        silu_mul_gemv(torch.zeros(1, 8), torch.zeros(1, 6), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="same"):
        silu_mul_gemv(torch.zeros(1, 8), torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8))


def test_tuned_silu_mul_gemv_runs_only_its_own_entries(monkeypatch):
    """The fused down projection runs only where the table has its own entry ("silu_mul" input); a plain entry
    for the same shape (timed against cuBLAS alone) does not enable it, nor the other way round."""
    from headroom.kernels import gemv as module

    config = GemvConfig(block_n=32, block_k=64, num_stages=2)
    gate_up = _gate_up(6, 1, 200, torch.bfloat16)
    gate, up = gate_up[:, :200], gate_up[:, 200:]
    w = (torch.randn(70, 200, generator=torch.Generator().manual_seed(6)) * 0.05).to(torch.bfloat16)
    monkeypatch.setattr(module, "_tuned", {(70, 200, 1, "silu_mul"): config})
    got = module.tuned_silu_mul_gemv(gate, up, w)
    assert got is not None and torch.equal(got, module.silu_mul_gemv(gate, up, w, config))
    assert module.tuned_gemv(gate.contiguous(), w) is None  # the plain shape: not in the table
    assert module.tuned_silu_mul_gemv(gate.float(), up.float(), w.float()) is None  # the table is for bf16
    assert module.tuned_silu_mul_gemv(torch.cat([gate, gate]), torch.cat([up, up]), w) is None  # 2 rows
    monkeypatch.setattr(module, "_tuned", {(70, 200, 1, "x"): config})
    assert module.tuned_silu_mul_gemv(gate, up, w) is None


def test_tuned_configs_keep_plain_and_fused_entries_apart(monkeypatch, tmp_path):
    """A table written before the fused entries (no "input") loads as plain entries; a fused entry of the same
    shape and rows gets a key of its own. An entry without "swap_ab" is unswapped; one with it keeps it; so for
    "rows_on_cores"."""
    import json

    import triton
    from headroom.kernels import gdn_fla
    from headroom.kernels import gemv as module

    plain = {"n": 2560, "k": 9216, "m": 1, "block_n": 16, "block_k": 512, "split": 4, "num_warps": 4,
             "num_stages": 3}
    fused = {**plain, "input": "silu_mul", "block_n": 32, "split": 2}
    swapped = {**plain, "m": 8, "block_n": 128, "block_k": 128, "swap_ab": True}
    cores = {**plain, "n": 18432, "k": 2560, "m": 8, "block_n": 8, "block_k": 512, "split": 1, "swap_ab": False,
             "rows_on_cores": True}
    table = tmp_path / "gemv_tuned_configs.json"
    table.write_text(json.dumps({"GPU_A": {"triton": triton.__version__,
                                           "configs": [plain, fused, swapped, cores]}}))
    monkeypatch.setattr(module, "TUNED_CONFIGS", table)
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_A")
    assert module.load_tuned_configs(torch.device("cuda")) == {
        (2560, 9216, 1, "x"): GemvConfig(16, 512, 4, 4, 3), (2560, 9216, 1, "silu_mul"): GemvConfig(32, 512, 2, 4, 3),
        (2560, 9216, 8, "x"): GemvConfig(128, 128, 4, 4, 3, swap_ab=True),
        (18432, 2560, 8, "x"): GemvConfig(8, 512, 1, 4, 3, rows_on_cores=True)}


def test_compiles_for_the_h200():
    """The GPU compiler takes every variant the engine launches - one row (bf16 pairs) with and without a split,
    16 rows on the tensor cores, each plain and with SwiGLU's activation fused (SILU_MUL) - with PDL on and off
    (the interpreter ran a one-row GEMV that Triton's sm_90 compiler rejected, session 10); with PDL the kernel
    waits on its producer (griddepcontrol). 16 rows with SWAP_AB and 64 or 128 weight rows a tile compile to
    wgmma (the point of swapping: 16 rows as the M side are too few for it); CORE_ROWS to no MMA at all."""
    from tests.kernels.sm90 import compile_sm90

    variants = []
    for rows, split in ((1, False), (1, True), (16, False), (16, True)):
        for silu_mul in (False, True):
            for pdl in (False, True):
                pairs = rows == 1
                x = "*i32" if pairs else "*bf16"
                pointers = {"x": x, "up": x, "w": x, "out": "*bf16", "ws": "*fp32", "counters": "*i32"}
                constants = {"BLOCK_M": rows, "BLOCK_N": 16 if pairs else 32, "BLOCK_K": 512 if pairs else 128,
                             "NUM_STAGES": 3, "EVEN_K": True, "SPLIT": split, "PAIRS": pairs, "SILU_MUL": silu_mul,
                             "PDL": pdl, "SWAP_AB": False, "CORE_ROWS": False,
                             "ROW_SUM": False}
                variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, constants))
    # A ragged K (masked tiles) with the activation fused: one row 2 bytes a load, and 16 rows.
    for rows in (1, 16):
        pointers = {"x": "*bf16", "up": "*bf16", "w": "*bf16", "out": "*bf16", "ws": "*fp32", "counters": "*i32"}
        variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
            "BLOCK_M": rows, "BLOCK_N": 32, "BLOCK_K": 128, "NUM_STAGES": 3, "EVEN_K": False, "SPLIT": True,
            "PAIRS": False, "SILU_MUL": True, "PDL": True, "SWAP_AB": False, "CORE_ROWS": False,
            "ROW_SUM": False}))
    # Swapped: plain without a split, fused with one, and a ragged K.
    for block_n, split, silu_mul, even_k in ((64, False, False, True), (128, True, True, True),
                                             (64, True, True, False)):
        pointers = {"x": "*bf16", "up": "*bf16", "w": "*bf16", "out": "*bf16", "ws": "*fp32", "counters": "*i32"}
        variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
            "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128, "NUM_STAGES": 4, "EVEN_K": even_k, "SPLIT": split,
            "PAIRS": False, "SILU_MUL": silu_mul, "PDL": True, "SWAP_AB": True, "CORE_ROWS": False,
            "ROW_SUM": False}))
    # Rows on the CUDA cores: 8 rows as pairs (whole accumulator) plain and fused, with and without a split; 2 rows
    # summed every tile (ROW_SUM); 4 rows ragged, 2-byte loads.
    for rows, block_n, block_k, pairs, even_k, split, silu_mul, row_sum in (
            (8, 8, 512, True, True, False, False, False), (8, 16, 256, True, True, True, True, False),
            (2, 32, 512, True, True, True, False, True), (4, 8, 256, False, False, True, True, False)):
        x = "*i32" if pairs else "*bf16"
        pointers = {"x": x, "up": x, "w": x, "out": "*bf16", "ws": "*fp32", "counters": "*i32"}
        variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
            "BLOCK_M": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 3, "EVEN_K": even_k,
            "SPLIT": split, "PAIRS": pairs, "SILU_MUL": silu_mul, "PDL": True, "SWAP_AB": False, "CORE_ROWS": True,
            "ROW_SUM": row_sum}))
    # Tiles loaded before the PDL wait (prefetch): one row, swapped 16 rows, 8 rows on the CUDA cores.
    for rows, block_n, block_k, pairs, swap, cores, prefetch in ((1, 8, 512, True, False, False, 4),
                                                                 (16, 128, 64, False, True, False, 2),
                                                                 (8, 8, 512, True, False, True, 4)):
        x = "*i32" if pairs else "*bf16"
        pointers = {"x": x, "up": x, "w": x, "out": "*bf16", "ws": "*fp32", "counters": "*i32"}
        variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
            "BLOCK_M": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 3, "EVEN_K": True,
            "SPLIT": False, "PAIRS": pairs, "SILU_MUL": False, "PDL": True, "SWAP_AB": swap, "CORE_ROWS": cores,
            "ROW_SUM": False, "PREFETCH": prefetch}))
    for (_, _, _, constants), result in zip(variants, compile_sm90(variants), strict=True):
        assert result["ok"], (constants, result.get("error"))
        assert ("griddepcontrol.wait" in result["ptx"]) == constants["PDL"], constants
        # the fused variants compute silu (an exp: ex2 in PTX); the plain ones do not
        assert ("ex2" in result["ptx"]) == constants["SILU_MUL"], constants
        if constants["SWAP_AB"]:
            assert "wgmma.mma_async" in result["ptx"], constants
        if constants["CORE_ROWS"]:
            assert "mma" not in result["ptx"], constants


@pytest.mark.parametrize("prefetch", [2, 4])
@pytest.mark.parametrize(("rows", "k", "block_k", "split", "rows_on_cores"), [
    (1, 1024, 128, 1, False),  # one row, eight tiles: four loaded before the loop takes the rest
    (1, 512, 128, 3, False),  # splits of 2, 1 and 1 tiles: the last split's one tile bounds the prefetch to 1
    (1, 328, 64, 2, False),  # a ragged tail (masked pair tile)
    (4, 640, 64, 2, True),  # several rows on the CUDA cores
    (16, 512, 64, 1, False),  # the tensor cores
])
def test_prefetched_tiles_give_the_same_sums(prefetch, rows, k, block_k, split, rows_on_cores):
    """GemvConfig.prefetch: weight tiles loaded before the (PDL) wait, then multiplied in order: the same answer bit
    for bit as one tile first, and within reach of F.linear; a split shorter than the prefetch takes fewer."""
    x, w = _case(rows * 7 + k + prefetch, rows, 40, k)
    plain = GemvConfig(block_n=16, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores)
    ahead = GemvConfig(**{**vars(plain), "prefetch": prefetch})
    got = gemv(x, w, ahead)
    assert torch.equal(got, gemv(x, w, plain))
    _check(got, x, w)


def test_a_prefetch_outside_1_2_4_is_refused():
    x, w = _case(1, 1, 8, 256)
    with pytest.raises(ValueError, match="prefetch=3 must be 1, 2 or 4"):
        gemv(x, w, GemvConfig(block_n=16, block_k=64, prefetch=3))


def _exact_norm(x: torch.Tensor, sumsq: torch.Tensor, weight: torch.Tensor, eps: float,
                unit_offset: bool) -> torch.Tensor:
    """The rows normed as normed_gemv norms them, from one part per row (so the rows' sum is that part, exactly):
    1 / rms as norm_triton's rms_norm computes it from a sum, then its rounding."""
    # The square root correctly rounded (in fp64, then to fp32), as the kernel's is: a torch CPU build may take a
    # vectorised one that is not (one element in five a unit apart with torch 2.13's, session 21).
    rstd = 1.0 / torch.sqrt((sumsq[:, :1] / x.shape[1] + eps).double()).float()
    if unit_offset:
        return (x.float() * rstd * (1.0 + weight.float())).to(x.dtype)
    return ((x.float() * rstd).to(x.dtype).float() * weight.float()).to(x.dtype)


def _norm_case(seed: int, rows: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    return x, (torch.randn(k, generator=gen) * 0.1).to(dtype)


def _assert_rounding_apart(got: torch.Tensor, want: torch.Tensor, roundings: int = 1) -> None:
    """Equal in fp32; in bf16 at most a unit in the last place apart for each rounding on the way: Triton's
    interpreter casts fp32 to bf16 by truncation (its cast has no rounding mode), torch and the GPU round to
    nearest even."""
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
        return
    ulp = roundings * torch.finfo(got.dtype).eps * want.float().abs().clamp_min(torch.finfo(got.dtype).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all(), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize(("rows", "k", "block_k", "split", "rows_on_cores", "dtype"), [
    (1, 512, 128, 1, False, torch.bfloat16),  # one row as pairs, K a multiple of the tile
    (1, 328, 64, 2, False, torch.bfloat16),  # a ragged pair tail, split over K
    (1, 203, 64, 2, False, torch.bfloat16),  # odd K: no pairs
    (1, 200, 64, 2, False, torch.float32),  # one row in fp32 (exact)
    (4, 512, 128, 3, True, torch.bfloat16),  # rows on the CUDA cores as pairs
    (3, 200, 64, 1, True, torch.float32),  # ... in fp32, rows past M repeat the last
    (16, 328, 64, 2, False, torch.float32),  # the tensor cores (fp32: the interpreter's bf16 dot is garbage)
])
def test_normed_gemv_is_the_norm_then_gemv(unit_offset, rows, k, block_k, split, rows_on_cores, dtype):
    """normed_gemv norms each tile as it loads it, as rms_norm stores the rows: with one part a row (its sum then
    exact) through an identity weight it gives those normed rows (rounding apart; equal in fp32), Qwen3.5's unit
    offset and Qwen3's order alike, and against a real weight what gemv gives on them (equal in fp32)."""
    from headroom.kernels.gemv import RowNorm, naive_normed_gemv, normed_gemv

    x, weight = _norm_case(rows * 31 + k + split, rows, k, dtype)
    sumsq = x.float().pow(2).sum(-1, keepdim=True)
    norm = RowNorm(sumsq, weight, 1e-6, unit_offset)
    normed = _exact_norm(x, sumsq, weight, 1e-6, unit_offset)
    config = GemvConfig(block_n=16, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores)
    # (Qwen3's order rounds twice: the normed x, then its product with the weight)
    _assert_rounding_apart(normed_gemv(x, norm, torch.eye(k, dtype=dtype), config), normed, 1 if unit_offset else 2)
    w = (torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 0.05).to(dtype)
    got = normed_gemv(x, norm, w, config)
    if dtype == torch.float32:
        assert torch.equal(got, gemv(normed, w, config))
    _check(got, normed, w)
    torch.testing.assert_close(got.float(), naive_normed_gemv(x, norm, w).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize(("rows", "num_parts"), [(1, 150), (2, 150), (16, 150), (1, 1100)])
def test_normed_gemv_sums_many_parts_in_chunks(rows, num_parts):
    """More parts than one chunk of the kernel's sum (150 here, more than one round of 1,024 at one row; 320 for
    the 4B model's hidden size in blocks of 8): the rows' 1 / rms from all of them, whatever their count, within
    rounding of the reference norm."""
    from headroom.kernels.gemv import RowNorm, naive_normed_gemv, normed_gemv

    dtype = torch.bfloat16 if rows < 16 else torch.float32
    k = 2 * num_parts
    x, weight = _norm_case(rows, rows, k, dtype)
    w = (torch.randn(24, k, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
    parts = x.float().pow(2).view(rows, num_parts, 2).sum(-1)
    norm = RowNorm(parts.contiguous(), weight, 1e-6, True)
    config = GemvConfig(block_n=8, block_k=64, split=1, num_stages=2, rows_on_cores=rows == 2)
    got = normed_gemv(x, norm, w, config)
    torch.testing.assert_close(got.float(), naive_normed_gemv(x, norm, w).float(), atol=0.03, rtol=0.02)
    # the parts really decide the norm: a quarter of their sum doubles every output
    quarter = normed_gemv(x, RowNorm(parts.contiguous() / 4, weight, 1e-6, True), w, config)
    torch.testing.assert_close(quarter.float(), 2 * got.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize(("rows", "n", "k", "block_n", "block_k", "split", "rows_on_cores", "swap_ab"), [
    (1, 70, 512, 16, 128, 1, False, False),  # one row, the last block partial
    (1, 40, 328, 16, 64, 3, False, False),  # split over K with a ragged tail: the block's last split adds
    (4, 40, 256, 8, 128, 2, True, False),  # rows on the CUDA cores
    (16, 130, 256, 64, 64, 2, False, True),  # swapped tensor-core tiles (fp32)
    (16, 40, 256, 32, 64, 1, False, False),  # unswapped tensor-core tiles (fp32)
])
def test_residual_gemv_adds_the_product_and_sums_its_squares(silu_mul, rows, n, k, block_n, block_k, split,
                                                             rows_on_cores, swap_ab):
    """residual_gemv: out = residual + gemv(x) (or silu_mul_gemv) bit for bit, the product rounded first as F.linear
    rounds it; sumsq [M, blocks] each block's sum of out's squares, within fp32 rounding of the reference."""
    from headroom.kernels.gemv import naive_residual_gemv, residual_gemv, silu_mul_gemv

    x, w = _case(rows * 13 + n + split, rows, n, k)
    gen = torch.Generator().manual_seed(n)
    residual = (torch.randn(rows, n, generator=gen) * 2).to(x.dtype)
    up = (torch.randn(rows, k, generator=gen)).to(x.dtype) if silu_mul else None
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores,
                        swap_ab=swap_ab)
    out, sumsq = residual_gemv(x, w, residual, config, up=up)
    product = gemv(x, w, config) if up is None else silu_mul_gemv(x, up, w, config)
    _assert_rounding_apart(out, residual + product)
    blocks = -(-n // block_n)
    assert sumsq.shape == (rows, blocks) and sumsq.dtype == torch.float32
    padded = torch.nn.functional.pad(out.float(), (0, blocks * block_n - n))
    torch.testing.assert_close(sumsq, padded.pow(2).view(rows, blocks, block_n).sum(-1), atol=1e-3, rtol=1e-5)
    ref_out, ref_sumsq = naive_residual_gemv(x, w, residual, up=up)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(sumsq.sum(-1, keepdim=True), ref_sumsq, atol=0.5, rtol=1e-2)


@pytest.mark.parametrize(("rows", "n", "k", "block_n", "block_k", "split", "rows_on_cores", "swap_ab"), [
    (1, 70, 512, 16, 128, 1, False, False),  # one row, the last block partial
    (1, 40, 328, 16, 64, 3, False, False),  # split over K with a ragged tail: only the last split adds
    (4, 40, 256, 8, 128, 2, True, False),  # rows on the CUDA cores
    (16, 130, 256, 64, 64, 2, False, True),  # swapped tensor-core tiles (fp32), ragged last block
    (9, 40, 256, 32, 64, 3, False, False),  # unswapped tensor-core tiles (fp32), rows past M
])
def test_early_residual_stores_the_same_bits(monkeypatch, rows, n, k, block_n, block_k, split, rows_on_cores,
                                             swap_ab):
    """EARLY_RESIDUAL (the residual's block loaded before the loop, not in the last split's epilogue): residual_gemv,
    with SiLU fused, and residual_prescaled_gemv store what they store without it, bit for bit, in every layout; the
    launches really take the variant (a spy on the kernel's launch)."""
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import NextNorm, residual_gemv, residual_prescaled_gemv

    x, w = _case(rows * 11 + n + split, rows, n, k)
    gen = torch.Generator().manual_seed(n + 3 * rows)
    residual = (torch.randn(rows, n, generator=gen) * 2).to(x.dtype)
    up = torch.randn(rows, k, generator=gen).to(x.dtype)
    norm = NextNorm((torch.randn(n, generator=gen) * 0.3).to(x.dtype), True)
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores,
                        swap_ab=swap_ab)
    kernel, launched = gemv_module.gemv_fwd_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["EARLY_RESIDUAL"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(gemv_module, "gemv_fwd_kernel", Spy())
    runs = {}
    for early in (False, True):
        monkeypatch.setattr(gemv_module, "EARLY_RESIDUAL", early)
        runs[early] = (*residual_gemv(x, w, residual, config), *residual_gemv(x, w, residual, config, up=up),
                       *residual_prescaled_gemv(x, w, residual, norm, config))
    assert launched == [False] * 3 + [True] * 3
    for late, early in zip(runs[False], runs[True], strict=True):
        assert torch.equal(late, early)


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize(("rows", "n", "k", "block_n", "block_k", "split", "rows_on_cores", "swap_ab", "silu_mul"), [
    (1, 70, 512, 16, 128, 1, False, False, False),  # one row, the last block partial
    (4, 40, 256, 8, 128, 2, True, False, True),  # rows on the CUDA cores, split, SwiGLU's input
    (16, 130, 256, 64, 64, 2, False, True, False),  # swapped tensor-core tiles (fp32), ragged last block
    (9, 40, 256, 32, 64, 3, False, False, False),  # unswapped tensor-core tiles (fp32), rows past M
])
def test_residual_prescaled_gemv_is_residual_gemv_and_the_weighted_sum(rows, n, k, block_n, block_k, split,
                                                                       rows_on_cores, swap_ab, silu_mul, unit_offset):
    """residual_prescaled_gemv: the sum and sums of squares residual_gemv stores, bit for bit, and beside them the
    sum times the next norm's weight (1 + g with the unit offset, g without) rounded once, as the reference rounds
    it (equal in fp32; a rounding apart in bf16, where the interpreter truncates)."""
    from headroom.kernels.gemv import (
        NextNorm,
        naive_residual_prescaled_gemv,
        residual_gemv,
        residual_prescaled_gemv,
    )

    x, w = _case(rows * 7 + n + split, rows, n, k)
    gen = torch.Generator().manual_seed(n + rows)
    residual = (torch.randn(rows, n, generator=gen) * 2).to(x.dtype)
    up = torch.randn(rows, k, generator=gen).to(x.dtype) if silu_mul else None
    norm = NextNorm((torch.randn(n, generator=gen) * 0.3).to(x.dtype), unit_offset)
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores,
                        swap_ab=swap_ab)
    summed, sumsq, scaled = residual_prescaled_gemv(x, w, residual, norm, config, up=up)
    plain_summed, plain_sumsq = residual_gemv(x, w, residual, config, up=up)
    assert torch.equal(summed, plain_summed) and torch.equal(sumsq, plain_sumsq)
    g = norm.weight.float() + 1.0 if unit_offset else norm.weight.float()
    _assert_rounding_apart(scaled, (summed.float() * g).to(x.dtype))
    ref_summed, _, ref_scaled = naive_residual_prescaled_gemv(x, w, residual, norm, up=up)
    torch.testing.assert_close(scaled.float(), ref_scaled.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize(("rows", "k", "block_n", "block_k", "split", "rows_on_cores", "swap_ab", "dtype"), [
    (1, 512, 16, 128, 1, False, False, torch.bfloat16),  # one row as pairs
    (1, 328, 16, 64, 2, False, False, torch.bfloat16),  # a ragged pair tail, split over K
    (1, 200, 16, 64, 2, False, False, torch.float32),  # one row in fp32
    (4, 512, 16, 128, 3, True, False, torch.bfloat16),  # rows on the CUDA cores as pairs
    (3, 200, 16, 64, 1, True, False, torch.float32),  # ... in fp32, rows past M repeat the last
    (8, 512, 64, 128, 2, True, False, torch.bfloat16),  # ... a tile too large to keep: summed every tile (ROW_SUM)
    (16, 328, 16, 64, 2, False, False, torch.float32),  # the tensor cores (fp32: the interpreter's bf16 dot is garbage)
    (16, 328, 16, 64, 2, False, True, torch.float32),  # ... swapped (the shipped several-row readers' tiles)
    (9, 256, 16, 64, 3, False, True, torch.float32),  # ... swapped, rows past M
])
def test_prescaled_normed_gemv_scales_each_output_row_by_its_rms(rows, k, block_n, block_k, split, rows_on_cores,
                                                                 swap_ab, dtype):
    """normed_gemv of prescaled rows (RowNorm.prescaled: the weight applied already) multiplies them as they are and
    scales each output row by 1 / rms of the given sums: through an identity weight the rows times their 1 / rms as
    rms_norm computes it from a sum (a rounding apart in bf16; equal in fp32, so a 1 / rms off by 1% fails), against
    a real weight the reference within the fp32 sums' order, and near the unfused norm then GEMV."""
    from headroom.kernels.gemv import RowNorm, naive_normed_gemv, normed_gemv

    x, weight = _norm_case(rows * 13 + k + split, rows, k, dtype)
    sumsq = x.float().pow(2).sum(-1, keepdim=True)
    scaled = (x.float() * (1.0 + weight.float())).to(dtype)
    norm = RowNorm(sumsq, weight, 1e-6, True, prescaled=True)
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores,
                        swap_ab=swap_ab)
    rstd = 1.0 / torch.sqrt((sumsq / k + 1e-6).double()).float()
    _assert_rounding_apart(normed_gemv(scaled, norm, torch.eye(k, dtype=dtype), config),
                           (scaled.float() * rstd).to(dtype))
    w = (torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 0.05).to(dtype)
    got = normed_gemv(scaled, norm, w, config)
    torch.testing.assert_close(got.float(), naive_normed_gemv(scaled, norm, w).float(), atol=1e-3, rtol=8e-3)
    unfused = gemv(_exact_norm(x, sumsq, weight, 1e-6, True), w, config)
    torch.testing.assert_close(got.float(), unfused.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize(("rows", "swap_ab"), [(1, False), (4, False), (16, False), (16, True)])
def test_every_epilogue_takes_the_row_scale(rows, swap_ab):
    """swiglu_gemv and conv_gemv given prescaled rows scale the products before their epilogues: SwiGLU's
    activation of normed_gemv's pairs (bit for bit), the conv step of its columns (the references')."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import (
        ConvStep,
        RowNorm,
        conv_gemv,
        naive_conv_gemv,
        normed_gemv,
        swiglu_gemv,
    )

    dtype = torch.bfloat16 if rows < 16 else torch.float32
    k = 256
    x, weight = _norm_case(rows + 40, rows, k, dtype)
    sumsq = x.float().pow(2).view(rows, 8, 32).sum(-1).contiguous()
    scaled = (x.float() * (1.0 + weight.float())).to(dtype)
    norm = RowNorm(sumsq, weight, 1e-6, True, prescaled=True)
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(48, k, generator=gen) * 0.05).to(dtype)
    config = GemvConfig(block_n=16, block_k=64, split=1, num_stages=2, rows_on_cores=rows == 4, swap_ab=swap_ab)
    pairs = normed_gemv(scaled, norm, w, config)
    assert torch.equal(swiglu_gemv(scaled, w, config, norm), silu_mul(pairs[:, 0::2], pairs[:, 1::2]))
    taps = (torch.randn(24, 4, generator=gen) * 0.5).to(dtype)
    states = torch.randn(max(6, rows), 24, 3, generator=gen).to(dtype)
    slots = torch.randperm(states.shape[0], generator=gen)[:rows].to(torch.int32)
    got_states, want_states = states.clone(), states.clone()
    got = conv_gemv(scaled, w, ConvStep(taps, got_states, slots), config, norm)
    want = naive_conv_gemv(scaled, w, ConvStep(taps, want_states, slots), norm)
    torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)
    torch.testing.assert_close(got_states.float(), want_states.float(), atol=0.02, rtol=0.02)


def test_prescale_and_row_scale_compile_for_sm90():
    """PRESCALE beside RESIDUAL and ROW_SCALE compile for sm_90 with PDL (16 rows on swapped tensor-core tiles with a
    split, 8 on the CUDA cores; ROW_SCALE with SwiGLU's epilogue at 16 too). PRESCALE adds stores to RESIDUAL's and no
    square root; a ROW_SCALE kernel takes its square root after the PDL wait, as NORM's, and runs the plain
    kernel's MMAs."""
    from tests.kernels.sm90 import compile_sm90

    shapes = ((16, False, 64, 256, True, False, True), (8, True, 8, 256, False, True, False))
    variants = []
    for flags in (("RESIDUAL", "PRESCALE"), ("RESIDUAL",), ("ROW_SCALE",), ()):
        for rows, pairs, block_n, block_k, swap, cores, split in shapes:
            x = "*i32" if pairs else "*bf16"
            pointers = {"x": x, "up": x, "w": x, "out": "*bf16", "ws": "*fp32", "counters": "*i32", "res": "*bf16",
                        "sumsq": "*fp32", "eps": "fp32", "scaled": "*bf16", "scale_w": "*bf16"}
            variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
                "BLOCK_M": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 3, "EVEN_K": True,
                "SPLIT": split, "PAIRS": pairs, "SILU_MUL": False, "PDL": True, "SWAP_AB": swap, "CORE_ROWS": cores,
                "ROW_SUM": False, "UNIT_OFFSET": True, **dict.fromkeys(flags, True)}))
    variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", variants[4][2],
                     {**variants[4][3], "SPLIT": False, "SWIGLU": True}))
    results = compile_sm90(variants)
    for (_, _, _, constants), result in zip(variants, results, strict=True):
        assert result["ok"], (constants, result.get("error"))
    ptx = [result["ptx"] for result in results]
    for i, shape in enumerate(shapes):
        prescaled, residual, row_scaled, plain = ptx[i], ptx[2 + i], ptx[4 + i], ptx[6 + i]
        assert "sqrt" not in prescaled and prescaled.count("st.global") > residual.count("st.global"), shape
        assert "sqrt" in row_scaled and row_scaled.index("griddepcontrol.wait") < row_scaled.index("sqrt"), shape
        assert row_scaled.count("wgmma.mma_async") == plain.count("wgmma.mma_async") > 0 or not shape[4], shape
        # the sums are the kernel before's: no load of them before the wait
        assert [p[: p.index("griddepcontrol.wait")].count("ld.global") for p in (row_scaled, plain)] \
            == [plain[: plain.index("griddepcontrol.wait")].count("ld.global")] * 2, shape
    assert ptx[8].index("griddepcontrol.wait") < ptx[8].index("sqrt")


def test_residual_prescaled_gemv_refuses_a_norm_weight_of_another_width():
    from headroom.kernels.gemv import NextNorm, residual_prescaled_gemv

    x, w = _case(3, 1, 40, 128)
    with pytest.raises(ValueError, match=r"next norm's weight \(39,\).*must be \[40\]"):
        residual_prescaled_gemv(x, w, torch.zeros(1, 40, dtype=x.dtype), NextNorm(torch.ones(39, dtype=x.dtype), True))


def test_residual_then_normed_gemv_is_the_decoders_add_norm_and_projection():
    """The decode chain the fusion replaces: a projection, the residual add with RMSNorm (add_rms_norm's
    reference), the next projection; through residual_gemv then normed_gemv with the first's parts."""
    from headroom.kernels.gemv import RowNorm, normed_gemv, residual_gemv
    from headroom.kernels.norm import naive_add_rms_norm

    gen = torch.Generator().manual_seed(5)
    a = torch.randn(1, 256, generator=gen).bfloat16()
    w_out = (torch.randn(96, 256, generator=gen) * 0.05).bfloat16()
    residual = (torch.randn(1, 96, generator=gen) * 4).bfloat16()
    norm_weight = (torch.randn(96, generator=gen) * 0.1).bfloat16()
    w_next = (torch.randn(50, 96, generator=gen) * 0.05).bfloat16()
    config = GemvConfig(block_n=8, block_k=64, split=2, num_stages=2)
    summed, sumsq = residual_gemv(a, w_out, residual, config)
    got = normed_gemv(summed, RowNorm(sumsq, norm_weight, 1e-6, True), w_next, config)
    # the same product (gemv's) into the reference add: the sums then differ by the add's rounding alone
    normed, ref_summed = naive_add_rms_norm(gemv(a, w_out, config), residual, norm_weight, 1e-6, True)
    _assert_rounding_apart(summed, ref_summed)
    torch.testing.assert_close(got.float(), F.linear(normed, w_next).float(), atol=0.03, rtol=0.02)


def test_the_one_row_sum_takes_parts_past_its_first_round():
    """One row's parts are summed 1,024 a round: a row whose whole sum sits in part 1,099 (zeros elsewhere, so any
    order of the sum is exact) norms exactly as one part holding it."""
    from headroom.kernels.gemv import RowNorm, normed_gemv

    x, weight = _norm_case(11, 1, 256, torch.float32)
    sumsq = x.pow(2).sum(-1, keepdim=True)
    late = torch.zeros(1, 1100)
    late[0, 1099] = sumsq[0, 0]
    config = GemvConfig(block_n=16, block_k=64, num_stages=2)
    eye = torch.eye(256)
    assert torch.equal(normed_gemv(x, RowNorm(late, weight, 1e-6, True), eye, config),
                       normed_gemv(x, RowNorm(sumsq, weight, 1e-6, True), eye, config))


@pytest.mark.parametrize(("rows", "num_parts", "rows_on_cores"), [(1, 1100, False), (4, 150, True), (16, 150, False)])
def test_row_scale_takes_parts_past_its_first_chunk(rows, num_parts, rows_on_cores):
    """ROW_SCALE loads the first chunk of the parts before its loop and adds the rest after it (1,024 a round at one
    row, 64 at several): rows whose sums sit in a middle and the last part (zeros elsewhere, so any order is exact)
    scale exactly as one part holding them, and a quarter of the sums doubles every output."""
    from headroom.kernels.gemv import RowNorm, normed_gemv

    x, weight = _norm_case(13 + rows, rows, 128, torch.float32)
    w = (torch.randn(24, 128, generator=torch.Generator().manual_seed(5)) * 0.05)
    sumsq = x.pow(2).sum(-1, keepdim=True)
    # half in a middle part (the second chunk at several rows), half in the last: a + b is exact in any order
    late = torch.zeros(rows, num_parts)
    late[:, num_parts // 2] = sumsq[:, 0] / 2
    late[:, -1] = sumsq[:, 0] / 2
    config = GemvConfig(block_n=8, block_k=64, num_stages=2, rows_on_cores=rows_on_cores)
    one = normed_gemv(x, RowNorm(sumsq, weight, 1e-6, True, prescaled=True), w, config)
    assert torch.equal(normed_gemv(x, RowNorm(late, weight, 1e-6, True, prescaled=True), w, config), one)
    quarter = normed_gemv(x, RowNorm(late / 4, weight, 1e-6, True, prescaled=True), w, config)
    torch.testing.assert_close(quarter, 2 * one, atol=1e-5, rtol=1e-5)


def test_l2_prefetch_changes_no_result_and_refuses_other_counts():
    """GemvConfig.l2_prefetch only asks L2 for lines (and only with PDL, never here): the same result; a count
    other than 0, 1, 2, 4 or 8 tiles is refused naming the field."""
    x, w = _case(4, 1, 40, 512)
    plain = GemvConfig(block_n=16, block_k=128, num_stages=2)
    assert torch.equal(gemv(x, w, GemvConfig(**{**vars(plain), "l2_prefetch": 2})), gemv(x, w, plain))
    with pytest.raises(ValueError, match="l2_prefetch=3 must be 0, 1, 2, 4 or 8"):
        gemv(x, w, GemvConfig(**{**vars(plain), "l2_prefetch": 3}))


def test_l2_prefetch_compiles_to_prefetches_before_the_pdl_wait():
    """sm_90 (the H200): L2_PREFETCH 2 at one row of 16 x 512 pairs asks L2 for the 2 tiles after the registers'
    one, a prefetch.global.L2 a 128-byte line (16 rows x 16 lines over 128 threads: 2 a thread), all of them before
    griddepcontrol.wait; L2_PREFETCH 0 asks for none."""
    from tests.kernels.sm90 import compile_sm90

    pointers = {"x": "*i32", "up": "*i32", "w": "*i32", "out": "*bf16", "ws": "*fp32", "counters": "*i32",
                "res": "*bf16", "sumsq": "*fp32", "eps": "fp32"}
    variants = [("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
        "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "NUM_STAGES": 1, "EVEN_K": True, "SPLIT": False, "PAIRS": True,
        "SILU_MUL": False, "PDL": True, "SWAP_AB": False, "CORE_ROWS": False, "ROW_SUM": False, "PREFETCH": 1,
        "NORM": True, "UNIT_OFFSET": True, "L2_PREFETCH": l2}) for l2 in (2, 0)]
    with_l2, without = compile_sm90(variants)
    assert with_l2["ok"] and without["ok"], (with_l2.get("error"), without.get("error"))
    ptx = with_l2["ptx"]
    assert ptx.count("prefetch.global.L2") == 2
    assert ptx.rindex("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
    assert "prefetch.global.L2" not in without["ptx"]


def test_normed_and_residual_gemv_refuse_mismatched_operands():
    from headroom.kernels.gemv import RowNorm, normed_gemv, residual_gemv

    x, w = _case(2, 1, 8, 64)
    good = torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"the norm's weight \(32,\) torch.bfloat16 must be \[64\]"):
        normed_gemv(x, RowNorm(good, torch.ones(32).bfloat16(), 1e-6, True), w)
    with pytest.raises(ValueError, match=r"sums of squares \(2, 4\) torch.float32 must be \[1, parts\]"):
        normed_gemv(x, RowNorm(torch.ones(2, 4), torch.ones(64).bfloat16(), 1e-6, True), w)
    with pytest.raises(ValueError, match=r"the residual \(1, 7\) torch.bfloat16 must be \[1, 8\]"):
        residual_gemv(x, w, torch.ones(1, 7).bfloat16())


def test_tuned_normed_and_residual_gemv_take_the_projections_own_entries(monkeypatch):
    """The fused variants run with the plain (or, for the down projection, the silu_mul) shape's shipped config (a
    down projection without its own entry: silu_mul, then the plain one), and not where the table has none (the
    caller then norms or adds apart)."""
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import RowNorm, residual_gemv, tuned_normed_gemv, tuned_residual_gemv

    x, w = _case(4, 1, 24, 128)
    config = GemvConfig(block_n=8, block_k=64, split=1, num_stages=2)
    monkeypatch.setattr(gemv_module, "_tuned", {(24, 128, 1, "x"): config, (128, 24, 1, "x"): config})
    residual = torch.randn(1, 24).bfloat16()
    out, sumsq = tuned_residual_gemv(x, w, residual)
    assert sumsq.shape == (1, 3)
    _assert_rounding_apart(out, residual + gemv(x, w, config))
    norm = RowNorm(sumsq, torch.ones(24).bfloat16(), 1e-6, True)
    assert tuned_normed_gemv(out, norm, w.T.contiguous()) is not None
    # no fused down-projection entry at this row count: silu_mul's kernel first, then the plain entry adds
    from headroom.kernels.gates_triton import silu_mul

    up = torch.randn(1, 128).bfloat16()
    out, _ = tuned_residual_gemv(x, w, residual, up=up)
    assert torch.equal(out, residual_gemv(silu_mul(x, up), w, residual, config)[0])
    assert tuned_residual_gemv(x.repeat(2, 1), w, residual.repeat(2, 1)) is None  # no 2-row entry at all
    assert tuned_normed_gemv(x, RowNorm(torch.ones(1, 1), torch.ones(128), 1e-6, True), w.T.contiguous()) is None
    assert tuned_normed_gemv(x.repeat(2, 1), RowNorm(torch.ones(2, 1), torch.ones(128).bfloat16(), 1e-6, True),
                             w.T.contiguous()) is None  # no 2-row entry


def test_normed_and_residual_variants_compile_for_the_h200():
    """NORM (one row as pairs with PDL and tiles before the wait, 8 rows on the CUDA cores, 16 swapped) and RESIDUAL
    (one row with a split, plain and with SiLU fused, 8 rows on the CUDA cores, 16 swapped with a split; each also
    with EARLY_RESIDUAL) compile for sm_90; a NORM kernel takes its square root after the PDL wait (the sums it
    reads are the kernel before's), and only NORM kernels take one; EARLY_RESIDUAL adds no load before the wait."""
    from tests.kernels.sm90 import compile_sm90

    variants = []
    for rows, block_n, block_k, pairs, swap, cores, split, norm, silu_mul, prefetch in (
            (1, 8, 512, True, False, False, False, True, False, 1), (1, 8, 512, True, False, False, False, True, False, 2),
            (8, 8, 512, True, False, True, False, True, False, 1), (16, 64, 128, False, True, False, False, True, False, 1),
            (1, 16, 512, True, False, False, True, False, False, 1), (1, 16, 512, True, False, False, True, False, True, 1),
            (8, 8, 256, True, False, True, True, False, True, 1), (16, 64, 256, False, True, False, True, False, False, 1)):
        x = "*i32" if pairs else "*bf16"
        pointers = {"x": x, "up": x, "w": x, "out": "*bf16", "ws": "*fp32", "counters": "*i32", "res": "*bf16",
                    "sumsq": "*fp32", "eps": "fp32"}
        for early in (False, True) if not norm else (False,):
            variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
                "BLOCK_M": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 3, "EVEN_K": True,
                "SPLIT": split, "PAIRS": pairs, "SILU_MUL": silu_mul, "PDL": True, "SWAP_AB": swap,
                "CORE_ROWS": cores, "ROW_SUM": False, "PREFETCH": prefetch, "NORM": norm, "UNIT_OFFSET": norm,
                "RESIDUAL": not norm, "EARLY_RESIDUAL": early}))
    results = compile_sm90(variants)
    for (_, _, _, constants), result in zip(variants, results, strict=True):
        assert result["ok"], (constants, result.get("error"))
        ptx = result["ptx"]
        assert ("sqrt" in ptx) == constants["NORM"], constants
        if constants["NORM"]:
            assert ptx.index("griddepcontrol.wait") < ptx.index("sqrt"), constants
        if constants["SWAP_AB"]:
            assert "wgmma.mma_async" in ptx, constants
    # EARLY_RESIDUAL loads the residual after the PDL wait (the kernels before wrote it): no load before the wait
    # that its late variant lacks
    late_ones = [i for i, (_, _, _, constants) in enumerate(variants)
                 if constants["RESIDUAL"] and not constants["EARLY_RESIDUAL"]]
    assert len(late_ones) == 4 and all(variants[i + 1][3]["EARLY_RESIDUAL"] for i in late_ones)
    for late, result_late, result_early in ((variants[i][3], results[i], results[i + 1]) for i in late_ones):
        before = [r["ptx"][: r["ptx"].index("griddepcontrol.wait")].count("ld.global")
                  for r in (result_late, result_early)]
        assert before[0] == before[1], (late, before)


@pytest.mark.parametrize(("rows", "k", "head", "block_k", "split", "rows_on_cores", "dtype"), [
    (1, 512, 32, 64, 1, False, torch.bfloat16),  # one row as pairs: two heads a tile
    (1, 512, 64, 256, 2, False, torch.bfloat16),  # four heads a tile, split over K (each split whole tiles)
    (1, 384, 32, 128, 1, False, torch.float32),  # one row in fp32 (exact), three tiles of four heads
    (1, 384, 64, 256, 1, False, torch.bfloat16),  # a last tile of two heads and two masked ones
    (4, 512, 32, 64, 2, True, torch.bfloat16),  # rows on the CUDA cores as pairs
    (3, 256, 16, 32, 1, True, torch.float32),  # ... in fp32, rows past M repeat the last
    (16, 512, 32, 128, 2, False, torch.float32),  # the tensor cores (fp32: the interpreter's bf16 dot is garbage)
])
def test_gated_gemv_is_the_gated_norm_then_gemv(rows, k, head, block_k, split, rows_on_cores, dtype):
    """gated_gemv norms each head of its tile and gates it by silu(z) as it loads it, as gated_rms_norm stores the
    rows: through an identity weight the normed rows themselves (three roundings apart at most in bf16, where the
    interpreter truncates; equal in fp32), against a real weight what gemv gives on the kernel-normed rows."""
    from headroom.kernels.gemv import GatedNorm, gated_gemv, naive_gated_gemv
    from headroom.kernels.norm_triton import gated_rms_norm

    gen = torch.Generator().manual_seed(rows * 17 + k + head)
    x = (torch.randn(rows, k, generator=gen) * 2).to(dtype)
    # the gate as a column view of a wider projection output (the in-projection's z)
    z = (torch.randn(rows, k + 64, generator=gen) * 2).to(dtype)[:, 32:32 + k]
    weight = (1 + 0.2 * torch.randn(head, generator=gen)).to(dtype)
    gated = GatedNorm(z, weight, 1e-6)
    config = GemvConfig(block_n=16, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores)
    normed = gated_rms_norm(x.view(rows, k // head, head), z.view(rows, k // head, head), weight, 1e-6)
    normed = normed.reshape(rows, k)
    _assert_rounding_apart(gated_gemv(x, gated, torch.eye(k, dtype=dtype), config), normed, 3)
    w = (torch.randn(40, k, generator=gen) * 0.05).to(dtype)
    got = gated_gemv(x, gated, w, config)
    if dtype == torch.float32:
        assert torch.equal(got, gemv(normed, w, config))
    torch.testing.assert_close(got.float(), naive_gated_gemv(x, gated, w).float(), atol=0.05, rtol=0.02)


def test_gated_gemv_with_the_residual_add_is_the_out_projection_step():
    """GATED and RESIDUAL in one launch (Gated DeltaNet's out-projection at decode): residual + gated_gemv, and the
    sum's sums of squares."""
    from headroom.kernels.gemv import GatedNorm, gated_gemv, naive_residual_gemv, residual_gemv

    gen = torch.Generator().manual_seed(11)
    x, z = torch.randn(1, 256, generator=gen).bfloat16(), torch.randn(1, 256, generator=gen).bfloat16()
    gated = GatedNorm(z, (1 + 0.2 * torch.randn(64, generator=gen)).bfloat16(), 1e-6)
    w = (torch.randn(48, 256, generator=gen) * 0.05).bfloat16()
    residual = torch.randn(1, 48, generator=gen).bfloat16()
    config = GemvConfig(block_n=16, block_k=128, split=2, num_stages=2)
    out, sumsq = residual_gemv(x, w, residual, config, gated=gated)
    _assert_rounding_apart(out, residual + gated_gemv(x, gated, w, config))
    want, want_sumsq = naive_residual_gemv(x, w, residual, gated=gated)
    torch.testing.assert_close(out.float(), want.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(sumsq.sum(-1, keepdim=True), want_sumsq, atol=0.5, rtol=1e-2)


def test_gated_gemv_refuses_tiles_that_split_heads():
    from headroom.kernels.gemv import GatedNorm, gated_gemv, gated_gemv_fits

    x = torch.randn(1, 256).bfloat16()
    gated = GatedNorm(torch.randn(1, 256).bfloat16(), torch.ones(128).bfloat16(), 1e-6)
    assert not gated_gemv_fits(256, 128, GemvConfig(block_k=64)) and not gated_gemv_fits(320, 128, GemvConfig())
    assert not gated_gemv_fits(384, 96, GemvConfig(block_k=384)) and gated_gemv_fits(512, 128, GemvConfig())
    assert gated_gemv_fits(384, 128, GemvConfig(block_k=256))  # a last tile of one head (the other masked: zeros)
    with pytest.raises(ValueError, match=r"heads of \(128,\) elements must be a power of 2 dividing K=256 and the "
                                         r"tile's block_k=64 a power of 2 of them"):
        gated_gemv(x, gated, torch.randn(8, 256).bfloat16(), GemvConfig(block_k=64))
    with pytest.raises(ValueError, match=r"the gate \(1, 128\) torch.bfloat16 must be x's \(1, 256\)"):
        gated_gemv(x, GatedNorm(torch.randn(1, 128).bfloat16(), torch.ones(128).bfloat16(), 1e-6),
                   torch.randn(8, 256).bfloat16(), GemvConfig())


def test_gated_variants_compile_for_the_h200():
    """GATED (Gated DeltaNet's out-projection: heads of 128) as the engine launches it at the shipped tiles: one row
    as pairs (1024-wide tiles, 8 warps) with and without RESIDUAL, 8 and 16 rows swapped (256-wide tiles) with
    RESIDUAL and a split, 8 rows on the CUDA cores; the gate's silu takes an exp."""
    from tests.kernels.sm90 import compile_sm90

    variants, warps = [], []
    for rows, block_n, block_k, pairs, swap, cores, split, residual, num_warps in (
            (1, 16, 1024, True, False, False, False, False, 8), (1, 16, 1024, True, False, False, False, True, 8),
            (8, 64, 256, False, True, False, True, True, 4), (16, 64, 256, False, True, False, True, True, 4),
            (8, 8, 256, True, False, True, False, True, 4)):
        x = "*i32" if pairs else "*bf16"
        pointers = {"x": x, "up": x, "w": x, "out": "*bf16", "ws": "*fp32", "counters": "*i32", "res": "*bf16",
                    "sumsq": "*fp32", "eps": "fp32", "norm_w": x}
        variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {
            "BLOCK_M": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 3, "EVEN_K": True,
            "SPLIT": split, "PAIRS": pairs, "SILU_MUL": False, "PDL": True, "SWAP_AB": swap, "CORE_ROWS": cores,
            "ROW_SUM": False, "RESIDUAL": residual, "GATED": True, "HEAD": 128}))
        warps.append(num_warps)
    for num_warps in sorted(set(warps)):
        chosen = [v for v, w in zip(variants, warps, strict=True) if w == num_warps]
        for (_, _, _, constants), result in zip(chosen, compile_sm90(chosen, num_warps=num_warps), strict=True):
            assert result["ok"], (constants, result.get("error"))
            assert "ex2" in result["ptx"] and "sqrt" in result["ptx"], constants
            if constants["SWAP_AB"]:
                assert "wgmma.mma_async" in result["ptx"], constants


def _conv_case(seed: int, rows: int, channels: int, dtype: torch.dtype, taps: int = 4):
    """A conv step's operands: taps [C, W] as a column view (the engine's conv1d.weight[:, 0, :]), the pool's
    states for six slots, and the rows' distinct slots."""
    from headroom.kernels.gemv import ConvStep

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(channels, 1, taps, generator=gen).to(dtype)[:, 0, :]
    states = torch.randn(max(6, rows + 2), channels, taps - 1, generator=gen).to(dtype)
    slots = torch.randperm(states.shape[0], generator=gen)[:rows].to(torch.int32)
    return ConvStep(weight, states, slots)


@pytest.mark.parametrize(("rows", "n", "channels", "k", "block_n", "block_k", "split", "rows_on_cores", "swap_ab",
                          "dtype", "taps"), [
    (1, 48, 20, 256, 16, 64, 1, False, False, torch.bfloat16, 4),  # one row as pairs, a block across the boundary
    (1, 48, 48, 328, 16, 64, 2, False, False, torch.bfloat16, 4),  # every column convolved, split over K
    (1, 40, 24, 200, 8, 64, 2, False, False, torch.float32, 3),  # fp32 (exact), three taps
    (3, 40, 17, 200, 8, 64, 1, True, False, torch.float32, 4),  # rows on the CUDA cores, rows past M repeat
    (4, 48, 32, 256, 16, 128, 3, True, False, torch.bfloat16, 2),  # ... as pairs with a split, two taps
    (16, 80, 40, 256, 32, 128, 2, False, True, torch.float32, 4),  # swapped tensor-core tile (fp32: see _case)
    (11, 80, 40, 256, 32, 128, 1, False, False, torch.float32, 4),  # tensor cores unswapped, 11 of 16 rows
])
@pytest.mark.parametrize("normed", [False, True])
def test_conv_gemv_is_gemv_then_the_conv_step(rows, n, channels, k, block_n, block_k, split, rows_on_cores, swap_ab,
                                              dtype, taps, normed):
    """conv_gemv's output and rolled states are, bit for bit, what the GEMV (normed_gemv with a norm) and then
    conv_update's kernel give on its stored output: the columns below C convolved, the rest as projected, the rows'
    slots rolled and every other slot untouched; and within rounding of the torch reference."""
    from dataclasses import replace

    from headroom.kernels.conv_update import causal_conv1d_update
    from headroom.kernels.gemv import RowNorm, conv_gemv, naive_conv_gemv, normed_gemv

    x, w = (t.to(dtype) for t in _case(rows * 7 + n + k, rows, n, k))
    conv = _conv_case(rows + channels + split, rows, channels, dtype, taps)
    norm = None
    if normed:
        x = x * 3
        norm = RowNorm(x.float().pow(2).sum(-1, keepdim=True), (torch.randn(k) * 0.1).to(dtype), 1e-6, True)
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores,
                        swap_ab=swap_ab)
    states_before = conv.states.clone()
    want = normed_gemv(x, norm, w, config) if normed else gemv(x, w, config)
    want_states = conv.states.clone()
    want[:, :channels] = causal_conv1d_update(want[:, :channels].contiguous(), conv.weight, want_states, conv.slots)
    got = conv_gemv(x, w, conv, config, norm)
    assert torch.equal(got, want)
    assert torch.equal(conv.states, want_states)
    untouched = [s for s in range(conv.states.shape[0]) if s not in conv.slots.tolist()]
    assert torch.equal(conv.states[untouched], states_before[untouched])
    ref_states = states_before.clone()
    ref = naive_conv_gemv(x, w, replace(conv, states=ref_states), norm)
    torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(conv.states.float(), ref_states.float(), atol=0.02, rtol=0.01)


def test_conv_gemv_refuses_mismatched_operands():
    from headroom.kernels.gemv import ConvStep, conv_gemv, tuned_conv_gemv

    x, w = _case(1, 1, 24, 64)
    taps, states, slots = torch.randn(16, 4).bfloat16(), torch.randn(3, 16, 3).bfloat16(), torch.tensor([1])
    with pytest.raises(ValueError, match=r"taps \(32, 4\) must be \[C, W\] with 1 <= C <= N=24"):
        conv_gemv(x, w, ConvStep(torch.randn(32, 4).bfloat16(), states, slots))
    with pytest.raises(ValueError, match=r"conv states \(3, 16, 4\) must be \[slots, 16, 3\]"):
        conv_gemv(x, w, ConvStep(taps, torch.randn(3, 16, 4).bfloat16(), slots))
    with pytest.raises(ValueError, match=r"slots \(2,\) torch.int64 must be int32 or int64 \[1\]"):
        conv_gemv(x, w, ConvStep(taps, states, torch.tensor([0, 1])))
    # the tuned variant falls back (None, nothing run) on the same problems
    assert tuned_conv_gemv(x, w, ConvStep(taps, states, torch.tensor([0, 1]))) is None


def test_tuned_conv_gemv_takes_the_plain_entry(monkeypatch):
    """conv_gemv runs with the in-projection's plain entry, and not where the table has none (the caller then
    projects and runs the conv kernel)."""
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import conv_gemv, tuned_conv_gemv

    x, w = _case(5, 1, 24, 128)
    config = GemvConfig(block_n=8, block_k=64, split=1, num_stages=2)
    monkeypatch.setattr(gemv_module, "_tuned", {(24, 128, 1, "x"): config})
    conv, again = _conv_case(3, 1, 16, torch.bfloat16), _conv_case(3, 1, 16, torch.bfloat16)
    assert torch.equal(tuned_conv_gemv(x, w, conv), conv_gemv(x, w, again, config))
    assert torch.equal(conv.states, again.states)
    assert tuned_conv_gemv(x.repeat(2, 1), w, _conv_case(3, 2, 16, torch.bfloat16)) is None  # no 2-row entry


def _epilogue_variants(cases: tuple, pointers: dict, **constants) -> list[tuple]:
    """compile_sm90's variants of gemv_fwd_kernel with an epilogue mode (constants) as the engine launches it: each
    case (rows, block_n, block_k, pairs, swap_ab, rows on cores, split, NORM in front), with PDL, 3 stages."""
    variants = []
    for rows, block_n, block_k, pairs, swap, cores, split, norm in cases:
        x = "*i32" if pairs else "*bf16"
        variants.append(("headroom.kernels.gemv", "gemv_fwd_kernel", {
            "x": x, "up": x, "w": x, "out": "*bf16", "ws": "*fp32", "counters": "*i32", "res": "*bf16",
            "sumsq": "*fp32", "eps": "fp32", **pointers}, {
            "BLOCK_M": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 3, "EVEN_K": True,
            "SPLIT": split, "PAIRS": pairs, "SILU_MUL": False, "PDL": True, "SWAP_AB": swap, "CORE_ROWS": cores,
            "ROW_SUM": False, "NORM": norm, "UNIT_OFFSET": norm, **constants}))
    return variants


def test_conv_variants_compile_for_the_h200():
    """CONV as the engine launches it: one row as pairs (with NORM and PDL, and with a split), 8 rows on the CUDA
    cores, 16 swapped with a split; its silu takes an exp and its loads come before the barrier that precedes its
    state stores."""
    from tests.kernels.sm90 import compile_sm90

    variants = _epilogue_variants(((1, 16, 256, True, False, False, False, True),
                                   (1, 16, 256, True, False, False, True, False),
                                   (8, 8, 512, True, False, True, False, False),
                                   (16, 64, 128, False, True, False, True, False)),
                                  {"conv_w": "*bf16", "conv_states": "*bf16", "conv_slots": "*i32"}, CONV=True)
    for (_, _, _, constants), result in zip(variants, compile_sm90(variants), strict=True):
        assert result["ok"], (constants, result.get("error"))
        ptx = result["ptx"]
        assert "ex2" in ptx and "bar.sync" in ptx, constants
        if constants["SWAP_AB"]:
            assert "wgmma.mma_async" in ptx, constants


@pytest.mark.parametrize(("rows", "n", "k", "block_n", "block_k", "stream", "swap_ab", "silu_mul"), [
    (16, 80, 256, 32, 64, 1, True, False),  # 3 blocks x 4 tiles over 4 programs: runs of 3 cross blocks
    (9, 72, 328, 16, 64, 2, False, False),  # ragged K (a masked last tile), a ragged last block, 8 programs
    (16, 40, 512, 32, 128, 3, True, True),  # the SwiGLU down projection; more programs than iterations
    (2, 130, 192, 64, 64, 1, True, False),  # 3 blocks x 3 tiles over 4 programs: runs of 3 each
])
def test_stream_k_gemv_is_the_same_product(rows, n, k, block_n, block_k, stream, swap_ab, silu_mul, monkeypatch):
    """stream-K (GemvConfig.stream): the (block, K tile) iterations shared out evenly, blocks finished by whichever
    program ends them; equal to torch's product in fp32 (the interpreter's bf16 dot is garbage) and to the grid
    kernel's up to the order of its fp32 sums, the arrival counters left at zero."""
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import naive_silu_mul_gemv, silu_mul_gemv
    from headroom.kernels.quant_matmul import _counters

    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, 2 * k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    launched = []
    kernel = gemv_module.gemv_stream_fwd_kernel

    class Recording:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gemv_module, "gemv_stream_fwd_kernel", Recording())
    config = GemvConfig(block_n=block_n, block_k=block_k, num_stages=2, swap_ab=swap_ab, stream=stream)
    grid = GemvConfig(block_n=block_n, block_k=block_k, num_stages=2, swap_ab=swap_ab, split=2)
    if silu_mul:
        gate, up = x[:, :k], x[:, k:]
        got, want = silu_mul_gemv(gate, up, w, config), naive_silu_mul_gemv(gate, up, w)
        other = silu_mul_gemv(gate, up, w, grid)
    else:
        got, want, other = gemv(x[:, :k], w, config), F.linear(x[:, :k], w), gemv(x[:, :k], w, grid)
    total = -(-n // block_n) * -(-k // block_k)
    per_program = -(-total // (stream * 4))
    assert launched == [(-(-total // per_program),)]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, other, atol=1e-5, rtol=1e-5)
    assert int(_counters(x.device).abs().sum()) == 0


def test_stream_k_leaves_one_row_and_the_fused_modes_to_the_grid():
    """One row, rows on the CUDA cores and the fused modes ignore stream (they run at one row, where the grid of
    thousands of small blocks balances): the same bits as without it."""
    from headroom.kernels.gemv import RowNorm, normed_gemv

    x, w = _case(3, 1, 40, 256)
    plain = GemvConfig(block_n=8, block_k=64, num_stages=2)
    streamed = GemvConfig(block_n=8, block_k=64, num_stages=2, stream=2)
    assert torch.equal(gemv(x, w, streamed), gemv(x, w, plain))
    norm = RowNorm(x.float().pow(2).sum(-1, keepdim=True), torch.ones(256).bfloat16(), 1e-6, True)
    assert torch.equal(normed_gemv(x, norm, w, streamed), normed_gemv(x, norm, w, plain))
    x4 = torch.randn(4, 256)
    cores, cores_streamed = (GemvConfig(block_n=8, block_k=64, num_stages=2, rows_on_cores=True, stream=s)
                             for s in (0, 2))
    assert torch.equal(gemv(x4, w.float(), cores_streamed), gemv(x4, w.float(), cores))


def test_stream_k_compiles_for_the_h200():
    """The stream-K kernel as the sweep launches it: 16 rows swapped (64- and 128-row weight tiles: wgmma), plain
    and with SiLU fused, a ragged K, and unswapped; the run loop around the pipelined K loop compiles for sm_90 and
    the kernel waits on its producer before touching anything (PDL)."""
    from tests.kernels.sm90 import compile_sm90

    variants = []
    for block_n, block_k, swap, silu_mul, even_k in ((64, 128, True, False, True), (128, 64, True, True, True),
                                                     (64, 128, True, False, False), (32, 128, False, False, True)):
        pointers = {"x": "*bf16", "up": "*bf16", "w": "*bf16", "out": "*bf16", "ws": "*fp32", "counters": "*i32"}
        variants.append(("headroom.kernels.gemv", "gemv_stream_fwd_kernel", pointers, {
            "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": 4, "EVEN_K": even_k,
            "SILU_MUL": silu_mul, "PDL": True, "SWAP_AB": swap}))
    for (_, _, _, constants), result in zip(variants, compile_sm90(variants), strict=True):
        assert result["ok"], (constants, result.get("error"))
        ptx = result["ptx"]
        assert "griddepcontrol.wait" in ptx and ("ex2" in ptx) == constants["SILU_MUL"], constants
        if constants["SWAP_AB"]:
            assert "wgmma.mma_async" in ptx, constants


def test_conv_gemv_refuses_a_norm_without_its_rows_sums():
    """With a norm in front, conv_gemv checks the rows' sums of squares as normed_gemv does."""
    from headroom.kernels.gemv import RowNorm, conv_gemv

    x, w = _case(1, 1, 24, 64)
    norm = RowNorm(torch.ones(2, 1), torch.ones(64).bfloat16(), 1e-6, True)
    with pytest.raises(ValueError, match=r"sums of squares \(2, 1\) torch.float32 must be \[1, parts\]"):
        conv_gemv(x, w, _conv_case(1, 1, 16, torch.bfloat16), GemvConfig(block_n=8, block_k=64), norm)


@pytest.mark.parametrize(("rows", "n", "k", "block_n", "block_k", "split", "rows_on_cores", "swap_ab", "dtype"), [
    (1, 40, 512, 16, 128, 1, False, False, torch.bfloat16),  # one row as pairs, the last block's pairs masked
    (1, 48, 328, 8, 64, 3, False, False, torch.bfloat16),  # ... split over K, a ragged pair tail
    (1, 40, 200, 16, 64, 2, False, False, torch.float32),  # one row in fp32 (exact)
    (3, 40, 512, 16, 128, 2, True, False, torch.bfloat16),  # rows on the CUDA cores as pairs, split
    (5, 24, 200, 4, 64, 1, True, False, torch.float32),  # ... in fp32, a 4-wide block (two pairs)
    (16, 40, 328, 16, 64, 2, False, False, torch.float32),  # the tensor cores, split
    (9, 72, 256, 32, 128, 1, False, True, torch.float32),  # ... swapped (the block transposed for the pairs)
])
@pytest.mark.parametrize("normed", [False, True])
def test_swiglu_gemv_is_silu_mul_of_the_gemvs_pairs(rows, n, k, block_n, block_k, split, rows_on_cores, swap_ab,
                                                    dtype, normed):
    """swiglu_gemv writes silu(gate) * up of each interleaved pair of the product (gate row i at 2i, up at 2i + 1)
    as silu_mul computes it from the plain GEMV's own output at the same tiles: the same bits, with or without the
    rows' norm in front (one part a row), in every layout the epilogue meets; the torch reference within rounding."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import RowNorm, naive_swiglu_gemv, normed_gemv, swiglu_gemv

    gen = torch.Generator().manual_seed(rows * 7 + n + k + split)
    x = (torch.randn(rows, k, generator=gen) * (3 if normed else 1)).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    config = GemvConfig(block_n=block_n, block_k=block_k, split=split, num_stages=2, rows_on_cores=rows_on_cores,
                        swap_ab=swap_ab)
    norm = RowNorm(x.float().pow(2).sum(-1, keepdim=True), (torch.randn(k, generator=gen) * 0.1).to(dtype), 1e-6,
                   True) if normed else None
    got = swiglu_gemv(x, w, config, norm)
    y = normed_gemv(x, norm, w, config) if normed else gemv(x, w, config)
    assert got.shape == (rows, n // 2) and got.dtype == dtype
    assert torch.equal(got, silu_mul(y[:, 0::2].contiguous(), y[:, 1::2].contiguous()))
    if not normed:
        torch.testing.assert_close(got.float(), naive_swiglu_gemv(x, w).float(), atol=0.02, rtol=0.02)


def test_swiglu_gemv_refuses_half_pairs_and_its_table_lookup_leaves_them_to_the_caller(monkeypatch):
    """An odd N or block_n would split a gate from its up: refused by name with the numbers; tuned_swiglu_gemv
    runs the plain shape's entry and gives None where that entry's tile is odd or no entry exists."""
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import PLAIN_INPUT, swiglu_gemv, tuned_swiglu_gemv

    x, w = torch.randn(2, 64), torch.randn(40, 64)
    with pytest.raises(ValueError, match=r"swiglu_gemv: w \(39, 64\) needs whole gate / up pairs"):
        swiglu_gemv(x, w[:39])
    with pytest.raises(ValueError, match=r"block_n \(config 5\)"):
        swiglu_gemv(x, w, GemvConfig(block_n=5, block_k=32))
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    monkeypatch.setattr(gemv_module, "_tuned", {(40, 64, 2, PLAIN_INPUT): GemvConfig(block_n=8, block_k=32)})
    assert torch.equal(tuned_swiglu_gemv(xb, wb), swiglu_gemv(xb, wb, GemvConfig(block_n=8, block_k=32)))
    monkeypatch.setattr(gemv_module, "_tuned", {(40, 64, 2, PLAIN_INPUT): GemvConfig(block_n=5, block_k=32)})
    assert tuned_swiglu_gemv(xb, wb) is None
    monkeypatch.setattr(gemv_module, "_tuned", {})
    assert tuned_swiglu_gemv(xb, wb) is None


def test_swiglu_variants_compile_for_the_h200():
    """SWIGLU's epilogue compiles for sm_90 in every layout it meets: one row as pairs (with NORM in front, and with
    a split), 8 rows on the CUDA cores, 16 on the tensor cores swapped (wgmma) with a split."""
    from tests.kernels.sm90 import compile_sm90

    variants = _epilogue_variants(((1, 8, 512, True, False, False, False, True),
                                   (1, 8, 512, True, False, False, True, False),
                                   (8, 8, 256, True, False, True, False, False),
                                   (16, 64, 128, False, True, False, True, False)), {}, SWIGLU=True)
    for (_, _, _, constants), result in zip(variants, compile_sm90(variants), strict=True):
        assert result["ok"], (constants, result.get("error"))
        # the activation's exponential, in the epilogue
        assert "ex2.approx" in result["ptx"], constants
        if constants["SWAP_AB"]:
            assert "wgmma.mma_async" in result["ptx"], constants
