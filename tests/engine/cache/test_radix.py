"""Radix cache invariants without a model: matching, page granularity, locks, LRU eviction, checkpoints."""

from __future__ import annotations

import random

import pytest
from headroom.engine.cache.kv_slots import KVAllocator
from headroom.engine.cache.radix import RadixCache
from headroom.engine.cache.ssm_slots import SSMSlotAllocator


def held(radix: RadixCache) -> list[int]:
    slots, stack = [], [radix.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        slots.extend(node.kv_slots)
    return slots


def unlocked(radix: RadixCache) -> int:
    """KV slots of nodes no request locks, by a walk of the whole tree."""
    total, stack = 0, [radix.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not radix.root and node.lock_ref == 0:
            total += len(node.kv_slots)
    return total


def check_accounting(radix: RadixCache, running: list[int] | None = None) -> None:
    """Every slot is exactly one of: free, held by the tree, held privately by a running request; the evictable
    count the tree keeps as locks change is what a walk finds."""
    tree = held(radix)
    assert len(tree) == len(set(tree)) == radix.num_cached_tokens
    assert radix.evictable_tokens() == unlocked(radix)
    private = running or []
    assert len(tree) + len(private) + radix.kv_allocator.num_free_tokens == radix.kv_allocator.num_tokens


def test_match_returns_longest_prefix_and_splits():
    kv = KVAllocator(64)
    radix = RadixCache(kv)
    slots = kv.alloc(6)
    radix.insert([1, 2, 3, 4, 5, 6], slots)
    match = radix.match_prefix([1, 2, 3, 9])
    assert match.num_tokens == 3 and match.kv_slots == slots[:3]
    # The split made a node ending exactly at the hit.
    assert match.node.key == [1, 2, 3]
    check_accounting(radix)


def test_insert_reports_existing_prefix_and_path_slots():
    kv = KVAllocator(64)
    radix = RadixCache(kv)
    first = kv.alloc(4)
    radix.insert([1, 2, 3, 4], first)
    second = kv.alloc(6)
    result = radix.insert([1, 2, 3, 4, 7, 8], second)
    assert result.num_existing == 4
    assert result.kv_slots == first + second[4:]
    kv.free(second[:4])
    check_accounting(radix)


def test_pages_are_never_split():
    kv = KVAllocator(64, page_tokens=4)
    radix = RadixCache(kv)
    slots = kv.alloc(8)
    radix.insert(list(range(8)), slots)
    match = radix.match_prefix([0, 1, 2, 3, 4, 5, 99, 99])
    assert match.num_tokens == 4
    with pytest.raises(ValueError, match="whole pages"):
        radix.insert([0, 1, 2], slots[:3])


def test_locked_nodes_survive_eviction_and_lru_goes_first():
    kv = KVAllocator(12)
    radix = RadixCache(kv)
    a, b, c = kv.alloc(4), kv.alloc(4), kv.alloc(4)
    radix.insert([1, 1, 1, 1], a)
    radix.insert([2, 2, 2, 2], b)
    radix.insert([3, 3, 3, 3], c)
    radix.match_prefix([1, 1, 1, 1])  # a is now most recently used
    locked = radix.match_prefix([3, 3, 3, 3]).node
    radix.lock(locked)
    assert radix.evict(4) == 4
    assert radix.match_prefix([2, 2, 2, 2]).num_tokens == 0
    assert radix.match_prefix([1, 1, 1, 1]).num_tokens == 4
    # Only the locked node is left after evicting everything evictable.
    radix.evict(100)
    assert radix.match_prefix([3, 3, 3, 3]).num_tokens == 4 and kv.num_free_tokens == 8
    radix.unlock(locked)
    assert radix.evict(100) == 4 and kv.num_free_tokens == 12
    check_accounting(radix)


def test_eviction_frees_leaves_before_parents():
    kv = KVAllocator(16)
    radix = RadixCache(kv)
    radix.insert([1, 2], kv.alloc(2))
    radix.insert([1, 2, 3, 4], radix.match_prefix([1, 2]).kv_slots + kv.alloc(2))
    radix.evict(1)
    assert radix.match_prefix([1, 2, 3, 4]).num_tokens == 2
    check_accounting(radix)


def test_hybrid_hit_needs_a_checkpoint_and_evicts_it_with_its_kv():
    kv, ssm = KVAllocator(32), SSMSlotAllocator(4)
    radix = RadixCache(kv, ssm, require_checkpoint=True)
    slots = kv.alloc(9)
    radix.insert(list(range(9)), slots)
    assert radix.match_prefix(list(range(9))).num_tokens == 0
    ckpt = ssm.alloc()
    assert radix.insert(list(range(6)), slots[:6], ckpt).ssm_adopted
    match = radix.match_prefix(list(range(9)))
    assert (match.num_tokens, match.ssm_slot) == (6, ckpt)
    # A second checkpoint for the same prefix is not adopted (the caller frees it).
    assert not radix.insert(list(range(6)), slots[:6], ssm.alloc()).ssm_adopted
    radix.evict(100)
    assert ssm.num_free == 3 and kv.num_free_tokens == 32 and radix.num_checkpoints == 0


def test_fork_is_copy_on_write_and_keeps_the_checkpoint():
    kv, ssm = KVAllocator(16), SSMSlotAllocator(2)
    radix = RadixCache(kv, ssm, require_checkpoint=True)
    ckpt = ssm.alloc()
    radix.insert([5, 6, 7], kv.alloc(3), ckpt)
    copies: list[tuple[int, int]] = []
    match = radix.match_prefix([5, 6, 7, 8])
    radix.lock(match.node)
    own = radix.fork_checkpoint(match, lambda src, dst: copies.append((src, dst)))
    assert own is not None and own != ckpt and copies == [(ckpt, own)]
    # No slot left: a locked hit's checkpoint is not evicted to make room.
    assert radix.fork_checkpoint(match, lambda s, d: copies.append((s, d))) is None
    assert radix.match_prefix([5, 6, 7]).ssm_slot == ckpt


def test_checkpoint_eviction_keeps_kv():
    kv, ssm = KVAllocator(16), SSMSlotAllocator(2)
    radix = RadixCache(kv, ssm, require_checkpoint=True)
    radix.insert([1, 2, 3], kv.alloc(3), ssm.alloc())
    assert radix.evict_checkpoints(1) == 1
    assert ssm.num_free == 2 and radix.num_cached_tokens == 3
    assert radix.match_prefix([1, 2, 3, 4]).num_tokens == 0


def test_unlock_more_than_lock_is_an_error():
    kv = KVAllocator(8)
    radix = RadixCache(kv)
    radix.insert([1], kv.alloc(1))
    node = radix.match_prefix([1]).node
    with pytest.raises(RuntimeError):
        radix.unlock(node)


@pytest.mark.parametrize("page", [1, 4])
def test_evictable_count_follows_locks_splits_and_evictions(page):
    """The count kept by lock/unlock equals a walk through inserts that split locked and unlocked edges, nested
    locks, unlocks and evictions (random prompts sharing prefixes)."""
    rng = random.Random(page)
    kv = KVAllocator(4096, page_tokens=page)
    radix = RadixCache(kv)
    locked: list = []
    for _ in range(300):
        action = rng.random()
        if action < 0.45:
            prefix = rng.choice([[], [1] * (2 * page), [1] * page + [2] * page, [3] * (3 * page)])
            tokens = prefix + [rng.randrange(8) for _ in range(page * rng.randrange(1, 4))]
            match = radix.match_prefix(tokens)
            slots = kv.alloc(len(tokens) - match.num_tokens)
            if slots is None:
                radix.evict(len(tokens))
                continue
            result = radix.insert(tokens, match.kv_slots + slots)
            kv.free(slots[: result.num_existing - match.num_tokens])
            if rng.random() < 0.5:
                radix.lock(result.node)
                locked.append(result.node)
        elif action < 0.7 and locked:
            radix.unlock(locked.pop(rng.randrange(len(locked))))
        elif action < 0.85:
            radix.evict(rng.randrange(1, 4 * page))
        else:
            node = radix.match_prefix([1] * (2 * page)).node
            if node is not radix.root:
                radix.lock(node)
                locked.append(node)
        check_accounting(radix)
    for node in locked:
        radix.unlock(node)
    assert radix.evictable_tokens() == radix.num_cached_tokens
    check_accounting(radix)


class WalkingEviction(RadixCache):
    """Eviction as it was before the LRU queue: collect every unlocked leaf by a walk, take the oldest each time."""

    def evict(self, num_tokens: int) -> int:
        freed = 0
        leaves = self._evictable_leaves()
        while freed < num_tokens and leaves:
            leaves.sort(key=lambda n: n.last_access)
            node = leaves.pop(0)
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.key[: self.page_size])]
            self.kv_allocator.free(node.kv_slots)
            self._drop_checkpoint(node)
            freed += len(node.kv_slots)
            self.num_cached_tokens -= len(node.kv_slots)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                leaves.append(parent)
        return freed


def paths(radix: RadixCache) -> list[tuple[tuple[int, ...], int | None]]:
    """Every node as (its whole prefix, its checkpoint)."""
    out, stack = [], [(radix.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            stack.append((child, prefix + tuple(child.key)))
            out.append((prefix + tuple(child.key), child.ssm_slot))
    return sorted(out, key=lambda pair: pair[0])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_eviction_takes_the_same_leaves_as_the_walk_did(seed):
    """The LRU queue evicts what a walk of the whole tree took, oldest unlocked leaf first, through a random run
    of inserts (with checkpoints in the hybrid case), matches (which touch and split), locks, unlocks and
    evictions small and large; the queue stays bounded by the tree's size."""
    rng = random.Random(seed)
    hybrid = seed % 2 == 1
    caches = [(cls(kv, ssm, require_checkpoint=hybrid), kv, ssm, [])
              for cls in (RadixCache, WalkingEviction)
              for kv, ssm in [(KVAllocator(512, page_tokens=2), SSMSlotAllocator(64))]]
    for step in range(600):
        action = rng.random()
        prefix = rng.choice([[], [1, 1], [1, 1, 2, 2], [3, 3, 3, 3, 3, 3]])
        tokens = prefix + [rng.randrange(6) for _ in range(2 * rng.randrange(1, 5))]
        lock_it, checkpoint, evict_n = rng.random() < 0.4, hybrid and rng.random() < 0.6, rng.choice([1, 2, 7, 40])
        for radix, kv, ssm, locked in caches:
            if action < 0.4:
                match = radix.match_prefix(tokens)
                slots = kv.alloc(len(tokens) - match.num_tokens)
                if slots is None:
                    radix.evict(len(tokens))
                    continue
                ckpt = ssm.alloc() if checkpoint else None
                result = radix.insert(tokens, match.kv_slots + slots, ckpt)
                kv.free(slots[: result.num_existing - match.num_tokens])
                if ckpt is not None and not result.ssm_adopted:
                    ssm.free(ckpt)
                if lock_it:
                    radix.lock(result.node)
                    locked.append(result.node)
            elif action < 0.55:
                radix.match_prefix(tokens)
            elif action < 0.7:
                if locked:
                    radix.unlock(locked.pop(0))
            else:
                radix.evict(evict_n)
        (new, new_kv, _, _), (old, old_kv, _, _) = caches
        assert paths(new) == paths(old), step
        assert new_kv.num_free_tokens == old_kv.num_free_tokens
        check_accounting(new)
        assert len(new._lru) <= 2 * new._num_nodes + 65
    # Matches alone touch leaves again and again: the queue fills with stale entries and is rebuilt from the tree.
    for radix, _, _, locked in caches:
        while locked:
            radix.unlock(locked.pop())
    leaves = [list(prefix) for prefix, _ in paths(new) if not any(
        other[: len(prefix)] == prefix and len(other) > len(prefix) for other, _ in paths(new))]
    sizes = []
    for _ in range(400):
        tokens = rng.choice(leaves)
        for radix, _, _, _ in caches:
            radix.match_prefix(tokens)
        sizes.append(len(new._lru))
    assert any(b < a for a, b in zip(sizes, sizes[1:], strict=False)) and max(sizes) <= 2 * new._num_nodes + 65
    for radix, _, _, _ in caches:
        radix.evict(60)
    assert paths(new) == paths(old) and new.evictable_tokens() == unlocked(new)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_common_length_is_the_whole_pages_that_match(page):
    """_common_len (slice comparisons and a bisection) against a token-by-token walk, for mismatches anywhere,
    edges and token tails of any length, and a tail shorter than a page."""
    radix = RadixCache(KVAllocator(64, page))
    rng = random.Random(page)
    for _ in range(400):
        edge = [rng.randrange(3) for _ in range(page * rng.randrange(1, 12))]
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 5))] + edge[: rng.randrange(0, len(edge) + 1)]
        tokens += [rng.randrange(3) for _ in range(rng.randrange(0, 2 * page + 2))]
        if tokens and rng.random() < 0.5:
            tokens[rng.randrange(len(tokens))] = 7  # a mismatch somewhere
        pos = rng.randrange(0, len(tokens) + 1)
        n = 0
        while n < min(len(edge), len(tokens) - pos) and edge[n] == tokens[pos + n]:
            n += 1
        assert radix._common_len(edge, tokens, pos) == n - n % page
