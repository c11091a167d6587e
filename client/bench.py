"""Run workloads against a server and aggregate their streaming figures.

Aggregate tokens/s is generated tokens over the wall time of the phases (the field report's agg tok/s);
the cached-token ratio is sum(cached_tokens) / sum(prompt_tokens) over requests reporting usage.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from headroom.client.http import OpenAIClient
from headroom.client.progress import Progress
from headroom.client.prompts import PromptFactory
from headroom.client.result import RequestResult
from headroom.client.stats import ratio, summarize_ms
from headroom.client.workloads import RequestSpec, Workload


@dataclass
class WorkloadRun:
    workload: Workload
    results: list[tuple[int, RequestSpec, RequestResult]] = field(default_factory=list)
    wall_s: float = 0.0
    origin: float = field(default_factory=time.perf_counter)


def build_prompt(factory: PromptFactory, workload: Workload, spec: RequestSpec, repeat: int) -> list[int]:
    # Sessions are namespaced by workload and repeat, so no run reuses another's prefix by accident.
    session = f"{workload.name}/{repeat}/{spec.session}"
    if spec.shared_prefix_tokens:
        question = spec.prompt_tokens - spec.shared_prefix_tokens
        return factory.session_prompt(spec.shared_prefix_tokens, question, session=session, visit=spec.part)
    return factory.make(spec.prompt_tokens, session=session, part=spec.part)


async def run_workload(
    client: OpenAIClient, factory: PromptFactory, workload: Workload, *, repeat: int = 1,
    extra: dict[str, Any] | None = None, show_progress: bool = True,
) -> WorkloadRun:
    """Every phase of workload, repeat times; requests of a phase run concurrently."""
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    run = WorkloadRun(workload)
    progress = Progress(len(workload.requests) * repeat, workload.name, enabled=show_progress)

    async def send(spec: RequestSpec, prompt: list[int]) -> RequestResult:
        await asyncio.sleep(spec.delay_s)
        result = await client.stream_completion(prompt, spec.max_tokens, label=spec.label, extra=extra)
        progress.advance(result.ok)
        return result

    for index in range(repeat):
        for phase in workload.phases:
            prompts = [build_prompt(factory, workload, spec, index) for spec in phase]
            started = time.perf_counter()
            results = await asyncio.gather(*(send(spec, prompt) for spec, prompt in zip(phase, prompts, strict=True)))
            run.wall_s += time.perf_counter() - started
            run.results += [(index, spec, result) for spec, result in zip(phase, results, strict=True)]
    return run


def summarize(results: list[RequestResult], wall_s: float | None) -> dict[str, Any]:
    """Figures of a set of requests; wall_s (the time they ran in) gives the aggregate rate."""
    ok = [r for r in results if r.ok]
    reporting = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    generated = sum(r.generated_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft": summarize_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": summarize_ms([gap for r in ok for gap in r.itl_s]),
        "e2e": summarize_ms([r.e2e_s for r in ok]),
        "generated_tokens": generated,
        "prompt_tokens": sum(r.prompt_tokens or r.sent_prompt_tokens or 0 for r in ok),
        "aggregate_tokens_per_s": ratio(generated, wall_s) if wall_s else None,
        "cached_token_ratio": ratio(sum(r.cached_tokens or 0 for r in reporting), sum(r.prompt_tokens or 0 for r in reporting)),
        "prompt_count_mismatches": sum(
            1 for r in ok if r.prompt_tokens is not None and r.sent_prompt_tokens is not None and r.prompt_tokens != r.sent_prompt_tokens
        ),
    }


def question_overlaps(run: WorkloadRun) -> list[bool]:
    """For each 'question' request: was it sent while a long request of its phase was still prefilling?"""
    overlaps = []
    by_repeat: dict[int, list[RequestResult]] = {}
    for index, _, result in run.results:
        by_repeat.setdefault(index, []).append(result)
    for group in by_repeat.values():
        longs = [r for r in group if r.label == "long"]
        for question in (r for r in group if r.label == "question"):
            overlaps.append(any(r.ttft_s is None or question.sent_at < r.sent_at + r.ttft_s for r in longs))
    return overlaps


def run_to_dict(run: WorkloadRun) -> dict[str, Any]:
    """JSON-ready: the workload, its summary, a summary per request label, and every request."""
    results = [result for _, _, result in run.results]
    labels = sorted({result.label for result in results})
    data: dict[str, Any] = {
        "source": run.workload.source,
        "description": run.workload.description,
        "summary": summarize(results, run.wall_s),
        "classes": {label: summarize([r for r in results if r.label == label], None) for label in labels},
        "requests": [{"repeat": index, **result.to_dict(run.origin)} for index, _, result in run.results],
    }
    overlaps = question_overlaps(run)
    if overlaps:
        data["questions_sent_during_prefill"] = f"{sum(overlaps)}/{len(overlaps)}"
    return data
