"""RequestResult: what one streamed request did, with the time of every token event (perf_counter seconds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """One request. status is the HTTP status (None if the server was never reached); error says why it failed."""

    label: str = ""
    sent_prompt_tokens: int | None = None
    max_tokens: int = 0
    status: int | None = None
    sent_at: float = 0.0
    done_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    def absorb(self, event: dict[str, Any], now: float) -> None:
        """Fold one streamed JSON event (completion or chat chunk) into the record."""
        if "error" in event and not event.get("choices"):
            detail = event["error"]
            self.error = f"error event in stream: {detail.get('message', detail) if isinstance(detail, dict) else detail}"
        carried_token = False
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
            # A completion chunk without a finish_reason is a generated token even when its text is ''
            # (a detokenizer holding back an incomplete UTF-8 byte); chat role-only chunks are not.
            holds_back = "text" in choice and choice.get("finish_reason") is None
            if piece or choice.get("token_ids") or holds_back:
                carried_token = True
                self.text += piece
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if carried_token:
            self.token_times.append(now)
        if isinstance(event.get("usage"), dict):
            self._absorb_usage(event["usage"])

    def _absorb_usage(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        self.completion_tokens = _int_or_none(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details") or {}
        # vLLM and headroom report prompt_tokens_details.cached_tokens; SGLang also a top-level cached_tokens.
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self.cached_tokens = _int_or_none(cached if cached is not None else usage.get("cached_tokens"))

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and 200 <= self.status < 300

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def e2e_s(self) -> float:
        return self.done_at - self.sent_at

    @property
    def generated_tokens(self) -> int:
        """Tokens generated: usage.completion_tokens where reported, else the count of token events."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    def to_dict(self, origin: float) -> dict[str, Any]:
        """JSON-ready figures; times in seconds relative to origin (the run's start)."""
        return {
            "label": self.label,
            "status": self.status,
            "error": self.error,
            "sent_prompt_tokens": self.sent_prompt_tokens,
            "max_tokens": self.max_tokens,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "text_chars": len(self.text),
            "sent_at_s": round(self.sent_at - origin, 6),
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "itl_s": self.itl_s,
        }


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
