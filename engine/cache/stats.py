"""PrefixStats: what the prefix cache did, cumulative since start (tokens and checkpoint counts). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixStats:
    """Counted once per admitted request (a request admitted again after preemption counts again).

    looked_up_tokens: prompt tokens looked up (the prompt less the one token always computed);
    matched_tokens: of those, tokens the tree held (whole pages); hit_tokens: tokens served from the cache;
    matched_no_state_tokens: matched but not served because no SSM checkpoint covered them (hybrid models:
    the silent miss); checkpoints_taken: SSM states copied into the cache during prefills, plus final states
    the cache adopted.
    """

    looked_up_tokens: int = 0
    matched_tokens: int = 0
    hit_tokens: int = 0
    matched_no_state_tokens: int = 0
    checkpoints_taken: int = 0
