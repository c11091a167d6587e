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


def test_random_sessions_keep_slot_accounting_exact():
    rng = random.Random(0)
    kv, ssm = KVAllocator(256, page_tokens=4), SSMSlotAllocator(12)
    copies: list[tuple[int, int]] = []
    manager = CacheManager(kv, ssm, lambda s, d: copies.append((s, d)))
    prefixes = [[rng.randrange(50) for _ in range(20)] for _ in range(3)]
    running: list[Sequence] = []
    for step in range(60):
        if len(running) < 3:
            prompt = rng.choice(prefixes)[: rng.randrange(5, 21)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            seq = Sequence(f"r{step}", prompt)
            if manager.admit(seq):
                running.append(seq)
        for seq in list(running):
            # Simulate a pass: one chunk of up to 7 tokens or one decode token.
            length = min(7, seq.num_prompt_tokens - seq.num_computed_tokens) if seq.is_prefilling else 1
            if not manager.reserve(seq, seq.num_computed_tokens + length):
                manager.finish(seq)
                running.remove(seq)
                continue
            seq.num_computed_tokens += length
            manager.checkpoint(seq)
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
    # Checkpoints were forked copy-on-write into requests (hits happened).
    assert copies


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


def test_new_checkpoints_replace_the_least_recently_used_when_slots_are_full():
    # Three slots: one working slot for the running request, two for checkpoints.
    kv, ssm = KVAllocator(256), SSMSlotAllocator(3)
    manager = CacheManager(kv, ssm, lambda s, d: None)
    old = Sequence("old", list(range(100, 120)))
    assert manager.admit(old) and manager.reserve(old, 20)
    for end in (10, 20):
        old.num_computed_tokens = end
        manager.checkpoint(old)
    manager.finish(old)
    assert manager.radix is not None and manager.radix.num_checkpoints == 2
    new = Sequence("new", list(range(200, 230)))
    assert manager.admit(new) and manager.reserve(new, 30)
    for end in (10, 20, 30):
        new.num_computed_tokens = end
        manager.checkpoint(new)
    # The old session's checkpoints made room for the running request's first two boundaries; the
    # third finds only checkpoints on the request's own locked path and is skipped, not forced.
    assert manager.radix.match_prefix(list(range(200, 230))).num_tokens == 20
    assert manager.radix.match_prefix(list(range(100, 120))).num_tokens == 0


def test_checkpoints_never_take_the_slots_kept_for_admission():
    """Two working slots kept (max running 2): a long prefill checkpointing every chunk stops short of them,
    so a second request is still admitted while the first runs."""
    kv, ssm = KVAllocator(256), SSMSlotAllocator(5)
    manager = CacheManager(kv, ssm, lambda s, d: None, working_slots=2)
    long = Sequence("long", list(range(100, 160)))
    assert manager.admit(long) and manager.reserve(long, 60)
    for end in range(10, 61, 10):
        long.num_computed_tokens = end
        manager.checkpoint(long)
    assert manager.radix is not None and manager.radix.num_checkpoints == 3
    assert ssm.num_free == 1 and manager.num_working == 1
    short = Sequence("short", [1, 2, 3])
    assert manager.admit(short)
    assert manager.num_working == 2 and ssm.num_free == 0
    manager.finish(short)
    manager.finish(long)
    assert manager.num_working == 0


def test_without_a_reserve_checkpoints_may_use_every_slot():
    kv, ssm = KVAllocator(256), SSMSlotAllocator(4)
    manager = CacheManager(kv, ssm, lambda s, d: None)
    long = Sequence("long", list(range(100, 160)))
    assert manager.admit(long) and manager.reserve(long, 60)
    for end in range(10, 61, 10):
        long.num_computed_tokens = end
        manager.checkpoint(long)
    # The running request's own path is locked: nothing can be evicted, so admission fails.
    assert ssm.num_free == 0
    assert not manager.admit(Sequence("short", [1, 2, 3]))
