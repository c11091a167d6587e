"""What the other tensor-parallel ranks need to repeat rank 0's runner: its pass descriptions.

Rank 0 owns every decision (scheduler, cache bookkeeping, sampling). The other ranks own only tensors:
their shares of the weights and pools, and per-request runtime state (KIVI residual windows, decode-graph
rows). Each rank-0 runner call that touches those becomes an op, replayed in the same order by every rank:

  ("forward", items, all_positions)  items: (request_id, start, token_ids, ssm_slot, slots_from, probe, slots,
                                             captures, num_shared_slots)
  ("release", request_id)            ("copy", src_slot, dst_slot)   ("capture",)   ("sync",)   ("stop",)

A request's kv_slots are sent as a delta: they only grow, except when the radix cache re-points the shared
prefix (CacheManager._publish, admission), which always changes num_shared_slots; then they are sent whole.
`probe` is the last slot the receiver should already hold, so a broken delta fails loudly, never silently.
"""

from __future__ import annotations

from typing import Any

from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.sequence import Sequence

# (request_id, start, token_ids, ssm_slot, slots_from, probe, slots, captures, num_shared_slots)
EncodedItem = tuple[str, int, list[int], int | None, int, int | None, list[int], tuple[tuple[int, int], ...], int]
Op = tuple[Any, ...]


class PassEncoder:
    """Rank 0's side: items -> EncodedItems, remembering how much of each request's kv_slots was sent."""

    def __init__(self) -> None:
        # request id -> (kv slots sent, num_shared_slots when sent)
        self._sent: dict[str, tuple[int, int]] = {}

    def encode(self, item: BatchItem) -> EncodedItem:
        seq = item.seq
        slots = seq.kv_slots
        sent = self._sent.get(seq.request_id)
        start = sent[0] if sent is not None and sent[1] == seq.num_shared_slots and sent[0] <= len(slots) else 0
        self._sent[seq.request_id] = (len(slots), seq.num_shared_slots)
        probe = slots[start - 1] if start else None
        # num_shared_slots goes along: a decode graph's table row re-uploads a request whose prefix was re-pointed.
        return (seq.request_id, seq.num_computed_tokens, item.token_ids, seq.ssm_slot, start, probe, slots[start:],
                item.captures, seq.num_shared_slots)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class PassMirror:
    """Another rank's side: EncodedItems -> BatchItems over mirror Sequences that hold what the runner reads."""

    def __init__(self) -> None:
        self._seqs: dict[str, Sequence] = {}

    def decode(self, encoded: list[EncodedItem]) -> list[BatchItem]:
        items = []
        for request_id, start, token_ids, ssm_slot, slots_from, probe, slots, captures, shared in encoded:
            seq = self._seqs.get(request_id)
            if seq is None:
                # The runner checks only tokens start..end; earlier ones (a prefix hit) are placeholders.
                seq = self._seqs[request_id] = Sequence(request_id, [0] * start + list(token_ids))
            else:
                tokens = seq.prompt_token_ids
                del tokens[start:]
                tokens.extend([0] * (start - len(tokens)))
                tokens.extend(token_ids)
            held = seq.kv_slots
            if slots_from and (len(held) < slots_from or held[slots_from - 1] != probe):
                raise RuntimeError(
                    f"request {request_id!r}: rank 0 sent kv slots from {slots_from} (slot {probe} before them) "
                    f"but this rank holds {len(held)} ending in {held[-1] if held else None}"
                )
            del held[slots_from:]
            held.extend(slots)
            seq.ssm_slot = ssm_slot
            seq.num_computed_tokens = start
            seq.num_shared_slots = shared
            items.append(BatchItem(seq, list(token_ids), tuple(captures)))
        return items

    def release(self, request_id: str) -> Sequence | None:
        return self._seqs.pop(request_id, None)
