"""Test helpers: a small paged KV pool of any kind, filled through the naive quantizers at shuffled pages; a kernel
launcher that records one keyword of each launch."""

from __future__ import annotations

import torch
from headroom.kernels.kv_quant import (
    naive_fp8_quantize,
    naive_kivi_quantize_keys,
    naive_kivi_quantize_values,
)
from headroom.kernels.paged_kv import PagedKV

PAGE = 32
VALUE_GROUP = 32


def make_pool(
    kind: str, bits: int, num_kv_heads: int, head_dim: int, seq_lens: list[int], dtype: torch.dtype, seed: int = 0
) -> tuple[PagedKV, torch.Tensor]:
    """Returns (kv, table [B, max_pages] int32) with random keys/values for each sequence, pages scattered."""
    gen = torch.Generator().manual_seed(seed)
    page = PAGE if kind == "kivi" else 1
    pages_per_seq = [-(-n // page) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.zeros((len(seq_lens), max(max(pages_per_seq), 1)), dtype=torch.int32)
    shape = (num_pages * page, num_kv_heads, head_dim)
    if kind == "kivi":
        packed = (num_pages, PAGE * bits // 8, num_kv_heads, head_dim)
        groups = -(-head_dim // VALUE_GROUP)
        store = {
            "k": torch.zeros(packed, dtype=torch.uint8), "v": torch.zeros(packed, dtype=torch.uint8),
            "k_scale": torch.zeros(num_pages, num_kv_heads, head_dim, dtype=torch.float16),
            "k_zero": torch.zeros(num_pages, num_kv_heads, head_dim, dtype=torch.float16),
            "v_scale": torch.zeros(num_pages * PAGE, num_kv_heads, groups, dtype=torch.float16),
            "v_zero": torch.zeros(num_pages * PAGE, num_kv_heads, groups, dtype=torch.float16),
        }
    elif kind == "fp8":
        store = {n: torch.zeros(shape, dtype=torch.float8_e4m3fn) for n in ("k", "v")}
        store |= {n: torch.zeros(shape[:2], dtype=torch.float32) for n in ("k_scale", "v_scale")}
    else:
        store = {n: torch.zeros(shape, dtype=dtype) for n in ("k", "v")}
    cursor = 0
    for b in range(len(seq_lens)):
        k = torch.randn(pages_per_seq[b] * page, num_kv_heads, head_dim, generator=gen) * 2
        v = torch.randn(pages_per_seq[b] * page, num_kv_heads, head_dim, generator=gen)
        for i in range(pages_per_seq[b]):
            p = order[cursor]
            cursor += 1
            table[b, i] = p
            rows = slice(i * page, (i + 1) * page)
            slots = slice(p * page, (p + 1) * page)
            if kind == "kivi":
                store["k"][p], store["k_scale"][p], store["k_zero"][p] = naive_kivi_quantize_keys(k[rows], bits)
                store["v"][p], store["v_scale"][slots], store["v_zero"][slots] = naive_kivi_quantize_values(
                    v[rows], bits, VALUE_GROUP
                )
            elif kind == "fp8":
                store["k"][slots], store["k_scale"][slots] = naive_fp8_quantize(k[rows])
                store["v"][slots], store["v_scale"][slots] = naive_fp8_quantize(v[rows])
            else:
                store["k"][slots], store["v"][slots] = k[rows].to(dtype), v[rows].to(dtype)
    kv_dtype = {"dense": "bf16" if dtype == torch.bfloat16 else "auto", "fp8": "fp8"}.get(kind, f"int{bits}")
    return PagedKV.from_store(store, kv_dtype, bits, page, VALUE_GROUP), table


class Recording:
    """A kernel's launcher that records one keyword of each launch (a tuple of keywords: their values) before
    running it."""

    def __init__(self, kernel, launched: list, key: str | tuple[str, ...]):
        self.kernel, self.launched, self.key = kernel, launched, key

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(tuple(kwargs[k] for k in self.key) if isinstance(self.key, tuple) else kwargs[self.key])
            return self.kernel[grid](*args, **kwargs)
        return launch
