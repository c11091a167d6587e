"""One request as the engine sees it: tokens, progress, the KV slots and SSM slot it holds. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1]; seed makes sampling reproducible per request."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Sequence:
    """A request's state. kv_slots[i] is the pool slot of token i (it may run ahead of the computed tokens
    by up to one page); cached_tokens is the prefix-cache hit length; prefix_node is the radix node the
    request has locked (opaque to everything but the radix cache)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv_slots: list[int] = field(default_factory=list)
    ssm_slot: int | None = None
    cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    prefix_node: Any = None
    # Leading kv_slots owned by the radix cache (shared); the rest are this request's own.
    num_shared_slots: int = 0
    # Hybrid models: prompt positions where the prefill stops to checkpoint its SSM state (CacheManager).
    checkpoint_stops: list[int] = field(default_factory=list)
    # False: the prefill takes no checkpoint stops (the warm-up's timed passes, which price a chunk alone).
    take_checkpoints: bool = True

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without concatenating the whole sequence (a decode step asks every pass)."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
