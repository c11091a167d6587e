"""Boundary probes: a prompt that cannot fit must be refused with 4xx, never answered with ''.

Field report 004: at a 131,072 limit a 131,066-token prompt came back as '' with finish_reason=stop,
because truncation ignored max_tokens. Two probes: a prompt longer than the context, and a prompt that
fits alone but leaves no room for max_tokens.
"""

from __future__ import annotations

from headroom.client.http import OpenAIClient
from headroom.client.probes import BOUNDARY_SESSION, request_extra
from headroom.client.prompts import PromptFactory
from headroom.client.result import RequestResult
from headroom.client.smoke_types import Check, SmokeReport, SmokeSettings, SmokeThresholds

# The no-room probe leaves this many tokens for an output of max_new_tokens (>= 1 is needed to refuse).
NO_ROOM_SLACK = 2


async def boundary_probes(
    client: OpenAIClient, factory: PromptFactory, settings: SmokeSettings, thresholds: SmokeThresholds, report: SmokeReport
) -> None:
    extra = request_extra(settings)
    limit = settings.context_length
    over_prompt = factory.make(limit + 1, session=BOUNDARY_SESSION)
    over = await client.stream_completion(over_prompt, settings.short_max_tokens, label="boundary_over", extra=extra)
    report.figures["boundary_over_context"] = _figures(over)
    report.checks["boundary_prompt_over_context"] = judge(over, f"{limit + 1} tokens > context {limit}", allow_clamp=False)

    no_room_tokens = limit - NO_ROOM_SLACK
    max_tokens = max(settings.max_new_tokens, NO_ROOM_SLACK + 1)
    no_room_prompt = factory.make(no_room_tokens, session=BOUNDARY_SESSION, part="no-room")
    no_room = await client.stream_completion(no_room_prompt, max_tokens, label="boundary_no_room", extra=extra)
    report.figures["boundary_no_room_for_output"] = _figures(no_room)
    what = f"{no_room_tokens} tokens + max_tokens {max_tokens} > context {limit}"
    report.checks["boundary_no_room_for_output"] = judge(no_room, what, allow_clamp=thresholds.allow_clamped_output)


def judge(result: RequestResult, what: str, *, allow_clamp: bool) -> Check:
    """4xx passes; '' fails (the silent-truncation trap); 5xx or a dropped connection fails.

    allow_clamp: pass a non-empty answer (an engine that shortens max_tokens instead of refusing).
    """
    if result.status is None:
        return Check("fail", f"{what}: no HTTP answer ({result.error})")
    if 400 <= result.status < 500:
        return Check("pass", f"{what}: refused with HTTP {result.status}")
    if result.status >= 500:
        return Check("fail", f"{what}: server error HTTP {result.status} instead of 4xx ({result.error})")
    if not result.text:
        return Check(
            "fail", f"{what}: accepted (HTTP {result.status}) and answered '' with finish_reason="
            f"{result.finish_reason!r} instead of 4xx: silent truncation"
        )
    if allow_clamp:
        return Check("pass", f"{what}: accepted and answered {result.generated_tokens} tokens (clamping allowed)")
    return Check(
        "fail", f"{what}: accepted (HTTP {result.status}) instead of 4xx; server counted "
        f"{result.prompt_tokens} prompt tokens and answered {result.generated_tokens}"
    )


def _figures(result: RequestResult) -> dict[str, object]:
    return {
        "status": result.status, "sent_prompt_tokens": result.sent_prompt_tokens, "prompt_tokens": result.prompt_tokens,
        "text_chars": len(result.text), "finish_reason": result.finish_reason, "error": (result.error or "")[:300],
    }
