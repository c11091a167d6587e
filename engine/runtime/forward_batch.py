"""ForwardBatch: one mixed pass (prefill chunks and decodes), flattened to a token axis."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from headroom.engine.sequence import Sequence
from headroom.kernels.host_copy import to_device

# (tokens into the item, SSM slot): after that many of the item's tokens, copy the sequence's SSM state
# (conv and recurrent, every layer) into that slot - a prefix checkpoint taken inside the pass.
Capture = tuple[int, int]


@dataclass(frozen=True)
class BatchItem:
    """token_ids are seq's next uncomputed tokens: a prefill chunk, or the one token of a decode step.
    captures: checkpoints inside the chunk, ascending, each strictly between its first and last token."""

    seq: Sequence
    token_ids: list[int]
    captures: tuple[Capture, ...] = ()


@dataclass(frozen=True)
class ItemSpan:
    """Item i occupies flat rows offset..offset+length-1 and sequence positions start..start+length-1."""

    seq: Sequence
    offset: int
    length: int
    start: int
    captures: tuple[Capture, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length


# Names of the per-pass index tensors the layers build through ForwardBatch.cached(); DecodeGraphs fills
# them with its static buffers instead (engine/runtime/decode_graphs.py).
KV_WRITE_ROWS = "kv_write_rows"
POOL_INDEX = "paged_attention.pool"
# KIVI: (table over the flattened residual windows, lengths) of each sequence's open page, or None for none.
WINDOW_INDEX = "paged_attention.window"
# KIVI: the block path of the long chunks' prefixes (engine/layers/paged_attention.py PrefixBlockIndex) or None;
# eager passes only (a graphed decode step has no chunk long enough).
POOL_BLOCKS = "paged_attention.blocks"
# KIVI decode graphs: (each token's slot in the flattened residual windows (int64, its window row x page + its
# offset in the page), its window row, the pool page its step closes or -1): the fused store writes the slots,
# KVPool.page_close the pages.
KIVI_WRITE = "kivi_write"
GDN_SLOTS = "gdn.slots"
GDN_BOUNDS = "gdn.bounds"
# A pass with captures: its delta rule's varlen rounds and tail launch (engine/layers/linear_attention.py); eager
# passes only.
GDN_SEGMENTS = "gdn.segments"
LAST_ROWS = "last_rows"


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor
    positions: torch.Tensor
    spans: list[ItemSpan]
    # Index tensors every layer of this pass needs: built by the first layer, reused by the rest.
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # True for a decode pass of DecodeGraphs: every index above is given, the spans are placeholders
    # (their sequences are not the requests), so layers must take their batched, index-driven paths.
    is_static: bool = False

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        """build() once per pass (every layer sees the same spans and slots)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def is_decode_only(self) -> bool:
        return all(span.length == 1 for span in self.spans)

    @property
    def has_captures(self) -> bool:
        return any(span.captures for span in self.spans)

    @classmethod
    def build(cls, items: list[BatchItem], device: torch.device) -> ForwardBatch:
        if not items:
            raise ValueError("a forward batch needs at least one item")
        seen: set[str] = set()
        spans: list[ItemSpan] = []
        tokens: list[int] = []
        positions: list[int] = []
        for item in items:
            seq = item.seq
            if seq.request_id in seen:
                raise ValueError(f"request {seq.request_id!r} appears twice in one batch")
            seen.add(seq.request_id)
            if not item.token_ids:
                raise ValueError(f"request {seq.request_id!r}: batch item has no tokens")
            start = seq.num_computed_tokens
            if any(not 0 < at < len(item.token_ids) for at, _ in item.captures) or \
                    [at for at, _ in item.captures] != sorted({at for at, _ in item.captures}):
                raise ValueError(f"request {seq.request_id!r}: captures {item.captures} must be ascending and inside "
                                 f"its {len(item.token_ids)} tokens")
            spans.append(ItemSpan(seq, len(tokens), len(item.token_ids), start, item.captures))
            tokens.extend(item.token_ids)
            positions.extend(range(start, start + len(item.token_ids)))
        return cls(
            token_ids=to_device(tokens, torch.long, device),
            positions=to_device(positions, torch.long, device),
            spans=spans,
        )

    @property
    def last_rows(self) -> torch.Tensor:
        return self.cached(LAST_ROWS, lambda: to_device(
            [s.offset + s.length - 1 for s in self.spans], torch.long, self.token_ids.device
        ))
