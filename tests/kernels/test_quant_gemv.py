"""The stream kernel for decode rows (Triton, in the interpreter on CPU) against naive_quant_linear: every
nibble position and code value decoded exactly, zero points, tile and split shapes, and its row limit."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.quant_gemv import (
    STREAM_MAX_ROWS,
    StreamConfig,
    default_config,
    quant_stream_fwd,
    stream_config,
)
from headroom.kernels.quant_matmul import _COUNTERS
from headroom.kernels.quant_pack import quantize_fp8_block, quantize_int4_group
from headroom.kernels.quant_weight import QuantizedWeight, naive_quant_linear


def int4_weight(n: int, k: int, group: int, symmetric: bool, seed: int) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, scale, zero = quantize_int4_group(w, group, symmetric)
    return QuantizedWeight("int4_group", packed, scale, zero, n, k, (1, group))


def test_every_code_at_every_nibble_decodes_exactly():
    """Row r holds code (r + j) mod 16 at nibble j of every word, unit scales: with x one-hot at column c the
    product is code - 8 exactly, so each of the 16 codes is read at each of the 8 positions (the low five in
    place, the top three from the shifted word; the sign bit of the word set in half the rows)."""
    n, k = 16, 64
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (codes.view(n, k // 8, 8).to(torch.int64) << shifts).sum(-1)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    weight = QuantizedWeight("int4_group", packed, torch.ones(n, 1), None, n, k, (1, k))
    for start in range(0, k, 4):
        out = quant_stream_fwd(torch.eye(k)[start:start + 4], weight, StreamConfig(block_n=16, block_k=64))
        assert torch.equal(out, (codes[:, start:start + 4].T - 8).float())
    assert packed.min() < 0


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("group,symmetric", [(32, True), (16, False), (128, False), (128, True)])
def test_int4_matches_naive(rows, group, symmetric):
    # K = 200: not a multiple of 8 (the last word half empty) nor of the group; N = 37: a partial row block.
    weight = int4_weight(37, 200, group, symmetric, seed=rows + group)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
    out = quant_stream_fwd(x, weight, StreamConfig(block_n=16, block_k=64))
    torch.testing.assert_close(out, naive_quant_linear(x, weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", [StreamConfig(block_n=16, block_k=32, programs_per_sm=64),
                                    StreamConfig(block_n=32, block_k=128, programs_per_sm=1)], ids=str)
def test_split_k_and_tiles(config):
    """Many splits over few row blocks (each split summed once, counters left at zero), and one split."""
    weight = int4_weight(24, 1024, 128, False, seed=3)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(4))
    out = quant_stream_fwd(x, weight, config)
    torch.testing.assert_close(out, naive_quant_linear(x, weight), atol=1e-4, rtol=1e-4)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_tiles_spanning_several_groups_take_a_scale_per_word_lane():
    """BLOCK_K a multiple of the group: each word lane reads its own group's scale and zero point."""
    weight = int4_weight(37, 200, 16, False, seed=12)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(13))
    out = quant_stream_fwd(x, weight, StreamConfig(block_n=16, block_k=64))
    torch.testing.assert_close(out, naive_quant_linear(x, weight), atol=1e-4, rtol=1e-4)


def test_default_configs_by_rows():
    weight = int4_weight(40, 256, 128, True, seed=14)
    for rows in range(1, STREAM_MAX_ROWS + 1):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(quant_stream_fwd(x, weight), naive_quant_linear(x, weight), atol=1e-4, rtol=1e-4)
    cpu = torch.device("cpu")
    assert stream_config(40, 256, 1, cpu) == default_config(2) != default_config(3) == stream_config(40, 256, 4, cpu)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("group,symmetric", [(32, False), (128, True)])
def test_even_k_tiles_match_naive(rows, group, symmetric):
    """K a multiple of the tile: the loop without masks along K, over one split and over many (two tiles each)."""
    weight = int4_weight(37, 512, group, symmetric, seed=15 + rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(16))
    for config in (StreamConfig(block_n=16, block_k=64, programs_per_sm=1), StreamConfig(block_n=32, block_k=32,
                                                                                           programs_per_sm=64)):
        out = quant_stream_fwd(x, weight, config)
        torch.testing.assert_close(out, naive_quant_linear(x, weight), atol=1e-4, rtol=1e-4)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_the_shipped_table_holds_for_its_gpu_and_triton_version(tmp_path, monkeypatch):
    import json

    import triton
    from headroom.kernels import gdn_fla, quant_gemv

    table = tmp_path / "table.json"
    entry = {"n": 8, "k": 64, "m": 4, "block_n": 16, "block_k": 512, "num_warps": 8, "num_stages": 2,
             "programs_per_sm": 1}
    table.write_text(json.dumps({"NVIDIA_H200": {"triton": triton.__version__, "configs": [entry]}}))
    monkeypatch.setattr(quant_gemv, "TUNED_CONFIGS", table)
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "NVIDIA_H200")
    cuda = torch.device("cuda")
    for rows, expected in ((3, StreamConfig(16, 512, 8, 2, 1)), (1, default_config(1))):
        monkeypatch.setattr(quant_gemv, "_tuned", None)
        assert stream_config(8, 64, rows, cuda) == expected
    table.write_text(json.dumps({"NVIDIA_H200": {"triton": "0.0.1", "configs": [entry]}}))
    monkeypatch.setattr(quant_gemv, "_tuned", None)
    assert stream_config(8, 64, 4, cuda) == default_config(4)  # another Triton version's timings


def test_fp8_is_refused_with_the_kernel_that_takes_it():
    w = torch.randn(40, 352, generator=torch.Generator().manual_seed(7))
    data, scale = quantize_fp8_block(w, (128, 128))
    weight = QuantizedWeight("fp8_block", data, scale, None, 40, 352, (128, 128))
    with pytest.raises(ValueError, match="reads int4 groups, not fp8_block"):
        quant_stream_fwd(torch.zeros(1, 352), weight)


@pytest.mark.parametrize("rows,k", [(1, 128), (3, 200), (2, 512)])
def test_bf16_rows_read_as_pairs_keep_their_dtype(rows, k):
    """bf16 rows go in as int32 pairs: a tile inside K, K not a multiple of the tile (the last pairs masked), and
    a strided view of wider rows. The product is the fp32 one on the same bf16 values, rounded to bf16."""
    weight = int4_weight(32, k, 64, False, seed=9)
    wide = torch.randn(rows, k + 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    x = wide[:, :k]
    out = quant_stream_fwd(x, weight, StreamConfig(block_n=16, block_k=64))
    assert out.dtype == torch.bfloat16
    expected = naive_quant_linear(x.float(), weight)
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.01)
    assert (out.float() - expected).abs().max() <= expected.abs().max() * 2**-7


def test_too_many_rows_is_refused():
    weight = int4_weight(8, 64, 32, True, seed=0)
    with pytest.raises(ValueError, match=f"at most {STREAM_MAX_ROWS} contiguous rows of 64 features, got x \\(5, 64\\)"):
        quant_stream_fwd(torch.zeros(STREAM_MAX_ROWS + 1, 64), weight)
