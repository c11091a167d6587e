"""CacheManager over many requests (no model): slots are never leaked, double-owned or evicted while in use."""

from __future__ import annotations

import random

from headroom.engine.cache.kv_slots import KVAllocator
from headroom.engine.cache.manager import CacheManager
from headroom.engine.cache.ssm_slots import SSMSlotAllocator
from headroom.engine.sequence import Sequence


def tree_slots(manager: CacheManager) -> list[int]:
    assert manager.radix is not None
    slots, stack = [], [manager.radix.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        slots.extend(node.kv_slots)
    return slots


def run_chunk(manager: CacheManager, seq: Sequence, end: int) -> bool:
    """One pass over seq's tokens up to end the way the engine loop runs it: slots for the checkpoint stops
    inside the chunk (the pass would fill them), then publish them and checkpoint at the chunk's end."""
    start = seq.num_computed_tokens
    captures = manager.take_captures(seq, start, end) if seq.is_prefilling else []
    if not manager.reserve(seq, end):
        manager.drop_captures(captures)
        return False
    seq.num_computed_tokens = end
    manager.publish_captures(seq, captures)
    manager.checkpoint(seq)
    return True


def prefill(manager: CacheManager, seq: Sequence, chunk: int) -> None:
    while seq.is_prefilling:
        assert run_chunk(manager, seq, min(seq.num_computed_tokens + chunk, seq.num_prompt_tokens))


def test_random_sessions_keep_slot_accounting_exact():
    rng = random.Random(0)
    kv, ssm = KVAllocator(1024, page_tokens=4), SSMSlotAllocator(12)
    copies: list[tuple[int, int]] = []
    manager = CacheManager(kv, ssm, lambda s, d: copies.append((s, d)), checkpoint_interval=32)
    prefixes = [[rng.randrange(50) for _ in range(150)] for _ in range(3)]
    running: list[Sequence] = []
    for step in range(120):
        if len(running) < 3:
            prompt = rng.choice(prefixes)[: rng.randrange(60, 151)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            seq = Sequence(f"r{step}", prompt)
            if manager.admit(seq):
                running.append(seq)
        for seq in list(running):
            # Simulate a pass: a chunk of up to 37 tokens (ending at a stop) or one decode token.
            start = seq.num_computed_tokens
            end = min(start + 37, seq.num_prompt_tokens) if seq.is_prefilling else start + 1
            if not run_chunk(manager, seq, end):
                manager.finish(seq)
                running.remove(seq)
                continue
            if not seq.is_prefilling:
                seq.output_token_ids.append(rng.randrange(50))
                if len(seq.output_token_ids) >= 3:
                    manager.finish(seq)
                    running.remove(seq)
        shared = tree_slots(manager)
        private = [s for seq in running for s in seq.kv_slots[seq.num_shared_slots :]]
        assert len(set(shared)) == len(shared) and not set(shared) & set(private)
        assert len(shared) + len(private) + kv.num_free_tokens == kv.num_tokens
        # Every running request's shared prefix is exactly tree slots, and locked.
        for seq in running:
            assert set(seq.kv_slots[: seq.num_shared_slots]) <= set(shared)
            if seq.prefix_node is not None:
                assert seq.prefix_node.lock_ref > 0
        checkpoints = manager.radix.num_checkpoints if manager.radix else 0
        assert checkpoints + len(running) + ssm.num_free == ssm.num_slots
    # Checkpoints were forked copy-on-write into requests (hits happened), and slots ran short.
    assert copies and manager.stats.hit_tokens > 0
    assert manager.radix is not None and manager.radix.num_checkpoints_evicted > 0


def test_finish_frees_everything_without_cache():
    kv, ssm = KVAllocator(64), SSMSlotAllocator(2)
    manager = CacheManager(kv, ssm, lambda s, d: None, enable_prefix_cache=False)
    seq = Sequence("a", [1, 2, 3])
    assert manager.admit(seq) and manager.reserve(seq, 3)
    seq.num_computed_tokens = 3
    manager.checkpoint(seq)
    manager.finish(seq)
    assert kv.num_free_tokens == 64 and ssm.num_free == 2


def test_admit_fails_cleanly_without_ssm_slots():
    kv, ssm = KVAllocator(64), SSMSlotAllocator(1)
    manager = CacheManager(kv, ssm, lambda s, d: None)
    first, second = Sequence("a", [1, 2]), Sequence("b", [3, 4])
    assert manager.admit(first)
    assert not manager.admit(second) and second.ssm_slot is None and second.kv_slots == []


def test_checkpoints_never_take_the_slots_kept_for_admission():
    """Two working slots kept (max running 2): a long prefill with four checkpoint stops stops short of
    them, so a second request is still admitted while the first runs."""
    kv, ssm = KVAllocator(512), SSMSlotAllocator(5)
    manager = CacheManager(kv, ssm, lambda s, d: None, working_slots=2, checkpoint_interval=32)
    long = Sequence("long", list(range(1000, 1300)))
    assert manager.admit(long)
    assert long.checkpoint_stops == [192, 256, 288, 299]
    prefill(manager, long, chunk=100)
    assert manager.radix is not None and manager.radix.num_checkpoints == 3
    assert ssm.num_free == 1 and manager.num_working == 1
    short = Sequence("short", [1, 2, 3])
    assert manager.admit(short)
    assert manager.num_working == 2 and ssm.num_free == 0
    manager.finish(short)
    manager.finish(long)
    assert manager.num_working == 0


def test_without_a_reserve_checkpoints_may_use_every_slot():
    kv, ssm = KVAllocator(512), SSMSlotAllocator(4)
    manager = CacheManager(kv, ssm, lambda s, d: None, checkpoint_interval=32)
    long = Sequence("long", list(range(1000, 1300)))
    assert manager.admit(long)
    prefill(manager, long, chunk=100)
    # The running request's own path is locked: nothing can be evicted, so admission fails.
    assert ssm.num_free == 0
    assert not manager.admit(Sequence("short", [1, 2, 3]))


def test_a_request_may_decline_checkpoint_stops():
    """take_checkpoints=False (the warm-up's timed passes): the same prompt is admitted with no stops at all."""
    kv, ssm = KVAllocator(512), SSMSlotAllocator(5)
    manager = CacheManager(kv, ssm, lambda s, d: None, working_slots=2, checkpoint_interval=32)
    timed = Sequence("timed", list(range(1000, 1300)), take_checkpoints=False)
    assert manager.admit(timed) and timed.checkpoint_stops == []
