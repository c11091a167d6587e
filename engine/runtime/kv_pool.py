"""KVPool: the quantized K/V storage of every full-attention layer, indexed by KVAllocator's token slots.

Formats (engine/plan/kv_format.py is the byte layout): `auto` stores the model dtype, bf16 bf16,
fp8 e4m3 + fp32 scale per token per head, int8/int4/int2 KIVI pages of `page_tokens` tokens.
KIVI pages are written whole: the open page of a sequence (fewer than page_tokens newest tokens) stays in
full precision in that sequence's residual window here, outside the pool, until it fills. The windows are one
static buffer per layer, a row of page_tokens tokens for each running request (the planner's
`kv_residual_window` line), so that a decode graph records their addresses: a graphed step writes its token
into the row (window_slots: the fused norm/rotary kernel stores it there) and, when that fills the page, quantizes
the row into the pool in the same launch (page_close).
"""

from __future__ import annotations

import torch
from headroom.engine.plan.kv_format import kv_format
from headroom.engine.sequence import Sequence
from headroom.kernels import ops
from headroom.kernels.host_copy import to_device
from headroom.kernels.paged_kv import PageClose, PagedKV


class KVPool:
    """num_tokens slots x num_layers full-attention layers x num_kv_heads x head_dim."""

    def __init__(
        self, num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int,
        kv_dtype: str, model_dtype: torch.dtype, device: torch.device, residual_rows: int = 1,
    ):
        self.kv_dtype = kv_dtype
        self.model_dtype = model_dtype
        fmt = None if kv_dtype == "auto" else kv_format(kv_dtype)
        self.is_kivi = bool(fmt and fmt.is_kivi)
        self.bits = fmt.bits if fmt else 0
        self.page_tokens = fmt.page_tokens if fmt else 1
        self.value_group = fmt.value_group_channels if fmt else 0
        if num_tokens % self.page_tokens:
            raise ValueError(f"max_total_tokens={num_tokens} is not a multiple of the {kv_dtype} page of {self.page_tokens}")
        self.num_tokens = num_tokens
        self.num_layers = num_layers
        shape = (num_tokens, num_kv_heads, head_dim)
        pages = num_tokens // self.page_tokens
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(num_layers):
            if kv_dtype in ("auto", "bf16"):
                dtype = model_dtype if kv_dtype == "auto" else torch.bfloat16
                store = {"k": torch.zeros(shape, dtype=dtype, device=device), "v": torch.zeros(shape, dtype=dtype, device=device)}
            elif kv_dtype == "fp8":
                store = {
                    name: torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for name in ("k", "v")
                } | {name: torch.zeros(shape[:2], dtype=torch.float32, device=device) for name in ("k_scale", "v_scale")}
            else:
                packed = (pages, self.page_tokens * self.bits // 8, num_kv_heads, head_dim)
                groups = -(-head_dim // self.value_group)
                store = {
                    "k": torch.zeros(packed, dtype=torch.uint8, device=device),
                    "v": torch.zeros(packed, dtype=torch.uint8, device=device),
                    "k_scale": torch.zeros((pages, num_kv_heads, head_dim), dtype=torch.float16, device=device),
                    "k_zero": torch.zeros((pages, num_kv_heads, head_dim), dtype=torch.float16, device=device),
                    "v_scale": torch.zeros((num_tokens, num_kv_heads, groups), dtype=torch.float16, device=device),
                    "v_zero": torch.zeros((num_tokens, num_kv_heads, groups), dtype=torch.float16, device=device),
                }
            self.layers.append(store)
        # KIVI: per layer, the open pages of up to residual_rows running requests [rows, page, H, D] (model
        # dtype), and which row each request holds.
        rows = residual_rows if self.is_kivi else 0
        window = (rows, self.page_tokens, num_kv_heads, head_dim)
        self.residual_k = [torch.zeros(window, dtype=model_dtype, device=device) for _ in range(num_layers if rows else 0)]
        self.residual_v = [torch.zeros(window, dtype=model_dtype, device=device) for _ in range(num_layers if rows else 0)]
        self._residual_rows: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def nbytes(self) -> int:
        """Bytes of pool storage (residual windows excluded; they belong to running requests)."""
        return sum(t.numel() * t.element_size() for store in self.layers for t in store.values())

    def residual_nbytes(self) -> int:
        """Bytes of the KIVI residual windows of every layer (the plan's kv_residual_window at 2-byte dtypes)."""
        return sum(t.numel() * t.element_size() for t in (*self.residual_k, *self.residual_v))

    @property
    def stores_rows_as_is(self) -> bool:
        """A token-granular pool in the model's own format (auto/bf16): a layer may store its K/V rows itself
        (ops.qk_norm_rotary_store) instead of through write_rows."""
        return self.kv_dtype in ("auto", "bf16")

    def residual_row(self, seq: Sequence) -> int:
        """seq's row of the residual windows, leased on its first KIVI store."""
        row = self._residual_rows.get(seq.request_id)
        if row is None:
            if not self._free_rows:
                raise RuntimeError(
                    f"request {seq.request_id!r}: all {len(self.residual_k[0]) if self.residual_k else 0} KIVI "
                    "residual windows are held (one per running request)")
            row = self._residual_rows[seq.request_id] = self._free_rows.pop()
        return row

    def write(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize-on-write k, v [T, H, D] into slots (KIVI: whole pages, page-aligned, in order)."""
        store = self.layers[layer]
        if not self.is_kivi:
            self.write_rows(layer, to_device(slots, torch.long, k.device), k, v)
            return
        if any(slots[i] % self.page_tokens for i in range(0, len(slots), self.page_tokens)):
            raise ValueError(f"KIVI writes take whole pages of {self.page_tokens} slots, page-aligned")
        if ops.kivi_quantize_into_pool(
            store, self.kv_dtype, self.bits, self.page_tokens, self.value_group, slots, k.contiguous(), v.contiguous()
        ):
            return
        page_len = self.page_tokens
        for start in range(0, len(slots), page_len):
            page = slots[start] // page_len
            assert slots[start] % page_len == 0 and len(slots) - start >= page_len
            k_packed, k_scale, k_zero = ops.kivi_quantize_keys(k[start : start + page_len], self.bits)
            v_packed, v_scale, v_zero = ops.kivi_quantize_values(v[start : start + page_len], self.bits, self.value_group)
            store["k"][page], store["k_scale"][page], store["k_zero"][page] = k_packed, k_scale, k_zero
            store["v"][page] = v_packed
            value_rows = slice(slots[start], slots[start] + page_len)
            store["v_scale"][value_rows], store["v_zero"][value_rows] = v_scale, v_zero

    def write_rows(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Token-granular formats (auto/bf16/fp8): k, v [T, H, D] into pool rows index [T] (int64)."""
        assert not self.is_kivi
        store = self.layers[layer]
        if self.kv_dtype == "fp8":
            if k.is_cuda:
                ops.fp8_quantize_into_rows(k, v, index, store)
                return
            for name, x in (("k", k), ("v", v)):
                codes, scale = ops.fp8_quantize(x)
                store[name][index], store[name + "_scale"][index] = codes, scale
            return
        store["k"][index], store["v"][index] = k.to(store["k"].dtype), v.to(store["v"].dtype)

    def read(self, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized k, v [T, H, D] in the model dtype (KIVI: whole pages)."""
        store = self.layers[layer]
        device = store["k"].device
        if not self.is_kivi:
            index = torch.tensor(slots, dtype=torch.long, device=device)
            if self.kv_dtype == "fp8":
                return tuple(  # type: ignore[return-value]
                    ops.fp8_dequantize(store[n][index], store[n + "_scale"][index], self.model_dtype) for n in ("k", "v")
                )
            return store["k"][index].to(self.model_dtype), store["v"][index].to(self.model_dtype)
        keys, values = [], []
        for start in range(0, len(slots), self.page_tokens):
            page = slots[start] // self.page_tokens
            rows = slice(slots[start], slots[start] + self.page_tokens)
            keys.append(ops.kivi_dequantize_keys(store["k"][page], store["k_scale"][page], store["k_zero"][page], self.bits, self.model_dtype))
            values.append(ops.kivi_dequantize_values(
                store["v"][page], store["v_scale"][rows], store["v_zero"][rows], self.bits, self.value_group, self.model_dtype
            ))
        return torch.cat(keys), torch.cat(values)

    def store(self, layer: int, seq: Sequence, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the K/V of seq's positions start..start+T-1 (its kv_slots must already cover them)."""
        end = start + k.shape[0]
        if len(seq.kv_slots) < end:
            raise ValueError(f"request {seq.request_id!r} holds {len(seq.kv_slots)} kv slots, needs {end}")
        if not self.is_kivi:
            self.write(layer, seq.kv_slots[start:end], k, v)
            return
        # The window holds positions page_start..start-1 (start % page of them); pages that fill are written whole.
        row, page = self.residual_row(seq), self.page_tokens
        window_k, window_v = self.residual_k[layer][row], self.residual_v[layer][row]
        filled, page_start, left = start % page, start - start % page, end % page
        if page_start + page > end:  # the open page does not fill
            window_k[filled : filled + k.shape[0]], window_v[filled : filled + k.shape[0]] = k, v
            return
        closed = end - left
        head = closed - start
        self.write(layer, seq.kv_slots[page_start:closed], torch.cat((window_k[:filled], k[:head])),
                   torch.cat((window_v[:filled], v[:head])))
        window_k[:left], window_v[:left] = k[head:], v[head:]

    def window_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's residual windows as token slots, K and V [rows x page, H, D] (views): a graphed KIVI decode
        step stores its tokens there (row x page + offset in the page) in the launch that norms and rotates them."""
        return self.residual_k[layer].flatten(0, 1), self.residual_v[layer].flatten(0, 1)

    def page_close(self, layer: int, rows: torch.Tensor, close_pages: torch.Tensor) -> PageClose:
        """A graphed KIVI decode step's close of the layer's window rows rows[b] whose page the step fills
        (close_pages[b] >= 0) into that pool page, for the launch that stores the step's tokens into the windows
        (window_slots; ops.qk_norm_rotary_store): index tensors on the device, so that a graph records the step
        whatever the lengths."""
        return PageClose(PagedKV.from_store(self.layers[layer], self.kv_dtype, self.bits, self.page_tokens,
                                            self.value_group), rows, close_pages)

    def context(self, layer: int, seq: Sequence, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of seq's positions 0..end-1 ([end, H, D], model dtype); end must be seq's stored length."""
        if not self.is_kivi:
            return self.read(layer, seq.kv_slots[:end])
        closed = end - end % self.page_tokens
        k, v = self.read(layer, seq.kv_slots[:closed]) if closed else (None, None)
        tail = self.residual_window(layer, seq, end)
        parts_k = [x for x in (k, tail[0] if tail is not None else None) if x is not None]
        parts_v = [x for x in (v, tail[1] if tail is not None else None) if x is not None]
        return torch.cat(parts_k), torch.cat(parts_v)

    def residual_window(self, layer: int, seq: Sequence, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Full-precision K, V [n, H, D] of seq's open KIVI page in this layer, for its stored length end (None if
        it has no open page)."""
        row = self._residual_rows.get(seq.request_id)
        n = end % self.page_tokens
        if row is None or not n:
            return None
        return self.residual_k[layer][row, :n], self.residual_v[layer][row, :n]

    def release(self, seq: Sequence) -> None:
        """Free seq's residual window row (its pool slots are the allocator's business)."""
        row = self._residual_rows.pop(seq.request_id, None)
        if row is not None:
            self._free_rows.append(row)
