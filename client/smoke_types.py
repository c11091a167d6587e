"""What the smoke test is asked (SmokeSettings, SmokeThresholds) and what it answers (SmokeReport of Checks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    """One verdict; reason always says why, with the numbers."""

    status: Status
    reason: str

    @property
    def passed(self) -> bool:
        return self.status != "fail"


@dataclass(frozen=True)
class SmokeThresholds:
    """Pass/fail limits. None disables a limit (the figure is still reported)."""

    max_short_ttft_s: float = 2.0
    min_prefill_tokens_per_s: float | None = None
    min_retention_hit_rate: float = 0.9
    cliff_util_percent: float = 95.0
    cliff_power_ratio: float = 0.4
    allow_clamped_output: bool = False


@dataclass(frozen=True)
class SmokeSettings:
    """Sizes of the probes, in tokens; delays in seconds.

    context_length and max_new_tokens are the server's limits (the plan's). The long prefill sends
    context_length - max_new_tokens - margin_tokens tokens; the retention probe sends retention_sessions
    sessions of retention_tokens each (None: a quarter of the context, bounded by what fits).
    retention_sessions None: what the plan promises (client/retention_target.py).
    """

    context_length: int
    max_new_tokens: int
    margin_tokens: int = 16
    long_max_tokens: int = 8
    short_prompt_tokens: int = 32
    short_max_tokens: int = 4
    short_delay_s: float = 0.5
    retention_sessions: int | None = None
    retention_tokens: int | None = None
    retention_question_tokens: int = 16
    # Hybrid engines reuse a prefix only up to their last SSM checkpoint inside it (every chunk, i.e.
    # the plan's chunked_prefill_size); the hit rate is judged against what such checkpoints can reach.
    checkpoint_interval_tokens: int | None = None
    metrics_interval_s: float = 1.0
    ignore_eos: bool = True
    # Saturation probe: this many requests at once (the plan's max_running_requests; 0 disables), each of
    # saturation_prompt_tokens prompt tokens + max_new_tokens (see saturation_prompt_len for the default).
    saturation_requests: int = 0
    saturation_prompt_tokens: int | None = None
    pool_tokens: int | None = None
    saturation_deadline_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        long_tokens = self.context_length - self.max_new_tokens - self.margin_tokens
        if long_tokens < self.short_prompt_tokens:
            raise ValueError(
                f"context_length {self.context_length} - max_new_tokens {self.max_new_tokens} - margin "
                f"{self.margin_tokens} = {long_tokens} tokens leaves no room for a long prefill"
            )
        if self.checkpoint_interval_tokens is not None and self.checkpoint_interval_tokens < 1:
            raise ValueError(f"checkpoint_interval_tokens must be >= 1, got {self.checkpoint_interval_tokens}")
        if self.saturation_requests < 0 or self.saturation_deadline_s <= 0:
            raise ValueError(f"saturation_requests={self.saturation_requests} must be >= 0 and "
                             f"saturation_deadline_s={self.saturation_deadline_s} > 0")
        if self.saturation_requests and not 1 <= self.saturation_prompt_len <= self.long_prompt_tokens:
            raise ValueError(f"saturation prompt of {self.saturation_prompt_len} tokens must be 1..{self.long_prompt_tokens}"
                             f" (context_length - max_new_tokens - margin)")
        if self.retention_sessions is not None and self.retention_sessions < 0:
            raise ValueError(f"retention_sessions must be >= 0, got {self.retention_sessions}")
        if self.retention_sessions:
            # Validates the retention sizes at construction, naming the numbers.
            self.retention_context_tokens  # noqa: B018

    @property
    def saturation_prompt_len(self) -> int:
        """Prompt tokens of one saturation request: enough that the requests need twice the pool, and at least
        two chunks (a preempted request resumes from its chunk checkpoints: the path that livelocked), within
        the context."""
        if self.saturation_prompt_tokens is not None:
            return self.saturation_prompt_tokens
        wanted = 2 * (self.checkpoint_interval_tokens or 1)
        if self.pool_tokens is not None and self.saturation_requests:
            wanted = max(wanted, 2 * self.pool_tokens // self.saturation_requests - self.max_new_tokens)
        return min(wanted, self.long_prompt_tokens)

    @property
    def long_prompt_tokens(self) -> int:
        return self.context_length - self.max_new_tokens - self.margin_tokens

    @property
    def reusable_session_tokens(self) -> int:
        """Tokens of a session a revisit can reuse: all of it, or up to the last checkpoint inside it."""
        tokens = self.retention_context_tokens
        interval = self.checkpoint_interval_tokens
        return tokens if interval is None else tokens // interval * interval

    @property
    def retention_room(self) -> int:
        """The longest session whose revisit still fits below the limit with its question and output."""
        return self.context_length - self.margin_tokens - self.retention_question_tokens - self.short_max_tokens

    @property
    def retention_context_tokens(self) -> int:
        """Tokens per retained session; every revisit still fits below the limit with its output."""
        room = self.retention_room
        wanted = self.retention_tokens if self.retention_tokens is not None else self.context_length // 4
        if wanted > room:
            raise ValueError(
                f"retention_tokens {wanted} + question {self.retention_question_tokens} + output "
                f"{self.short_max_tokens} + margin {self.margin_tokens} exceeds context_length {self.context_length}"
            )
        return wanted


@dataclass
class SmokeReport:
    """passed is True when no check failed. figures holds every measured number."""

    url: str
    settings: dict[str, Any]
    thresholds: dict[str, Any]
    checks: dict[str, Check] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks.values())

    @property
    def failures(self) -> dict[str, str]:
        return {name: check.reason for name, check in self.checks.items() if not check.passed}

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "url": self.url,
            "checks": {name: asdict(check) for name, check in self.checks.items()},
            "figures": self.figures,
            "settings": self.settings,
            "thresholds": self.thresholds,
        }
