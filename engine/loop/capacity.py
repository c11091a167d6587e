"""The scheduler's Capacity protocol over the real caches: KV allocator, SSM slots and radix prefix cache."""

from __future__ import annotations

from headroom.engine.cache.manager import CacheManager
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
        seq = self.sequences[request.request_id]
        return self.cache.radix.match_prefix(seq.prompt_token_ids[:-1]).num_tokens
