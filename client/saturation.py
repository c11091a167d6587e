"""Saturation probe (issue 15): max_running_requests requests at once, at the plan's sizes, all finish.

A plan whose checks all say ok promised the engine could run this load: N = max_running_requests
requests of the plan's max_new_tokens each, their prompts long enough that together they need twice the
pool (SmokeSettings.saturation_prompt_len), so the pool runs out mid-decode and the engine must preempt
and resume. Every request must finish with
all its tokens within the deadline, and a 2-token request sent afterwards must answer. Before the fix
the engine livelocked under such a load: 0 tokens a pass, preemptions climbing, /health still 200.
"""

from __future__ import annotations

import asyncio
import time

from headroom.client.http import OpenAIClient
from headroom.client.probes import describe_failure, request_extra
from headroom.client.prompts import PromptFactory
from headroom.client.result import RequestResult
from headroom.client.smoke_types import Check, SmokeReport, SmokeSettings

SATURATION_FIRST_SESSION = 1000


async def saturation_probe(client: OpenAIClient, factory: PromptFactory, settings: SmokeSettings,
                           report: SmokeReport) -> None:
    count = settings.saturation_requests
    if count == 0:
        report.checks["saturation"] = Check("skip", "saturation probe disabled (0 requests; --plan sets it)")
        return
    prompt_tokens, max_tokens = settings.saturation_prompt_len, settings.max_new_tokens
    extra = request_extra(settings)
    started = time.perf_counter()
    tasks = [asyncio.create_task(client.stream_completion(
        factory.make(prompt_tokens, session=SATURATION_FIRST_SESSION + index), max_tokens,
        label=f"saturation{index}", extra=extra)) for index in range(count)]
    done, pending = await asyncio.wait(tasks, timeout=settings.saturation_deadline_s)
    for task in pending:
        task.cancel()
    results: list[RequestResult] = [task.result() for task in done]
    complete = [r for r in results if r.ok and r.generated_tokens == max_tokens and r.finish_reason]
    elapsed = time.perf_counter() - started
    try:
        after = await asyncio.wait_for(client.stream_completion(
            factory.make(8, session=SATURATION_FIRST_SESSION - 1), 2, label="after-saturation", extra=extra),
            timeout=settings.saturation_deadline_s)
    except asyncio.TimeoutError:
        after = RequestResult(label="after-saturation", error=f"no answer within {settings.saturation_deadline_s:.0f} s")
    report.figures["saturation"] = {
        "requests": count, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "complete": len(complete),
        "seconds": round(elapsed, 3), "deadline_s": settings.saturation_deadline_s,
        "tokens_per_s": round(sum(r.generated_tokens for r in results) / elapsed, 1),
        "after_ttft_s": after.ttft_s,
    }
    sizes = f"{count} x ({prompt_tokens} prompt + {max_tokens} new tokens)"
    if len(complete) < count:
        failed = [r for r in results if r not in complete]
        why = f"; first failure: {describe_failure(failed[0])}" if failed else ""
        report.checks["saturation"] = Check("fail", (
            f"{sizes}: {len(complete)} of {count} finished within {settings.saturation_deadline_s:.0f} s"
            f" ({len(pending)} still running){why}"))
    elif not after.ok or after.ttft_s is None:
        report.checks["saturation"] = Check("fail", f"{sizes} finished, then a 2-token request: {describe_failure(after)}")
    else:
        report.checks["saturation"] = Check("pass", f"{sizes}: all finished in {elapsed:.1f} s"
                                                    f" (deadline {settings.saturation_deadline_s:.0f} s)")
