"""What the scheduler works with: its settings, a pass cost model, request bookkeeping and one pass's plan.

Pure Python (no torch) so that the scheduler tests and the scheduling benchmark run anywhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PassCostModel:
    """Seconds one forward pass takes: fixed overhead + prefill tokens / rate + per-decode cost.

    The defaults fit the seed report's measurements (27B on one 12 GB GPU: 4096-token chunks at
    1,276 tok/s and 409-token chunks at 1,006 tok/s give ~0.096 s per pass and ~1,315 tok/s marginal).
    """

    fixed_s: float = 0.096
    prefill_tokens_per_s: float = 1315.0
    decode_s: float = 0.004
    # Extra fixed seconds of a pass that carries any prefill (on the GPU decode-only passes replay CUDA
    # graphs and mixed passes run eagerly: 8.8 ms against ~47 ms on the H200 for the 4B-shaped model).
    prefill_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.decode_s < 0 or self.prefill_fixed_s < 0:
            raise ValueError(f"cost model fixed_s={self.fixed_s}, decode_s={self.decode_s} and"
                             f" prefill_fixed_s={self.prefill_fixed_s} must be >= 0")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"cost model prefill_tokens_per_s={self.prefill_tokens_per_s} must be > 0")

    def pass_seconds(self, num_prefill_tokens: int, num_decodes: int) -> float:
        prefill = self.prefill_fixed_s + num_prefill_tokens / self.prefill_tokens_per_s if num_prefill_tokens else 0.0
        return self.fixed_s + prefill + num_decodes * self.decode_s

    def prefill_tokens_within(self, seconds: float, num_decodes: int) -> int:
        """How many prefill tokens fit in a pass of `seconds` that also carries `num_decodes` decodes."""
        spare = seconds - self.fixed_s - self.prefill_fixed_s - num_decodes * self.decode_s
        return max(0, int(spare * self.prefill_tokens_per_s))


POLICIES = ("short_first", "fair")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy. Token counts are tokens; times are seconds.

    chunked_prefill_size: prefill tokens per pass (the chunk budget), shared by all prefilling requests.
    max_running_requests: requests admitted at once (prefilling + decoding).
    even_split: split the budget evenly over prefilling + admissible waiting requests.
    cap_contended_chunks: when more than one request prefills, cap each request's chunk at
        contended_chunk_cap (None: derived as budget / (2 x max_running_requests), as the seed did).
        A lone request gets the whole budget unless cap_lone_request (the seed's first version, -21%).
    skip_ahead_limit: how many capacity-rejected waiting requests admission scans past (0: strict FCFS,
        stop at the first request that does not fit).
    judge_whole_prompt: admission needs room for the whole prompt (the old behaviour) instead of the next chunk.
    max_times_overtaken: a waiting request overtaken this often becomes a barrier nobody may pass (aging).
    itl_target_s: with decodes running, keep decode gaps within this target under `cost_model`. Where a long
        pass can be interrupted (interject_short), it carries no decodes: they run as decode steps interjected
        between its layers whenever the target is due, and prefill keeps its full chunks. Elsewhere a pass's
        prefill tokens are bounded so the pass (= one decode gap) stays within the target. None: no target.
    max_pass_s: bound every pass carrying prefill to about this long under `cost_model`, decodes or not: a
        request that arrives during a pass waits for it (a pass cannot be interrupted), so this bounds a
        short question's wait behind a long prompt. None leaves passes unbounded (the chunk alone).
    min_prefill_tokens: prefill progress per pass that the ITL bound never goes below.
    decode_reserve_tokens: KV tokens kept free per running decode when admitting a new request.
    log_rejections: log every admission rejection with its reason and budgets (logger headroom.scheduler).
    policy: "short_first" (the default): short prefills (at most short_prefill_tokens left) take the budget
        first, whole, in arrival order; the rest goes to long prompts oldest first, so long prompts run back
        to back at full passes (FCFS TTFTs and throughput) and a short question never waits for them; a pass
        carrying a short prefill adds at most min_prefill_tokens of long prompts, so it stays short. "fair":
        the even split with the contended cap above (the seed's answer).
    short_prefill_tokens: what counts as short (None: chunked_prefill_size // 4).
    interject_short: short_first only: a short request that arrives while a pass carrying more than short_limit
        prefill tokens runs is prefilled between two of that pass's layers, in a pass of its own (whole, within
        short_limit tokens in all, nothing preempted), instead of waiting for the long pass to end; the long pass
        ends that much later (scheduler/interjection.py, loop/step.py).
    """

    chunked_prefill_size: int = 8192
    max_running_requests: int = 16
    even_split: bool = True
    cap_contended_chunks: bool = True
    contended_chunk_cap: int | None = None
    cap_lone_request: bool = False
    skip_ahead_limit: int = 16
    judge_whole_prompt: bool = False
    max_times_overtaken: int = 64
    itl_target_s: float | None = None
    max_pass_s: float | None = None
    min_prefill_tokens: int = 64
    decode_reserve_tokens: int = 16
    cost_model: PassCostModel = field(default_factory=PassCostModel)
    log_rejections: bool = False
    policy: str = "short_first"
    short_prefill_tokens: int | None = None
    interject_short: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler policy={self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.short_prefill_tokens is not None and self.short_prefill_tokens < 1:
            raise ValueError(f"scheduler short_prefill_tokens={self.short_prefill_tokens} must be >= 1")
        for name in ("chunked_prefill_size", "max_running_requests", "min_prefill_tokens", "max_times_overtaken"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler {name}={getattr(self, name)} must be >= 1")
        for name in ("skip_ahead_limit", "decode_reserve_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"scheduler {name}={getattr(self, name)} must be >= 0")
        if self.contended_chunk_cap is not None and self.contended_chunk_cap < 1:
            raise ValueError(f"scheduler contended_chunk_cap={self.contended_chunk_cap} must be >= 1")
        if self.itl_target_s is not None and self.itl_target_s <= 0:
            raise ValueError(f"scheduler itl_target_s={self.itl_target_s} must be > 0")
        if self.max_pass_s is not None and self.max_pass_s <= 0:
            raise ValueError(f"scheduler max_pass_s={self.max_pass_s} must be > 0")

    @property
    def short_limit(self) -> int:
        """Prefill tokens left at or below which a request counts as short (short_first policy)."""
        return self.short_prefill_tokens or max(1, self.chunked_prefill_size // 4)

    @property
    def per_request_cap(self) -> int:
        """The chunk cap under contention, explicit or derived from the concurrency limit."""
        if self.contended_chunk_cap is not None:
            return self.contended_chunk_cap
        return max(self.min_prefill_tokens, self.chunked_prefill_size // (2 * self.max_running_requests))

    @classmethod
    def strict_fcfs(cls, chunked_prefill_size: int, max_running_requests: int, chunk_per_request: int) -> SchedulerConfig:
        """The behaviour the seed started from: fixed chunks, whole-prompt admission, stop at the first misfit."""
        return cls(
            chunked_prefill_size=chunked_prefill_size,
            max_running_requests=max_running_requests,
            even_split=False,
            cap_contended_chunks=True,
            contended_chunk_cap=chunk_per_request,
            cap_lone_request=True,
            skip_ahead_limit=0,
            judge_whole_prompt=True,
            itl_target_s=None,
            policy="fair",
        )


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class SchedRequest:
    """The scheduler's view of one request. Positions [0, num_computed) are in the KV cache.

    num_tokens = prompt_len + num_generated; a pass computes positions from num_computed and, when it
    reaches num_tokens, samples the next token. After preemption num_computed returns to 0 (recompute).
    """

    request_id: str
    prompt_len: int
    max_new_tokens: int
    num_computed: int = 0
    num_generated: int = 0
    num_cached: int = 0
    phase: Phase = Phase.WAITING
    times_overtaken: int = 0
    num_preemptions: int = 0
    arrival_seq: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len={self.prompt_len} must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class PassItem:
    """Compute positions [start, start + num_tokens) of `request`; `samples` when that reaches its end."""

    request: SchedRequest
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class ScheduledPass:
    """One forward pass: running decodes plus prefill chunks, and what admission/preemption changed."""

    decodes: list[PassItem] = field(default_factory=list)
    prefills: list[PassItem] = field(default_factory=list)
    admitted: list[SchedRequest] = field(default_factory=list)
    preempted: list[SchedRequest] = field(default_factory=list)
    prefill_budget: int = 0
    # Running decodes left out of this (interruptible) pass: decode steps interjected between its layers take
    # them (scheduler/interjection.py).
    deferred_decodes: list[SchedRequest] = field(default_factory=list)

    @property
    def items(self) -> list[PassItem]:
        return self.decodes + self.prefills

    @property
    def scheduled_requests(self) -> list[SchedRequest]:
        return [item.request for item in self.items]

    def add_item(self, request: SchedRequest, num_tokens: int) -> None:
        """Compute `num_tokens` positions of `request` from its num_computed (decode or prefill by phase)."""
        item = PassItem(request, request.num_computed, num_tokens)
        (self.decodes if request.phase is Phase.DECODE else self.prefills).append(item)

    def grow_prefill(self, request: SchedRequest, extra_tokens: int) -> None:
        for index, item in enumerate(self.prefills):
            if item.request is request:
                self.prefills[index] = PassItem(request, item.start, item.num_tokens + extra_tokens)
                return
        raise KeyError(f"request {request.request_id} has no prefill item in this pass")

    def remove_item(self, request: SchedRequest) -> None:
        self.decodes = [item for item in self.decodes if item.request is not request]
        self.prefills = [item for item in self.prefills if item.request is not request]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_tokens for item in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills
