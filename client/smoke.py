"""The long-prefill smoke test: does a server that is up actually work near its limits?

Library entry points (the operator gates rollouts on them):
    report = run_smoke(url, context_length=..., max_new_tokens=..., thresholds=SmokeThresholds())
    report = await smoke(url, settings, thresholds)            # inside an event loop (kopf)
report.passed, report.checks[name].status / .reason, report.figures, report.to_dict().
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any

from headroom.client.boundary import boundary_probes
from headroom.client.http import OpenAIClient
from headroom.client.probes import long_prefill_with_short_prompt, server_alive
from headroom.client.prompts import build_prompt_factory
from headroom.client.retention import retention_probe
from headroom.client.saturation import saturation_probe
from headroom.client.smoke_types import Check, SmokeReport, SmokeSettings, SmokeThresholds
from headroom.client.telemetry import MetricsSampler, detect_cliff


async def smoke(
    url: str,
    settings: SmokeSettings,
    thresholds: SmokeThresholds | None = None,
    *,
    model: str | None = None,
    tokenizer_path: str | None = None,
    token_id_range: tuple[int, int] | None = None,
    request_timeout_s: float = 600.0,
    wait_ready_s: float = 0.0,
    api_key: str | None = None,
) -> SmokeReport:
    """Run every probe against url and return the report; never raises for a misbehaving server.

    wait_ready_s: first wait up to this long for /ready (or /health where there is no /ready) to answer 200.
    api_key: sent as `Authorization: Bearer` to a server started with --api-key.
    """
    thresholds = thresholds or SmokeThresholds()
    report = SmokeReport(url=url, settings=asdict(settings), thresholds=asdict(thresholds))
    async with OpenAIClient(url, model=model, timeout_s=request_timeout_s, api_key=api_key) as client:
        report.figures["waited_for_ready_s"] = await wait_until_ready(client, wait_ready_s)
        try:
            report.figures["model"] = await client.resolve_model()
        except Exception as error:  # noqa: BLE001 - any failure here means the server is not usable
            report.checks["server_reachable"] = Check("fail", f"GET /v1/models failed: {type(error).__name__}: {error}")
            return report
        report.checks["server_reachable"] = Check("pass", f"serving model {report.figures['model']!r}")
        factory = await build_prompt_factory(client, tokenizer_path=tokenizer_path, id_range=token_id_range)
        report.figures["prompt_tokens_source"] = factory.to_dict()

        async with MetricsSampler(client, settings.metrics_interval_s) as sampler:
            await long_prefill_with_short_prompt(client, factory, settings, thresholds, report)
        await server_alive(client, report)
        _judge_telemetry(sampler, thresholds, report)
        if not report.checks["alive_after_long_prefill"].passed:
            return report
        await boundary_probes(client, factory, settings, thresholds, report)
        await saturation_probe(client, factory, settings, report)
        await retention_probe(client, factory, settings, thresholds, report)
    return report


async def wait_until_ready(client: OpenAIClient, limit_s: float, poll_s: float = 0.2) -> float:
    """Seconds spent waiting for readiness (at most limit_s); the probes then tell whether it is usable."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        response = await client.get("/ready")
        if response is not None and response.status_code == 404:
            response = await client.get("/health")
        if response is not None and response.status_code == 200:
            break
        await asyncio.sleep(poll_s)
    return round(time.perf_counter() - started, 3)


def _judge_telemetry(sampler: MetricsSampler, thresholds: SmokeThresholds, report: SmokeReport) -> None:
    if sampler.last_text is None:
        report.checks["metrics_endpoint"] = Check("skip", "no /metrics endpoint answered 200")
    else:
        report.checks["metrics_endpoint"] = Check("pass", f"/metrics answered ({len(sampler.last_text)} bytes)")
    verdict = detect_cliff(
        sampler.samples, util_threshold_percent=thresholds.cliff_util_percent, power_ratio=thresholds.cliff_power_ratio
    )
    report.figures["gpu_samples"] = [asdict(sample) for sample in sampler.samples]
    report.figures["cliff"] = verdict.to_dict()
    if not verdict.decidable:
        report.checks["gpu_cliff"] = Check("skip", verdict.reason)
    else:
        report.checks["gpu_cliff"] = Check("fail" if verdict.at_cliff else "pass", verdict.reason)


def run_smoke(
    url: str,
    *,
    context_length: int,
    max_new_tokens: int,
    thresholds: SmokeThresholds | None = None,
    **options: Any,
) -> SmokeReport:
    """Synchronous wrapper. options: SmokeSettings fields, plus model / tokenizer_path / token_id_range /
    request_timeout_s / wait_ready_s / api_key."""
    runner_keys = {"model", "tokenizer_path", "token_id_range", "request_timeout_s", "wait_ready_s", "api_key"}
    runner = {key: options.pop(key) for key in list(options) if key in runner_keys}
    settings = SmokeSettings(context_length=context_length, max_new_tokens=max_new_tokens, **options)
    return asyncio.run(smoke(url, settings, thresholds, **runner))
