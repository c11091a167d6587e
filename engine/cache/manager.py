"""CacheManager: a request's KV slots, SSM slot and prefix-cache share over its life. Pure Python.

admit: take the longest usable cached prefix (lock it, fork its SSM checkpoint copy-on-write) or a fresh
SSM slot; for a hybrid model, choose where its prefill stops to checkpoint (checkpoint_policy).
take_captures: the stops inside a prefill chunk, each with an SSM slot the pass fills (the chunk runs
through them in one pass; publish_captures publishes them after it, drop_captures frees them if it failed).
reserve: KV slots for the next tokens, evicting unlocked cache entries when short.
checkpoint: after a pass, publish the prefix (and, at a stop, a copy of the SSM state) to the cache, never
taking the SSM slots kept for requests that may still be admitted (working_slots).
finish: publish the whole computed sequence (its own SSM slot becomes the final checkpoint when it
lands on a page boundary), unlock, and free everything the cache did not adopt.
"""

from __future__ import annotations

from collections.abc import Callable

from headroom.engine.cache.checkpoint_policy import checkpoint_stops
from headroom.engine.cache.kv_slots import KVAllocator
from headroom.engine.cache.radix import PrefixMatch, RadixCache
from headroom.engine.cache.ssm_slots import SSMSlotAllocator
from headroom.engine.cache.stats import PrefixStats
from headroom.engine.sequence import Sequence


class CacheManager:
    def __init__(
        self,
        kv_allocator: KVAllocator,
        ssm_allocator: SSMSlotAllocator | None,
        copy_ssm: Callable[[int, int], None],
        enable_prefix_cache: bool = True,
        working_slots: int = 0,
        checkpoint_interval: int = 8192,
    ):
        """working_slots: SSM slots kept for running requests' own states (max_running_requests). A running
        request's checkpoints sit on its locked path and cannot be evicted until it finishes; without this
        reserve, a few long prefills checkpointing every chunk took every slot, and a short request that
        arrived meanwhile waited for them to finish (4.5 s behind four 16K prompts on the H200).
        checkpoint_interval: spacing of the chunk checkpoints in tokens (the plan's chunk)."""
        self.kv_allocator = kv_allocator
        self.ssm_allocator = ssm_allocator
        self.copy_ssm = copy_ssm
        self.working_slots = working_slots
        self.checkpoint_interval = checkpoint_interval
        self.stats = PrefixStats()
        # Requests holding a working SSM slot (admitted, not finished).
        self.num_working = 0
        self.page = kv_allocator.page_tokens
        self.radix = (
            RadixCache(kv_allocator, ssm_allocator, require_checkpoint=ssm_allocator is not None)
            if enable_prefix_cache else None
        )

    def admit(self, seq: Sequence) -> bool:
        """Attach a prefix hit and an SSM slot; False (nothing held) when no SSM slot can be had."""
        match = None
        if self.radix is not None:
            # Leave one token to compute: the next output needs its logits. A preempted request matches its
            # generated tokens too, so it resumes from the state it published instead of recomputing.
            match = self.radix.match_prefix(seq.token_ids[:-1])
            if match.num_tokens:
                self.radix.lock(match.node)
                slot = self.radix.fork_checkpoint(match, self.copy_ssm) if match.ssm_slot is not None else None
                if self.ssm_allocator is not None and slot is None:
                    self.radix.unlock(match.node)
                else:
                    seq.prefix_node = match.node
                    seq.kv_slots = list(match.kv_slots)
                    seq.num_shared_slots = seq.cached_tokens = seq.num_computed_tokens = match.num_tokens
                    seq.ssm_slot = slot
                    self.num_working += slot is not None
                    self._admitted(seq, match)
                    return True
        if self.ssm_allocator is not None:
            slot = self.ssm_allocator.alloc()
            if slot is None and self.radix is not None:
                self.radix.evict_checkpoints(1)
                slot = self.ssm_allocator.alloc()
            if slot is None:
                return False
            seq.ssm_slot = slot
            self.num_working += 1
        self._admitted(seq, match)
        return True

    def _admitted(self, seq: Sequence, match: PrefixMatch | None) -> None:
        """Count the lookup and, for a hybrid model, choose the prefill's checkpoint stops."""
        seq.checkpoint_stops = []
        if match is None or seq.output_token_ids:
            # A request resuming after preemption is past its prompt: no client lookup, no prefill stops.
            return
        hit = seq.num_computed_tokens
        self.stats.looked_up_tokens += seq.num_prompt_tokens - 1
        self.stats.matched_tokens += match.num_matched_tokens
        self.stats.hit_tokens += hit
        self.stats.matched_no_state_tokens += max(0, match.num_matched_tokens - hit)
        if self.ssm_allocator is not None and seq.take_checkpoints:
            seq.checkpoint_stops = checkpoint_stops(
                seq.num_prompt_tokens, hit, match.num_matched_tokens, self.page, self.checkpoint_interval
            )

    def take_captures(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """(position, SSM slot) for each of seq's checkpoint stops strictly inside the chunk [start, end),
        ascending, each slot fresh for the pass to write the state at that position into. A stop that finds
        no slot is skipped, as checkpoint() skips it."""
        if self.ssm_allocator is None or self.radix is None:
            return []
        captures = []
        for stop in seq.checkpoint_stops:
            if start < stop < end and stop > seq.num_shared_slots:
                slot = self._checkpoint_slot()
                if slot is None:
                    break
                captures.append((stop, slot))
        return captures

    def publish_captures(self, seq: Sequence, captures: list[tuple[int, int]]) -> None:
        """After the pass that filled them: publish seq's prefix up to each capture with its SSM state."""
        assert self.ssm_allocator is not None or not captures
        for stop, slot in captures:
            if stop > seq.num_shared_slots and self._publish(seq, stop, slot):
                self.stats.checkpoints_taken += 1
            else:
                self.ssm_allocator.free(slot)  # type: ignore[union-attr]

    def drop_captures(self, captures: list[tuple[int, int]]) -> None:
        """A failed pass's captures hold no usable state: free their slots."""
        for _, slot in captures:
            self.ssm_allocator.free(slot)  # type: ignore[union-attr]

    def reserve(self, seq: Sequence, new_len: int) -> bool:
        """Make seq hold kv slots for positions < new_len; False (nothing taken) if they cannot be had."""
        needed = self.kv_allocator.slots_needed(len(seq.kv_slots), new_len)
        if needed == 0:
            return True
        if not self.kv_allocator.can_alloc(needed) and self.radix is not None:
            self.radix.evict(needed - self.kv_allocator.num_free_tokens)
        slots = self.kv_allocator.alloc(needed)
        if slots is None:
            return False
        seq.kv_slots.extend(slots)
        return True

    def _publish(self, seq: Sequence, length: int, ssm_slot: int | None) -> bool:
        """Insert seq's first `length` tokens; seq then shares them. Returns whether ssm_slot was adopted."""
        assert self.radix is not None and length % self.page == 0
        result = self.radix.insert(seq.token_ids[:length], seq.kv_slots[:length], ssm_slot)
        # Slots this request computed for tokens the tree already had are duplicates.
        duplicates = seq.kv_slots[seq.num_shared_slots : result.num_existing]
        if duplicates:
            self.kv_allocator.free(duplicates)
        seq.kv_slots[:length] = result.kv_slots
        self.radix.lock(result.node)
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.prefix_node = result.node
        seq.num_shared_slots = length
        return result.ssm_adopted

    def checkpoint(self, seq: Sequence) -> None:
        """After a pass: publish seq's computed prefix (page-aligned). A hybrid model publishes only at its
        checkpoint stops, with a copy of the SSM state (a prefix without one is unusable)."""
        length = seq.num_computed_tokens
        if self.radix is None or length % self.page or length <= seq.num_shared_slots:
            return
        ckpt = None
        if self.ssm_allocator is not None:
            assert seq.ssm_slot is not None
            if length not in seq.checkpoint_stops:
                return
            ckpt = self._checkpoint_slot()
            if ckpt is None:
                # Without a checkpoint a hybrid prefix is unusable; keep the slots private.
                return
            self.copy_ssm(seq.ssm_slot, ckpt)
        if self._publish(seq, length, ckpt):
            self.stats.checkpoints_taken += 1
        elif ckpt is not None:
            self.ssm_allocator.free(ckpt)  # type: ignore[union-attr]

    def _checkpoint_slot(self) -> int | None:
        """A free SSM slot beyond the working reserve; older unlocked checkpoints make room (LRU)."""
        assert self.ssm_allocator is not None and self.radix is not None
        keep = max(0, self.working_slots - self.num_working)
        short = keep + 1 - self.ssm_allocator.num_free
        if short > 0:
            self.radix.evict_checkpoints(short)
        if self.ssm_allocator.num_free <= keep:
            return None
        return self.ssm_allocator.alloc()

    def finish(self, seq: Sequence, publish: bool = True) -> None:
        """Release seq: publish what it computed (whole pages), unlock, free the rest.

        publish=False frees without publishing: after a failed pass the SSM slot may hold a half-updated state.
        """
        length = seq.num_computed_tokens - seq.num_computed_tokens % self.page
        slot_adopted = False
        if publish and self.radix is not None and length > seq.num_shared_slots:
            final = seq.ssm_slot if length == seq.num_computed_tokens else None
            slot_adopted = self._publish(seq, length, final)
            self.stats.checkpoints_taken += slot_adopted
        own = seq.kv_slots[seq.num_shared_slots :]
        if own:
            self.kv_allocator.free(own)
        if self.radix is not None and seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        if seq.ssm_slot is not None:
            self.num_working -= 1
            if not slot_adopted:
                assert self.ssm_allocator is not None
                self.ssm_allocator.free(seq.ssm_slot)
        seq.kv_slots, seq.ssm_slot, seq.prefix_node, seq.num_shared_slots = [], None, None, 0
        seq.checkpoint_stops = []
