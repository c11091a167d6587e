"""Checkpoint stops and the eviction order (no model): where prefills stop, and which state goes first."""

from __future__ import annotations

from headroom.engine.cache.checkpoint_policy import MAX_STOPS_PER_REQUEST, checkpoint_stops
from headroom.engine.cache.kv_slots import KVAllocator
from headroom.engine.cache.radix import RadixCache
from headroom.engine.cache.ssm_slots import SSMSlotAllocator


def test_stops_of_a_chain_visit_cover_repeat_tail_and_chunk_checkpoints():
    # 16,000-token chain + 16-token question, chunk 8192, token pages: exact repeat 16015, tail 16000 and
    # 15936, chunk checkpoint 8192 (16384 lies beyond the prompt).
    assert checkpoint_stops(16016, 0, 0, 1, 8192) == [8192, 15936, 16000, 16015]
    # KIVI pages of 32: everything page-aligned.
    assert checkpoint_stops(16016, 0, 0, 32, 8192) == [8192, 15936, 16000]


def test_stops_lie_beyond_the_hit_and_include_the_divergence_point():
    assert checkpoint_stops(16016, 16000, 16000, 1, 8192) == [16015]
    # A match of 3003 tokens with a state only at 2000: stop at the divergence point 3003, then the tail.
    assert checkpoint_stops(5000, 2000, 3003, 1, 8192) == [3003, 4928, 4992, 4999]
    # Short prompts take no stop of their own (their final state is still kept).
    assert checkpoint_stops(60, 0, 0, 1, 8192) == []


def test_no_request_takes_more_stops_than_the_planner_prices():
    for length in range(65, 40000, 997):
        for hit in (0, length // 3):
            assert len(checkpoint_stops(length, hit, length // 2, 1, 64)) <= MAX_STOPS_PER_REQUEST


def _tree(num_slots: int) -> tuple[RadixCache, SSMSlotAllocator]:
    ssm = SSMSlotAllocator(num_slots)
    return RadixCache(KVAllocator(4096), ssm, require_checkpoint=True), ssm


def _insert(radix: RadixCache, ssm: SSMSlotAllocator, tokens: list[int]) -> None:
    slots = radix.kv_allocator.alloc(len(tokens))
    assert slots is not None
    result = radix.insert(tokens, slots, ssm.alloc())
    # Slots for tokens the tree already held are duplicates.
    radix.kv_allocator.free(slots[: result.num_existing])


def test_eviction_trims_redundant_states_smallest_loss_first_and_keeps_each_paths_only_state():
    radix, ssm = _tree(8)
    chain = list(range(1000, 1400))
    for end in (128, 320, 384, 399):
        _insert(radix, ssm, chain[:end])
    other = list(range(5000, 5100))
    _insert(radix, ssm, other)
    # Losses on the chain: 399 -> 15, 384 -> 64, 320 -> 192, 128 -> 128 (shallowest, deeper states below).
    radix.evict_checkpoints(1)
    assert radix.match_prefix(chain[:399]).num_tokens == 384
    radix.evict_checkpoints(1)
    assert radix.match_prefix(chain[:399]).num_tokens == 320
    radix.evict_checkpoints(1)
    # 128 (loss 128) went before 320 (loss 192); the other path's only state stays.
    assert radix.num_checkpoints == 2
    assert radix.match_prefix(other).num_tokens == 100
    assert radix.match_prefix(chain[:399]).num_tokens == 320
    radix.evict_checkpoints(1)
    # Now every path holds one state: least recently used goes (the chain was just matched).
    assert radix.match_prefix(other).num_tokens == 0
