"""The smoke test's probes. Each adds its Checks and figures to a SmokeReport.

Session numbers keep probes apart: distinct sessions share no prompt prefix (see prompts.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from headroom.client.http import OpenAIClient
from headroom.client.prompts import PromptFactory
from headroom.client.result import RequestResult
from headroom.client.smoke_types import Check, SmokeReport, SmokeSettings, SmokeThresholds

LONG_SESSION, SHORT_SESSION, BOUNDARY_SESSION, RETENTION_FIRST_SESSION = 1, 2, 3, 100


def request_extra(settings: SmokeSettings) -> dict[str, Any]:
    # ignore_eos (vLLM/SGLang/headroom extension) keeps a random or tiny model from ending on token one.
    return {"ignore_eos": True} if settings.ignore_eos else {}


def describe_failure(result: RequestResult) -> str:
    if result.error:
        return result.error
    if not result.text:
        return f"empty reply ('' with finish_reason={result.finish_reason!r}, {result.generated_tokens} tokens)"
    return f"no finish_reason after {result.generated_tokens} tokens"


def prompt_count_mismatch(result: RequestResult) -> str | None:
    """The server counting other than what was sent means it truncated or templated the prompt."""
    if result.prompt_tokens is None or result.sent_prompt_tokens is None:
        return None
    if result.prompt_tokens == result.sent_prompt_tokens:
        return None
    return f"server counted {result.prompt_tokens} prompt tokens, {result.sent_prompt_tokens} were sent (truncation?)"


async def long_prefill_with_short_prompt(
    client: OpenAIClient, factory: PromptFactory, settings: SmokeSettings, thresholds: SmokeThresholds, report: SmokeReport
) -> None:
    """A long prefill near the limit, and a short prompt sent settings.short_delay_s after it starts."""
    extra = request_extra(settings)
    long_prompt = factory.make(settings.long_prompt_tokens, session=LONG_SESSION)
    short_prompt = factory.make(settings.short_prompt_tokens, session=SHORT_SESSION)
    long_task = asyncio.create_task(client.stream_completion(long_prompt, settings.long_max_tokens, label="long", extra=extra))
    await asyncio.sleep(settings.short_delay_s)
    short = await client.stream_completion(short_prompt, settings.short_max_tokens, label="short", extra=extra)
    long = await long_task

    long_ttft = long.ttft_s
    overlapped = long_ttft is None or short.sent_at < long.sent_at + long_ttft
    report.figures.update(
        long_prompt_tokens=len(long_prompt), long_status=long.status, long_ttft_s=long_ttft,
        long_e2e_s=long.e2e_s, long_completion_tokens=long.generated_tokens, long_finish_reason=long.finish_reason,
        prefill_tokens_per_s=len(long_prompt) / long_ttft if long_ttft else None,
        short_ttft_s=short.ttft_s, short_status=short.status, short_sent_during_long_prefill=overlapped,
    )
    mismatch = prompt_count_mismatch(long)
    if not long.ok or not long.text or not long.finish_reason or mismatch:
        report.checks["long_prefill"] = Check("fail", f"{len(long_prompt)}-token prompt: {mismatch or describe_failure(long)}")
    else:
        rate = report.figures["prefill_tokens_per_s"]
        report.checks["long_prefill"] = Check(
            "pass", f"{len(long_prompt)}-token prompt answered {long.generated_tokens} tokens, "
            f"finish_reason={long.finish_reason}, prefill {rate:.0f} tok/s"
        )
    report.checks["prefill_rate"] = _prefill_rate_check(report.figures["prefill_tokens_per_s"], thresholds)
    report.checks["short_ttft_during_long_prefill"] = _short_ttft_check(short, overlapped, thresholds)


def _prefill_rate_check(rate: float | None, thresholds: SmokeThresholds) -> Check:
    if rate is None:
        return Check("fail", "no first token from the long prefill, so no prefill rate")
    if thresholds.min_prefill_tokens_per_s is None:
        return Check("skip", f"prefill {rate:.0f} tok/s; no minimum set")
    verdict = "pass" if rate >= thresholds.min_prefill_tokens_per_s else "fail"
    return Check(verdict, f"prefill {rate:.0f} tok/s vs minimum {thresholds.min_prefill_tokens_per_s:.0f} tok/s")


def _short_ttft_check(short: RequestResult, overlapped: bool, thresholds: SmokeThresholds) -> Check:
    if not short.ok or short.ttft_s is None:
        return Check("fail", f"short prompt: {describe_failure(short)}")
    when = "during the long prefill" if overlapped else "after the long prefill had finished (raise its length or lower --short-delay-s)"
    verdict = "pass" if short.ttft_s <= thresholds.max_short_ttft_s else "fail"
    return Check(verdict, f"TTFT {short.ttft_s:.3f} s vs limit {thresholds.max_short_ttft_s:.3f} s, sent {when}")


async def server_alive(client: OpenAIClient, report: SmokeReport) -> None:
    """Field report 004: a server that starts can still die on its first long prefill."""
    response = await client.get("/health")
    if response is not None and response.status_code == 404:
        response = await client.get("/v1/models")
    status = None if response is None else response.status_code
    report.figures["health_status_after_long_prefill"] = status
    report.checks["alive_after_long_prefill"] = (
        Check("pass", f"health answered {status}") if status == 200
        else Check("fail", f"health answered {status if status is not None else 'nothing (connection failed)'} after the long prefill")
    )
