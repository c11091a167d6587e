"""Retention probe (field report 004): K sessions of L tokens, each visited twice; the second lap's
hit rate is sum(cached_tokens) / sum(reusable L), from usage.prompt_tokens_details.cached_tokens
(reusable L: L, or for hybrid engines L rounded down to their checkpoint interval).

Every prompt is sent as exactly L + question tokens below the limit, and the server's own count must
match, so silent truncation cannot make every session collapse to one shared prefix and fake hits.
K and L are what the plan promises (retention_target.py).
"""

from __future__ import annotations

from headroom.client.http import OpenAIClient
from headroom.client.probes import (
    RETENTION_FIRST_SESSION,
    describe_failure,
    prompt_count_mismatch,
    request_extra,
)
from headroom.client.prompts import PromptFactory
from headroom.client.result import RequestResult
from headroom.client.retention_target import retention_settings, server_plan
from headroom.client.smoke_types import Check, SmokeReport, SmokeSettings, SmokeThresholds


async def retention_probe(
    client: OpenAIClient, factory: PromptFactory, settings: SmokeSettings, thresholds: SmokeThresholds, report: SmokeReport
) -> None:
    if settings.retention_sessions is None:
        settings = retention_settings(settings, await server_plan(client))
    sessions = settings.retention_sessions
    if not sessions:
        report.checks["retention"] = Check("skip", "no sessions to revisit (probe disabled, or the plan retains none)")
        return
    context_tokens = settings.retention_context_tokens
    question = settings.retention_question_tokens
    sent_tokens = context_tokens + question
    # Internal invariant (SmokeSettings validated it): nothing sent can reach the limit.
    assert sent_tokens + settings.short_max_tokens < settings.context_length, (sent_tokens, settings.context_length)
    laps: list[list[RequestResult]] = []
    for visit in (1, 2):
        lap = []
        for index in range(sessions):
            prompt = factory.session_prompt(context_tokens, question, session=RETENTION_FIRST_SESSION + index, visit=visit)
            lap.append(
                await client.stream_completion(
                    prompt, settings.short_max_tokens, label=f"lap{visit}", extra=request_extra(settings)
                )
            )
        laps.append(lap)
    report.figures["retention"] = {
        "sessions": sessions, "session_tokens": context_tokens, "prompt_tokens_sent": sent_tokens,
        "cached_tokens": [[r.cached_tokens for r in lap] for lap in laps],
        "ttft_s": [[r.ttft_s for r in lap] for lap in laps],
    }
    report.figures["retention"]["reusable_session_tokens"] = settings.reusable_session_tokens
    check, hit_rate = judge_retention(laps, settings.reusable_session_tokens, thresholds)
    report.figures["retention"]["hit_rate"] = hit_rate
    report.checks["retention"] = check


def judge_retention(
    laps: list[list[RequestResult]], reusable_tokens: int, thresholds: SmokeThresholds
) -> tuple[Check, float | None]:
    """The verdict and the revisit lap's hit rate over reusable_tokens per session (None: not measured)."""
    every = [result for lap in laps for result in lap]
    broken = next((r for r in every if not r.ok or prompt_count_mismatch(r)), None)
    if broken is not None:
        return Check("fail", f"{broken.label}: {prompt_count_mismatch(broken) or describe_failure(broken)}"), None
    revisits = laps[-1]
    if any(r.cached_tokens is None for r in revisits):
        return Check("skip", "the server does not report usage.prompt_tokens_details.cached_tokens"), None
    if reusable_tokens == 0:
        return Check("skip", "sessions are shorter than one checkpoint interval: nothing is reusable"), None
    cached = sum(min(r.cached_tokens or 0, reusable_tokens) for r in revisits)
    hit_rate = cached / (reusable_tokens * len(revisits))
    verdict = "pass" if hit_rate >= thresholds.min_retention_hit_rate else "fail"
    return Check(
        verdict, f"{len(revisits)} sessions x {reusable_tokens} reusable tokens revisited: hit rate {hit_rate:.1%} "
        f"vs minimum {thresholds.min_retention_hit_rate:.0%}"
    ), hit_rate
