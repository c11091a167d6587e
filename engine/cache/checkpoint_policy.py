"""Where a hybrid model's prefill stops to checkpoint its SSM state, and which checkpoint goes first. Pure Python.

A recurrent state exists only where one was saved, so these positions decide the hit rate. Per request
(all page-aligned, all beyond the prefix it already hit):
- the exact-repeat state: one page short of the prompt's end, the deepest point a repeat of the same
  prompt can hit (its lookup leaves one token to compute);
- the tail states: the last TAIL_GRANULE-aligned positions before the end, so a revisit of the same document
  with another short question hits just below where the questions differ (field report 004's chains);
- the divergence point: where the prompt leaves the cached tree's tokens although no state is there
  (SGLang's branching point), so the next visit with yet another continuation hits there;
- at most MAX_INTERVAL_CHECKPOINTS chunk checkpoints, the deepest multiples of the checkpoint interval
  (the plan's chunk), for prompts that share a long prefix and diverge far before the end.
The final state of a request (after its last computed token) is kept by CacheManager.finish, free.

Eviction (checkpoint_loss): a state whose path has another state is redundant and goes before any path's
only state; among redundant ones, the one whose loss costs the fewest recomputed tokens goes first.
"""

from __future__ import annotations

import math

# The planner prices what this policy keeps: CHECKPOINTS_PER_SESSION states per retained session (the two
# deepest tail states and one more, once redundant ones are trimmed) and CHECKPOINT_STOPS_PER_REQUEST stops.
from headroom.engine.plan.engines.builtin import CHECKPOINT_GRANULE, CHECKPOINT_STOPS_PER_REQUEST

# Tail checkpoints sit on multiples of this many tokens (fla's Gated DeltaNet block, SGLang's alignment).
TAIL_GRANULE = CHECKPOINT_GRANULE
# Offsets from the prompt's end of the tail checkpoints: a question shorter than one granule hits the first,
# one shorter than two granules the second.
TAIL_OFFSETS = (0, TAIL_GRANULE)
MAX_INTERVAL_CHECKPOINTS = 2
# The most stops one request takes: exact-repeat, tail, divergence and chunk checkpoints.
MAX_STOPS_PER_REQUEST = 1 + len(TAIL_OFFSETS) + 1 + MAX_INTERVAL_CHECKPOINTS
assert MAX_STOPS_PER_REQUEST <= CHECKPOINT_STOPS_PER_REQUEST


def align_down(position: int, granule: int) -> int:
    return position - position % granule


def checkpoint_stops(
    prompt_len: int, hit_tokens: int, divergence_tokens: int, page: int, interval: int
) -> list[int]:
    """Sorted positions in (hit_tokens, prompt_len) where the prefill must stop and checkpoint.

    prompt_len, hit_tokens (usable cached prefix), divergence_tokens (tokens the tree matched, state or
    not), page (KV page) and interval (chunk checkpoint spacing) are in tokens.
    """
    granule = math.lcm(TAIL_GRANULE, page)
    last = prompt_len - 1
    stops = {align_down(last, page)}
    stops.update(align_down(last - offset, granule) for offset in TAIL_OFFSETS)
    if divergence_tokens > hit_tokens:
        stops.add(align_down(divergence_tokens, page))
    step = math.lcm(max(interval, 1), page)
    deepest = align_down(last, step)
    stops.update(deepest - k * step for k in range(MAX_INTERVAL_CHECKPOINTS))
    # Prompts shorter than a granule gain nothing worth a checkpoint slot of their own.
    return sorted(s for s in stops if hit_tokens < s < prompt_len and s >= TAIL_GRANULE)


def eviction_key(has_other_state: bool, loss_tokens: int, last_access: int) -> tuple[int, int, int]:
    """Sort key, smallest evicted first: redundant states (their path has another state) before a path's
    only one; then the fewest tokens a revisit would recompute without it; then least recently used."""
    return (0 if has_other_state else 1, loss_tokens if has_other_state else 0, last_access)
