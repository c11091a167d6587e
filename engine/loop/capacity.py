"""The scheduler's Capacity protocol over the real caches: KV allocator, SSM slots and radix prefix cache."""

from __future__ import annotations

from headroom.engine.cache.manager import CacheManager
from headroom.engine.cache.radix import RadixNode
from headroom.engine.scheduler.types import SchedRequest
from headroom.engine.sequence import Sequence


class CacheCapacity:
    """Reads CacheManager's pools; `sequences` maps request ids to the engine's Sequence objects."""

    def __init__(self, cache: CacheManager, sequences: dict[str, Sequence], max_running_requests: int):
        self.cache = cache
        self.sequences = sequences
        self.max_running_requests = max_running_requests

    def free_kv_tokens(self) -> int:
        evictable = self.cache.radix.evictable_tokens() if self.cache.radix is not None else 0
        return self.cache.kv_allocator.num_free_tokens + evictable

    def free_ssm_slots(self) -> int:
        if self.cache.ssm_allocator is None:
            # A model without linear attention needs no slot; only the running limit binds.
            return self.max_running_requests
        checkpoints = self.cache.radix.num_checkpoints if self.cache.radix is not None else 0
        return self.cache.ssm_allocator.num_free + checkpoints

    def kv_tokens_to_extend(self, request: SchedRequest, num_new: int) -> int:
        seq = self.sequences[request.request_id]
        held = len(seq.kv_slots)
        return self.cache.kv_allocator.slots_needed(held, request.num_computed + num_new)

    def cached_prefix_len(self, request: SchedRequest) -> int:
        if self.cache.radix is None:
            return 0
        return self.cache.radix.match_prefix(self._match_tokens(request)).num_tokens

    def kv_tokens_locked_by_admission(self, request: SchedRequest) -> int:
        if self.cache.radix is None:
            return 0
        match = self.cache.radix.match_prefix(self._match_tokens(request))
        return sum(len(node.kv_slots) for node in _path(match.node) if node.lock_ref == 0)

    def kv_tokens_freed_by_preemption(self, request: SchedRequest) -> int:
        seq = self.sequences[request.request_id]
        # Its own pages go back to the pool or, published, to the cache as evictable; shared prefix pages
        # become evictable where no other request holds them.
        freed = len(seq.kv_slots) - seq.num_shared_slots
        if self.cache.radix is not None and seq.prefix_node is not None:
            freed += sum(len(node.kv_slots) for node in _path(seq.prefix_node) if node.lock_ref == 1)
        return freed

    def _match_tokens(self, request: SchedRequest) -> list[int]:
        # What CacheManager.admit matches: every token but the last, whose logits the next token needs.
        return self.sequences[request.request_id].token_ids[:-1]


def _path(node: RadixNode) -> list[RadixNode]:
    """The nodes from `node` up to (not including) the root."""
    nodes = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    return nodes
