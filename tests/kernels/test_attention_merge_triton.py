"""One-launch merges (interpreter on CPU): split-K partials against merge_attention_states, and a pair of key
ranges (a long prefill span's pieces) against merge_two."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels import attention_merge_triton as merge_module
from headroom.kernels.attention_merge import merge_attention_states, merge_two
from headroom.kernels.attention_merge_triton import (
    merge_pair_into,
    merge_splits_into,
)


# A row's channels go to programs of MERGE_CHANNELS (32): 40 and 72 channels end in a partial program, 256 is the 4B
# model's head in 8 (65 splits: an int2 pool's batch-1 step with its window; three chunks of 32, one of 128). 129 and
# 300 splits take several chunks at 32 or 128 (the sums rescaled when a later chunk holds a larger lse).
@pytest.mark.parametrize("splits,tokens,heads,dim", [(5, 3, 2, 24), (1, 2, 3, 8), (32, 1, 4, 40), (37, 2, 2, 16),
                                                     (3, 2, 2, 72), (65, 1, 16, 256), (129, 2, 2, 16),
                                                     (300, 1, 3, 40)])
# Rows of more than SPLIT_CHUNK splits read WIDE_SPLIT_CHUNK at a time: as shipped (128), and SPLIT_CHUNK's 32 (one
# chunk size for every row, the form before session 28).
@pytest.mark.parametrize("wide", [None, 32])
def test_merge_matches_reference(splits, tokens, heads, dim, wide, monkeypatch):
    if wide is not None:
        monkeypatch.setattr(merge_module, "WIDE_SPLIT_CHUNK", wide)
    gen = torch.Generator().manual_seed(splits * 7 + dim)
    parts = torch.randn(splits, tokens, heads, dim, generator=gen)
    lses = torch.randn(splits, tokens, heads, generator=gen) * 3
    # Splits that saw no key (-inf), and one row that saw none in any split.
    lses[0, 0, 0] = float("-inf")
    lses[:, -1, -1] = float("-inf")
    out = torch.full((tokens, heads, dim), float("nan"))
    out_lse = torch.full((tokens, heads), float("nan"))
    merge_splits_into(parts, lses, out, out_lse)
    want, want_lse = merge_attention_states(parts, lses, torch.float32)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert out[-1, -1].abs().max() == 0 and out_lse[-1, -1] == float("-inf")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gated_merge_is_sigmoid_mul_of_the_merged_rows(dtype):
    """gate: the merged rows times sigmoid of a strided gate ([N, H, 2D]'s second half, as Qwen3.5's q|gate rows),
    bit for bit what sigmoid_mul makes of the ungated merge's output, over 72 channels (three programs a row, the
    last partial); the lse is not gated."""
    from headroom.kernels.gates_triton import sigmoid_mul

    gen = torch.Generator().manual_seed(4)
    parts = torch.randn(6, 3, 4, 72, generator=gen)
    lses = torch.randn(6, 3, 4, generator=gen) * 3
    lses[:, -1, -1] = float("-inf")
    gate = (torch.randn(3, 4, 144, generator=gen) * 2).to(dtype)[..., 72:]
    plain, plain_lse = torch.empty(3, 4, 72, dtype=dtype), torch.empty(3, 4)
    merge_splits_into(parts, lses, plain, plain_lse)
    gated, gated_lse = torch.empty(3, 4, 72, dtype=dtype), torch.empty(3, 4)
    merge_splits_into(parts, lses, gated, gated_lse, gate)
    assert torch.equal(gated.view(3, -1), sigmoid_mul(plain.view(3, -1), gate))
    assert torch.equal(gated_lse, plain_lse)
    with pytest.raises(ValueError, match=r"gate \(3, 4, 8\)"):
        merge_splits_into(parts, lses, gated, gated_lse, gate[..., :8])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="lses"):
        merge_splits_into(torch.zeros(2, 1, 1, 8), torch.zeros(3, 1, 1), torch.zeros(1, 1, 8), torch.zeros(1, 1))


def _pair(tokens: int, heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # a as a [H, N, D] tensor's transposed view (cuDNN's output), b row-major, both bf16.
    a = torch.randn(heads, tokens, dim, generator=gen).to(torch.bfloat16).transpose(0, 1)
    b = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16)
    a_lse, b_lse = torch.randn(tokens, heads, generator=gen) * 3, torch.randn(tokens, heads, generator=gen) * 3
    return a, a_lse, b, b_lse


@pytest.mark.parametrize("tokens,heads,dim", [(37, 3, 16), (16, 2, 32), (1, 1, 8)])
def test_pair_merge_matches_merge_two_from_strided_bf16_pieces(tokens, heads, dim):
    a, a_lse, b, b_lse = _pair(tokens, heads, dim, tokens + dim)
    # A row that saw no key on one side, and one that saw none on either.
    a_lse[0, 0] = float("-inf")
    a_lse[-1, -1] = b_lse[-1, -1] = float("-inf")
    out, out_lse = torch.full((tokens, heads, dim), float("nan")), torch.full((tokens, heads), float("nan"))
    merge_pair_into(a, a_lse, b, b_lse, out, out_lse)
    want, want_lse = merge_two(a.float(), a_lse, b.float(), b_lse)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert out[-1, -1].abs().max() == 0 and out_lse[-1, -1] == float("-inf")


def test_pair_merge_in_place_and_into_bf16():
    a, a_lse, b, b_lse = _pair(20, 2, 16, 3)
    want, want_lse = merge_two(a.float(), a_lse, b.float(), b_lse)
    acc, lse = a.float().contiguous(), a_lse.clone()
    merge_pair_into(acc, lse, b, b_lse, acc, lse)
    torch.testing.assert_close(acc, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    out = torch.empty(20, 2, 16, dtype=torch.bfloat16)
    merge_pair_into(a, a_lse.clone(), b, b_lse, out, torch.empty(20, 2))
    assert out.dtype == torch.bfloat16
    # Within one bf16 rounding of the fp32 merge (the interpreter's cast need not round to nearest as sm_90's does).
    torch.testing.assert_close(out.float(), want, atol=1e-6, rtol=2**-7)


def test_pair_merge_refuses_what_it_cannot_read():
    a, a_lse, b, b_lse = _pair(4, 2, 16, 5)
    with pytest.raises(ValueError, match="lses"):
        merge_pair_into(a, a_lse[:3], b, b_lse, torch.empty(4, 2, 16), torch.empty(4, 2))
    with pytest.raises(ValueError, match="power-of-two"):
        merge_pair_into(a[..., :12], a_lse, b[..., :12], b_lse, torch.empty(4, 2, 12), torch.empty(4, 2))


def test_in_place_pair_merge_loads_everything_before_any_store_on_sm90():
    """An in-place merge (out, out_lse = a, a_lse) is only safe if no warp stores before every warp of the program has
    loaded: the warps hold copies of the same lse rows. In the kernel compiled for the H200 (PTX, no GPU needed) every
    global load comes before the barrier and every global store after it. The interpreter runs a program as one
    thread of whole tensors and can never show this race; on the H200 it made merged spans differ run to run."""
    from tests.kernels.sm90 import compile_sm90

    pointers = {"a": "*fp32", "a_lse": "*fp32", "b": "*bf16", "b_lse": "*fp32", "out": "*fp32", "out_lse": "*fp32"}
    [result] = compile_sm90([("headroom.kernels.attention_merge_triton", "merge_pair_fwd_kernel", pointers,
                              {"BLOCK_T": 16, "BLOCK_D": 256})])
    assert result["ok"], result.get("error")
    lines = [line.strip() for line in result["ptx"].splitlines()]
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    stores = [i for i, line in enumerate(lines) if "st.global" in line]
    barriers = [i for i, line in enumerate(lines) if line.startswith(("bar.sync", "barrier.sync"))]
    assert loads and stores and barriers
    assert any(max(loads) < b < min(stores) for b in barriers)


def test_the_split_merge_compiles_for_sm90_gated_or_not():
    """sm_90 (the H200): the one-pass merge at each chunk a launch may take (SPLIT_CHUNK, WIDE_SPLIT_CHUNK) x 32
    channels at 4 warps, with and without the output gate (the interpreter does not hold it to the GPU compiler's
    typing of the loop's running maximum)."""
    from headroom.kernels.attention_merge_triton import SPLIT_CHUNK, WIDE_SPLIT_CHUNK

    from tests.kernels.sm90 import compile_sm90

    pointers = {"parts": "*fp32", "lses": "*fp32", "out_lse": "*fp32", "out": "*bf16", "gate": "*bf16"}
    variants = [("headroom.kernels.attention_merge_triton", "merge_splits_fwd_kernel", pointers,
                 {"BLOCK_S": chunk, "BLOCK_D": 32, "PDL": True, "GATE": gate})
                for chunk in sorted({SPLIT_CHUNK, WIDE_SPLIT_CHUNK}) for gate in (False, True)]
    for result in compile_sm90(variants, num_warps=4):
        assert result["ok"], result.get("error")
