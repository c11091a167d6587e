"""Radix tree over token ids: shared prefixes keep their KV slots (and, for hybrid models, SSM checkpoints).

Pure Python. Edges are compared in whole pages (page_size tokens, the KV allocator's page), so a node's
KV slots are always whole pages and eviction never splits one. A node's `ssm_slot` is the recurrent
state after its last token; for a hybrid model a hit is usable only up to the deepest such node, since
the SSM state of a shorter prefix cannot be rebuilt from KV. Ownership: the tree owns the KV slots and
checkpoint slots of its nodes and frees them only on eviction; running requests lock their path.
Which checkpoint goes first when slots run short: checkpoint_policy.eviction_key. What the engine asks every
pass (the evictable count) and every few decode steps of a full pool (the oldest unlocked leaf) is kept beside
the tree as it changes, never found by a walk of it: hence a module past 300 lines.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from headroom.engine.cache.checkpoint_policy import eviction_key
from headroom.engine.cache.kv_slots import KVAllocator
from headroom.engine.cache.ssm_slots import SSMSlotAllocator


@dataclass(eq=False)
class RadixNode:
    key: list[int]
    kv_slots: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    ssm_slot: int | None = None
    lock_ref: int = 0
    last_access: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """A usable hit: num_tokens tokens whose KV lies in kv_slots; ssm_slot checkpoints the state after them.
    num_matched_tokens: whole pages the tree holds the tokens of, usable or not (>= num_tokens; for a hybrid
    model the difference had no SSM state: the silent miss, and the divergence point to checkpoint)."""

    num_tokens: int
    kv_slots: list[int]
    node: RadixNode
    ssm_slot: int | None
    num_matched_tokens: int = 0


@dataclass(frozen=True)
class InsertResult:
    """num_existing: leading tokens the tree already held (the caller's own slots for them are duplicates
    unless they came from its match); ssm_adopted: whether the tree took the checkpoint slot."""

    num_existing: int
    ssm_adopted: bool
    node: RadixNode
    kv_slots: list[int]


class RadixCache:
    def __init__(
        self,
        kv_allocator: KVAllocator,
        ssm_allocator: SSMSlotAllocator | None = None,
        require_checkpoint: bool = False,
    ):
        if require_checkpoint and ssm_allocator is None:
            raise ValueError("a hybrid model's radix cache needs the SSM slot allocator")
        self.kv_allocator = kv_allocator
        self.ssm_allocator = ssm_allocator
        self.require_checkpoint = require_checkpoint
        self.page_size = kv_allocator.page_tokens
        self.root = RadixNode(key=[], kv_slots=[], parent=None, lock_ref=1)
        self._clock = itertools.count(1)
        self.num_cached_tokens = 0
        # Of those, the tokens of locked nodes (lock_ref > 0): kept as locks change, so that the evictable count
        # the scheduler reads every pass costs nothing, where a walk of the tree grew with everything cached.
        self.num_locked_tokens = 0
        self.num_checkpoints = 0
        # Checkpoints dropped so far (slot pressure or their KV evicted): /metrics shows the rate.
        self.num_checkpoints_evicted = 0
        # Eviction's queue, least recently used first: (last_access, order, node), pushed whenever a node may have
        # become an unlocked leaf or was touched as one; an entry whose node has since been touched, locked, given
        # a child or evicted is dropped when met. A full pool evicts every few decode steps, and a walk of the
        # whole tree each time grew with everything cached.
        self._lru: list[tuple[int, int, RadixNode]] = []
        self._lru_order = itertools.count()
        self._num_nodes = 0

    def _child_key(self, tokens: list[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size])

    def _common_len(self, edge: list[int], tokens: list[int], pos: int) -> int:
        """Matching leading tokens, rounded down to whole pages."""
        page = self.page_size
        pages = min(len(edge), len(tokens) - pos) // page
        # Slice comparisons run at C speed: the whole range first (a repeat or a continuation matches it all), then
        # a bisection over pages; a token-by-token loop cost ~17 ms a 32K-token prompt's lookups and inserts.
        if edge[: pages * page] == tokens[pos : pos + pages * page]:
            return pages * page
        matched, unmatched = 0, pages  # pages [0, matched) all match; [0, unmatched) do not
        while unmatched - matched > 1:
            mid = (matched + unmatched) // 2
            if edge[matched * page : mid * page] == tokens[pos + matched * page : pos + mid * page]:
                matched = mid
            else:
                unmatched = mid
        return matched * page

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge after `at` tokens; returns the new upper node (the checkpoint stays below)."""
        assert node.parent is not None and 0 < at < len(node.key) and at % self.page_size == 0
        upper = RadixNode(
            key=node.key[:at], kv_slots=node.kv_slots[:at], parent=node.parent,
            lock_ref=node.lock_ref, last_access=node.last_access,
        )
        node.parent.children[tuple(node.key[: self.page_size])] = upper
        node.key, node.kv_slots, node.parent = node.key[at:], node.kv_slots[at:], upper
        upper.children[tuple(node.key[: self.page_size])] = node
        self._num_nodes += 1
        return upper

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """Longest usable cached prefix of tokens (pass prompt[:-1] so one token is left to compute)."""
        now = next(self._clock)
        node, pos = self.root, 0
        best = PrefixMatch(0, [], self.root, None)
        slots: list[int] = []
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            common = self._common_len(child.key, tokens, pos)
            if common == 0:
                break
            if common < len(child.key):
                if self.require_checkpoint:
                    # The tokens match partway into this edge, where no state exists: count them, no split.
                    pos += common
                    break
                child = self._split(child, common)
            child.last_access = now
            self._offer(child)
            slots.extend(child.kv_slots)
            pos += common
            node = child
            if not self.require_checkpoint or node.ssm_slot is not None:
                best = PrefixMatch(pos, list(slots), node, node.ssm_slot)
        return PrefixMatch(best.num_tokens, best.kv_slots, best.node, best.ssm_slot, pos)

    def lock(self, node: RadixNode) -> None:
        """A running request uses this node's path: none of it may be evicted until unlock."""
        walk: RadixNode | None = node
        while walk is not None and walk is not self.root:
            if walk.lock_ref == 0:
                self.num_locked_tokens += len(walk.kv_slots)
            walk.lock_ref += 1
            walk = walk.parent

    def unlock(self, node: RadixNode) -> None:
        walk: RadixNode | None = node
        while walk is not None and walk is not self.root:
            if walk.lock_ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            walk.lock_ref -= 1
            if walk.lock_ref == 0:
                self.num_locked_tokens -= len(walk.kv_slots)
                self._offer(walk)
            walk = walk.parent

    def insert(self, tokens: list[int], kv_slots: list[int], ssm_slot: int | None = None) -> InsertResult:
        """Add tokens (whole pages) with their slots; ssm_slot, if given, checkpoints the state after them."""
        if len(tokens) != len(kv_slots):
            raise ValueError(f"insert of {len(tokens)} tokens with {len(kv_slots)} kv slots")
        if len(tokens) % self.page_size:
            raise ValueError(f"insert of {len(tokens)} tokens, not whole pages of {self.page_size}")
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                child = RadixNode(key=tokens[pos:], kv_slots=kv_slots[pos:], parent=node, last_access=now)
                node.children[self._child_key(tokens, pos)] = child
                self.num_cached_tokens += len(tokens) - pos
                self._num_nodes += 1
                self._offer(child)
                node, num_existing = child, pos
                break
            common = self._common_len(child.key, tokens, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            self._offer(child)
            pos += common
            node, num_existing = child, pos
        else:
            num_existing = pos
        adopted = False
        if ssm_slot is not None and node is not self.root and node.ssm_slot is None:
            node.ssm_slot = ssm_slot
            self.num_checkpoints += 1
            adopted = True
        return InsertResult(num_existing, adopted, node, self._path_slots(node))

    def _path_slots(self, node: RadixNode) -> list[int]:
        """KV slots of the whole prefix ending at node."""
        parts = []
        walk: RadixNode | None = node
        while walk is not None and walk is not self.root:
            parts.append(walk.kv_slots)
            walk = walk.parent
        slots: list[int] = []
        for part in reversed(parts):
            slots.extend(part)
        return slots

    def fork_checkpoint(self, match: PrefixMatch, copy: Callable[[int, int], None]) -> int | None:
        """Copy-on-write: a fresh SSM slot holding a copy of the hit's checkpoint (the request then owns and
        mutates it; the checkpoint stays intact). Evicts unused checkpoints if no slot is free; None if none."""
        if match.ssm_slot is None or self.ssm_allocator is None:
            raise ValueError("this match has no SSM checkpoint to fork")
        slot = self.ssm_allocator.alloc()
        if slot is None:
            # The hit's own node must survive the eviction that makes room.
            self.lock(match.node)
            self.evict_checkpoints(1)
            self.unlock(match.node)
            slot = self.ssm_allocator.alloc()
        if slot is not None:
            copy(match.ssm_slot, slot)
        return slot

    def _evictable_leaves(self) -> list[RadixNode]:
        leaves = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _drop_checkpoint(self, node: RadixNode) -> None:
        if node.ssm_slot is not None:
            assert self.ssm_allocator is not None
            self.ssm_allocator.free(node.ssm_slot)
            node.ssm_slot = None
            self.num_checkpoints -= 1
            self.num_checkpoints_evicted += 1

    def _offer(self, node: RadixNode) -> None:
        """Queue node for eviction at its current last_access if it is an unlocked leaf now."""
        if node is self.root or node.children or node.lock_ref:
            return
        heapq.heappush(self._lru, (node.last_access, next(self._lru_order), node))
        if len(self._lru) > 2 * self._num_nodes + 64:
            # Mostly entries that have moved on: start again from the tree's unlocked leaves.
            self._lru = [(leaf.last_access, next(self._lru_order), leaf) for leaf in self._evictable_leaves()]
            heapq.heapify(self._lru)

    def _pop_lru(self) -> RadixNode | None:
        """The unlocked leaf touched longest ago (None when every leaf is locked)."""
        while self._lru:
            access, _, node = heapq.heappop(self._lru)
            if access == node.last_access and not node.children and node.lock_ref == 0 and node.parent is not None \
                    and node.parent.children.get(tuple(node.key[: self.page_size])) is node:
                return node
        return None

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens KV slots, least recently used unlocked leaves first (their checkpoints too).
        Returns the number of slots freed (less if everything left is locked)."""
        freed = 0
        while freed < num_tokens:
            node = self._pop_lru()
            if node is None:
                break
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.key[: self.page_size])]
            self._num_nodes -= 1
            self.kv_allocator.free(node.kv_slots)
            self._drop_checkpoint(node)
            freed += len(node.kv_slots)
            self.num_cached_tokens -= len(node.kv_slots)
            self._offer(parent)
        return freed

    def evict_checkpoints(self, num_slots: int) -> int:
        """Free SSM checkpoints of unlocked nodes, keeping their KV: redundant states first, each path's only
        state last (checkpoint_policy.eviction_key). Returns how many were freed."""
        freed = 0
        while freed < num_slots:
            ranked = self._checkpoint_ranking()
            if not ranked:
                break
            self._drop_checkpoint(min(ranked, key=lambda pair: pair[0])[1])
            freed += 1
        return freed

    def _checkpoint_ranking(self) -> list[tuple[tuple[int, int, int], RadixNode]]:
        """(eviction key, node) of every unlocked checkpoint, from one walk of the tree."""
        ranked = []
        # (node, depth in tokens, depth of the nearest checkpointed ancestor or None)
        order: list[tuple[RadixNode, int, int | None]] = []
        stack: list[tuple[RadixNode, int, int | None]] = [(self.root, 0, None)]
        while stack:
            node, depth, above = stack.pop()
            order.append((node, depth, above))
            below_above = depth if node.ssm_slot is not None else above
            stack.extend((child, depth + len(child.key), below_above) for child in node.children.values())
        states_below: dict[int, int] = {}
        for node, depth, above in reversed(order):
            inside = sum(states_below[id(c)] + (c.ssm_slot is not None) for c in node.children.values())
            states_below[id(node)] = inside
            if node.ssm_slot is None or node.lock_ref:
                continue
            redundant = above is not None or inside > 0
            loss = depth - (above or 0)
            ranked.append((eviction_key(redundant, loss, node.last_access), node))
        return ranked

    def evictable_tokens(self) -> int:
        """KV slots held only by the cache (no running request's lock). O(1): a split keeps both halves' lock, an
        insert adds an unlocked node and eviction takes unlocked ones, so only lock and unlock move the count."""
        return self.num_cached_tokens - self.num_locked_tokens
