"""PagedKV: one layer's KV pool storage as the paged kernels read it; its naive gather, attention and
quantize-on-write references (no Triton here: the CPU path imports this module).

Kinds (engine/runtime/kv_pool.py allocates them; engine/plan/kv_format.py is the byte layout):
- dense: k, v [slots, H, D] in bf16/fp16/fp32.
- fp8:   k, v [slots, H, D] float8_e4m3fn; k_scale, v_scale [slots, H] fp32.
- kivi:  k, v [pages, page_tokens * bits / 8, H, D] uint8 (codes packed along the token axis);
         k_scale, k_zero [pages, H, D] fp16 (per channel over the page);
         v_scale, v_zero [slots, H, G] fp16 (per token, per group of value_group channels).
A sequence's key j lives in page table[j // page_tokens], row j % page_tokens (slot = page * page_tokens + row);
for dense and fp8 page_tokens is 1 and the table holds token slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from headroom.kernels.attention_merge import naive_attention_with_lse
from headroom.kernels.host_copy import upload
from headroom.kernels.kv_quant import (
    FP8_MAX,
    naive_fp8_dequantize,
    naive_fp8_quantize,
    naive_kivi_dequantize_keys,
    naive_kivi_dequantize_values,
    naive_kivi_quantize_keys,
    naive_kivi_quantize_values,
)

KV_KINDS = ("dense", "fp8", "kivi")
# A sequence's quantized prefix is dequantized once per block of keys into a dense workspace (then read by the
# dense kernel by every query tile) when its chunk has at least this many (token, head) query rows: the fused
# dequantizing loads repeat the dequantization in each of the chunk's query tiles (128 rows a tile), the block
# pass once. Below it (decode, short chunks) the fused loads are cheaper than a workspace round trip.
BLOCKWISE_MIN_ROWS = 512
# Dense tokens of the workspace (K and V, one layer at a time), shared by the sequences that take the block path:
# 16,384 tokens of a 4-KV-head, 256-dim model are 64 MiB (the planner's dequant_transient line).
BLOCKWISE_WORKSPACE_TOKENS = 16384


@dataclass(frozen=True)
class PagedKV:
    kind: str
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    bits: int = 16
    page_tokens: int = 1
    value_group: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"PagedKV.kind must be one of {KV_KINDS}, got {self.kind!r}")
        if self.k.shape != self.v.shape:
            raise ValueError(f"PagedKV: k {tuple(self.k.shape)} and v {tuple(self.v.shape)} differ")
        if self.kind == "fp8" and (self.k_scale is None or self.v_scale is None):
            raise ValueError("PagedKV(kind='fp8') needs k_scale and v_scale [slots, H]")
        if self.kind == "kivi":
            if None in (self.k_scale, self.k_zero, self.v_scale, self.v_zero):
                raise ValueError("PagedKV(kind='kivi') needs k_scale, k_zero, v_scale and v_zero")
            if self.bits not in (2, 4, 8) or self.value_group < 1:
                raise ValueError(f"PagedKV(kind='kivi'): bits={self.bits} (2, 4, 8), value_group={self.value_group} (>= 1)")
            if self.k.shape[1] * 8 != self.page_tokens * self.bits:
                raise ValueError(
                    f"PagedKV: packed rows {self.k.shape[1]} != page_tokens {self.page_tokens} * bits {self.bits} / 8"
                )
        elif self.page_tokens != 1:
            raise ValueError(f"PagedKV(kind={self.kind!r}) is token-granular: page_tokens must be 1, got {self.page_tokens}")

    @classmethod
    def from_store(
        cls, store: dict[str, torch.Tensor], kv_dtype: str, bits: int = 16, page_tokens: int = 1, value_group: int = 0
    ) -> PagedKV:
        """Wrap one layer of KVPool.layers (kv_dtype as KVPool.kv_dtype: auto/bf16/fp8/int8/int4/int2)."""
        if kv_dtype in ("auto", "bf16"):
            return cls("dense", store["k"], store["v"])
        if kv_dtype == "fp8":
            return cls("fp8", store["k"], store["v"], k_scale=store["k_scale"], v_scale=store["v_scale"])
        return cls(
            "kivi", store["k"], store["v"], store["k_scale"], store["k_zero"], store["v_scale"], store["v_zero"],
            bits=bits, page_tokens=page_tokens, value_group=value_group,
        )

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]


@dataclass(frozen=True)
class KeyWindow:
    """Keys of each decode row outside the paged pool: a KIVI pool's residual windows (the open pages, full
    precision). kv: a dense PagedKV over the window slots [slots, H, D]; table [N, W] int32: row t's keys
    j = 0..lens[t]-1 sit in slot table[t, j] at absolute positions start[t] + j (start, lens [N] int32; lens at most
    W, which check() cannot see without reading the device: the engine's windows are a page wide)."""

    kv: PagedKV
    table: torch.Tensor
    start: torch.Tensor
    lens: torch.Tensor

    def check(self, q: torch.Tensor, num_kv_heads: int) -> None:
        n = q.shape[0]
        k = self.kv.k
        if self.kv.kind != "dense" or k.dim() != 3 or k.shape[1] != num_kv_heads or k.shape[2] != q.shape[-1]:
            raise ValueError(f"key window: dense [slots, {num_kv_heads}, {q.shape[-1]}] keys, got {self.kv.kind} "
                             f"{tuple(k.shape)}")
        if self.table.dim() != 2 or self.table.shape[0] != n or self.start.shape != (n,) or self.lens.shape != (n,):
            raise ValueError(f"key window for {n} rows: table [{n}, W], start and lens [{n}]; got "
                             f"{tuple(self.table.shape)}, {tuple(self.start.shape)}, {tuple(self.lens.shape)}")
        if any(t.dtype != torch.int32 for t in (self.table, self.start, self.lens)) or self.table.stride(-1) != 1:
            raise ValueError("key window: table, start and lens must be int32, the table's last dimension contiguous")

    @staticmethod
    def require_decode(rows: int, seqs: int, max_q_len: int, continues: bool) -> None:
        """A window joins decode launches only: one query row a sequence (row t's window is sequence t's), no
        earlier range to continue."""
        if continues or max_q_len != 1 or rows != seqs:
            raise ValueError(f"a key window joins decode launches only (one row a sequence, no prev): {rows} rows of "
                             f"{seqs} sequences, max_q_len={max_q_len}, prev {continues}")


@dataclass(frozen=True)
class PageClose:
    """A graphed KIVI decode step's page close: token t's window row rows[t] (page_tokens rows of the flat window
    its K/V were just stored into) quantized into pool page pages[t] where that is >= 0, the step having filled it
    (-1: nothing to close). kv: the layer's KIVI pool. Run in the launch that stored the token
    (rotary_triton.qk_norm_rotary_store); reference: naive_close_pages."""

    kv: PagedKV
    rows: torch.Tensor
    pages: torch.Tensor


def naive_close_pages(close: PageClose, window_k: torch.Tensor, window_v: torch.Tensor) -> None:
    """Reference for the close: window_k / window_v [rows x page, H, D] (the flat windows) through
    naive_kivi_quantize_pages, the rows whose page is negative skipped."""
    page = close.kv.page_tokens
    for row, dst in zip(close.rows.tolist(), close.pages.tolist(), strict=True):
        if dst >= 0:
            rows = slice(row * page, (row + 1) * page)
            naive_kivi_quantize_pages(window_k[rows], window_v[rows], torch.tensor([dst]), close.kv)


@dataclass(frozen=True)
class PrefixBlocks:
    """How one pass reads its sequences' quantized prefixes (plan_prefix_blocks): direct_lens keys of each sequence
    by the fused dequantizing kernel (0 for the block-path sequences), then blocks of block_tokens keys: in block
    i, block_lens[i][b] keys of sequence b, from key i * block_tokens, dequantized into workspace row ws_rows[b]."""

    direct_lens: list[int]
    block_tokens: int
    ws_rows: list[int]
    block_lens: list[list[int]]


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def blockwise_supported(head_dim: int, page_tokens: int, value_group: int) -> bool:
    """Whether a KIVI pool's whole pages tile (_load_kivi_pages, dequantize_block): a power-of-two page, and value
    scales that broadcast over whole channel groups of the kernels' padded head (the next power of two, at least
    16), so a power-of-two group dividing it."""
    padded_head = 1 << (max(head_dim, 16) - 1).bit_length()
    return power_of_two(page_tokens) and power_of_two(value_group) and padded_head % value_group == 0


def plan_prefix_blocks(
    q_lens: list[int], prefix_lens: list[int], group: int, page_tokens: int, head_dim: int, value_group: int,
    workspace_tokens: int | None = None,
) -> PrefixBlocks | None:
    """The block path for sequences whose chunk has >= BLOCKWISE_MIN_ROWS query rows and a quantized prefix
    (prefix_lens: whole pages); None when no sequence qualifies or the pool's geometry is not one
    dequantize_block takes (blockwise_supported; the fused kernel reads those). The workspace is shared evenly, in
    whole pages."""
    long = [q * group >= BLOCKWISE_MIN_ROWS and n > 0 for q, n in zip(q_lens, prefix_lens, strict=True)]
    if not any(long) or not blockwise_supported(head_dim, page_tokens, value_group):
        return None
    workspace_tokens = BLOCKWISE_WORKSPACE_TOKENS if workspace_tokens is None else workspace_tokens
    block = max(page_tokens, workspace_tokens // sum(long) // page_tokens * page_tokens)
    count = math.ceil(max(n for n, is_long in zip(prefix_lens, long, strict=True) if is_long) / block)
    ws_rows = [sum(long[:b]) if is_long else 0 for b, is_long in enumerate(long)]
    block_lens = [[min(max(n - i * block, 0), block) if is_long else 0 for n, is_long in zip(prefix_lens, long, strict=True)]
                  for i in range(count)]
    return PrefixBlocks([0 if is_long else n for n, is_long in zip(prefix_lens, long, strict=True)], block, ws_rows,
                        block_lens)


def naive_dequantize_block(
    kv: PagedKV, kv_table: torch.Tensor, block_lens: torch.Tensor, ws_rows: torch.Tensor, first_key: int,
    block_tokens: int, k_ws: torch.Tensor, v_ws: torch.Tensor,
) -> None:
    """Reference for dequantize_block: sequence b's keys first_key .. first_key + block_lens[b] - 1 (whole pages),
    dequantized, into workspace slots ws_rows[b] * block_tokens + 0 .. block_lens[b] - 1."""
    for b, n in enumerate(block_lens.tolist()):
        if n:
            pages = kv_table[b, first_key // kv.page_tokens:]
            k, v = naive_gather_kv(kv, pages, n, k_ws.dtype)
            dst = int(ws_rows[b]) * block_tokens
            k_ws[dst:dst + n], v_ws[dst:dst + n] = k, v


def naive_gather_kv(kv: PagedKV, table: torch.Tensor, num_keys: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense, dequantized keys and values [num_keys, H, D] of one sequence (table: its pages or slots)."""
    if kv.kind != "kivi":
        slots = table[:num_keys].long()
        if kv.kind == "fp8":
            assert kv.k_scale is not None and kv.v_scale is not None
            return (
                naive_fp8_dequantize(kv.k[slots], kv.k_scale[slots], dtype),
                naive_fp8_dequantize(kv.v[slots], kv.v_scale[slots], dtype),
            )
        return kv.k[slots].to(dtype), kv.v[slots].to(dtype)
    assert kv.k_scale is not None and kv.k_zero is not None and kv.v_scale is not None and kv.v_zero is not None
    keys, values = [], []
    for page in table[: -(-num_keys // kv.page_tokens)].tolist():
        rows = slice(page * kv.page_tokens, (page + 1) * kv.page_tokens)
        keys.append(naive_kivi_dequantize_keys(kv.k[page], kv.k_scale[page], kv.k_zero[page], kv.bits, dtype))
        values.append(naive_kivi_dequantize_values(
            kv.v[page], kv.v_scale[rows], kv.v_zero[rows], kv.bits, kv.value_group, dtype
        ))
    empty = kv.k.new_zeros((0, kv.num_kv_heads, kv.head_dim), dtype=dtype)
    return torch.cat(keys or [empty])[:num_keys], torch.cat(values or [empty])[:num_keys]


def naive_paged_attention(
    q: torch.Tensor, q_positions: torch.Tensor, q_offsets: torch.Tensor, kv_table: torch.Tensor,
    kv_start: torch.Tensor, kv_lens: torch.Tensor, kv: PagedKV, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for paged_attention (same arguments and results): per sequence, gather the dense dequantized keys, then plain attention."""
    out = torch.zeros_like(q)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    for b in range(kv_table.shape[0]):
        rows = slice(int(q_offsets[b]), int(q_offsets[b + 1]))
        k, v = naive_gather_kv(kv, kv_table[b], int(kv_lens[b]), q.dtype)
        out[rows], lse[rows] = naive_attention_with_lse(q[rows], k, v, q_positions[rows] - int(kv_start[b]), scale)
    return out, lse


def page_table(slot_lists: list[list[int]], page_tokens: int, device: torch.device) -> torch.Tensor:
    """Per sequence, its pool slots of keys 0..n-1 (KVAllocator pages, whole and in order) -> kv_table [B, max_pages]
    int32 of pages (page_tokens > 1) or slots (page_tokens 1); rows padded with 0 beyond each sequence's length."""
    rows = [slots[::page_tokens] for slots in slot_lists]
    table = torch.zeros((len(rows), max([len(r) for r in rows] + [1])), dtype=torch.int32)
    for b, firsts in enumerate(rows):
        table[b, : len(firsts)] = torch.tensor([s // page_tokens for s in firsts], dtype=torch.int32)
    return upload(table, device)


def naive_fp8_quantize_into(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Reference for fp8_quantize_into (naive_fp8_quantize, then an indexed store)."""
    assert FP8_MAX == 448.0
    index = slots.long()
    codes[index], scales[index] = naive_fp8_quantize(x)


def naive_kivi_quantize_pages(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, kv: PagedKV) -> None:
    """Reference for kivi_quantize_pages (the naive per-page quantizers)."""
    assert kv.k_scale is not None and kv.k_zero is not None and kv.v_scale is not None and kv.v_zero is not None
    page = kv.page_tokens
    for i, dst in enumerate(pages.tolist()):
        rows, slots = slice(i * page, (i + 1) * page), slice(dst * page, (dst + 1) * page)
        kv.k[dst], kv.k_scale[dst], kv.k_zero[dst] = naive_kivi_quantize_keys(k[rows], kv.bits)
        kv.v[dst], kv.v_scale[slots], kv.v_zero[slots] = naive_kivi_quantize_values(v[rows], kv.bits, kv.value_group)
