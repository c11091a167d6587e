"""Quantize-on-write kernels (interpreter on CPU) write the same codes and scales as the naive quantizers."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.kv_quant_triton import fp8_quantize_into, kivi_quantize_pages
from headroom.kernels.paged_kv import PagedKV, naive_fp8_quantize_into, naive_kivi_quantize_pages

from tests.kernels.paged_pool import make_pool


@pytest.mark.parametrize("num_heads,head_dim", [(1, 64), (3, 128), (2, 70), (5, 256)])
def test_fp8_write_is_bit_exact(num_heads, head_dim):
    gen = torch.Generator().manual_seed(num_heads)
    # Magnitudes over many binades hit subnormal codes, ties and the 448 clamp.
    x = (torch.randn(7, num_heads, head_dim, generator=gen) * torch.logspace(-6, 3, head_dim)).to(torch.bfloat16)
    x[0, 0, :3] = torch.tensor([0.0, -0.0, -1e-9])
    slots = torch.tensor([9, 0, 4, 11, 2, 7, 5], dtype=torch.int32)
    codes = torch.full((12, num_heads, head_dim), float("nan")).to(torch.float8_e4m3fn)
    scales = torch.full((12, num_heads), float("nan"))
    ref_codes, ref_scales = codes.clone(), scales.clone()
    fp8_quantize_into(x, slots, codes, scales)
    naive_fp8_quantize_into(x, slots, ref_codes, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales[slots.long()], ref_scales[slots.long()])


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("num_heads,head_dim", [(1, 64), (3, 70), (2, 256)])
def test_kivi_write_matches_naive(bits, num_heads, head_dim):
    kv, _ = make_pool("kivi", bits, num_heads, head_dim, [96], torch.bfloat16)
    ref, _ = make_pool("kivi", bits, num_heads, head_dim, [96], torch.bfloat16)
    for t in (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, ref.k_scale, ref.k_zero, ref.v_scale, ref.v_zero):
        t.fill_(float("nan"))
    gen = torch.Generator().manual_seed(bits)
    k = (torch.randn(64, num_heads, head_dim, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(64, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    pages = torch.tensor([3, 1], dtype=torch.int32)
    _assert_writes_match_naive(k, v, pages, kv, ref)


def _assert_writes_match_naive(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, kv: PagedKV, ref: PagedKV) -> None:
    """kivi_quantize_pages into kv and the naive quantizers into ref: the written pages' codes, the keys' scales and
    zeros of those pages and the values' of their tokens, bit for bit."""
    kivi_quantize_pages(k, v, pages, kv)
    naive_kivi_quantize_pages(k, v, pages, ref)
    index, page = pages.long(), kv.page_tokens
    slots = torch.cat([torch.arange(p * page, p * page + page) for p in pages.tolist()])
    assert torch.equal(kv.k[index], ref.k[index]) and torch.equal(kv.v[index], ref.v[index])
    for name in ("k_scale", "k_zero"):
        assert torch.equal(getattr(kv, name)[index], getattr(ref, name)[index]), name
    for name in ("v_scale", "v_zero"):
        assert torch.equal(getattr(kv, name)[slots], getattr(ref, name)[slots]), name


def _kivi_pool(bits: int, page: int, group: int, pages: int, heads: int, dim: int) -> PagedKV:
    half = {"dtype": torch.float16}
    packed = (pages, page * bits // 8, heads, dim)
    groups = -(-dim // group)
    return PagedKV("kivi", torch.zeros(packed, dtype=torch.uint8), torch.zeros(packed, dtype=torch.uint8),
                   torch.full((pages, heads, dim), float("nan"), **half), torch.full((pages, heads, dim), float("nan"), **half),
                   torch.full((pages * page, heads, groups), float("nan"), **half),
                   torch.full((pages * page, heads, groups), float("nan"), **half),
                   bits=bits, page_tokens=page, value_group=group)


@pytest.mark.parametrize("bits,page,group", [(2, 8, 16), (2, 4, 8), (4, 4, 16), (8, 16, 32), (4, 64, 32)], ids=str)
def test_kivi_write_of_pages_with_fewer_bytes_than_bands(bits, page, group):
    """The quantizer walks a page as up to 4 bands of whole packed bytes: pages of 1 or 2 bytes a channel (int2 in 4
    or 8 tokens, int4 in 4) are that many bands, long ones several bytes a band; every layout writes the naive codes
    and scales bit for bit (a head of 48 channels: a ragged last value group at 32)."""
    heads, dim, pages = 2, 48, 3
    kv, ref = (_kivi_pool(bits, page, group, pages + 2, heads, dim) for _ in range(2))
    gen = torch.Generator().manual_seed(bits * page)
    k = (torch.randn(pages * page, heads, dim, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(pages * page, heads, dim, generator=gen).to(torch.bfloat16)
    _assert_writes_match_naive(k, v, torch.tensor([4, 0, 2], dtype=torch.int32), kv, ref)


def test_kivi_write_refuses_partial_pages():
    kv, _ = make_pool("kivi", 4, 1, 64, [32], torch.bfloat16)
    x = torch.zeros(20, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="20 tokens are not 1 whole pages of 32"):
        kivi_quantize_pages(x, x, torch.zeros(1, dtype=torch.int32), kv)


def test_the_page_quantizer_compiles_for_sm90():
    """Keys and values in one launch (a runtime branch on the grid's third axis), compiled for the H200 at the 4B
    model's int2 pool as a prefill writes its whole pages."""
    from tests.kernels.sm90 import compile_sm90

    pointers = {"k": "*bf16", "v": "*bf16", "pages": "*i32", "k_packed": "*u8", "v_packed": "*u8",
                "k_scale": "*fp16", "k_zero": "*fp16", "v_scale": "*fp16", "v_zero": "*fp16", "inv_levels": "fp32"}
    constants = {"HEAD_DIM": 256, "BITS": 2, "PAGE": 32, "GROUP_D": 32, "BLOCK_G": 8, "BLOCK_C": 32, "RECIPROCAL": True}
    [result] = compile_sm90([("headroom.kernels.kv_quant_triton", "kivi_quantize_fwd_kernel", pointers, constants)])
    assert result["ok"], result.get("error")
