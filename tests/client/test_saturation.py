"""The smoke test's saturation probe against the real engine (`headroom serve`, tiny model, CPU, small pool).

Eight requests of 200 prompt + 40 new tokens against a 384-token pool: the pool runs out mid-decode and
the engine must preempt and resume. Against the engine before issue 15's fix this probe failed: 0 of 8 finished within the deadline
(the preempt / re-admit livelock), see docs/scheduling.md.
"""

from __future__ import annotations

import asyncio

import pytest
from headroom.client.http import OpenAIClient
from headroom.client.prompts import from_id_range
from headroom.client.saturation import saturation_probe
from headroom.client.smoke_types import SmokeReport, SmokeSettings

from tests.client.engine_process import EngineProcess

FLAGS = ["--context-length", "256", "--max-total-tokens", "384", "--chunked-prefill-size", "128",
         "--max-new-tokens", "40"]


@pytest.fixture(scope="module")
def small_pool_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    with EngineProcess(FLAGS, root / "cache", root / "serve.log") as url:
        yield url


def probe(url: str, deadline_s: float) -> SmokeReport:
    settings = SmokeSettings(context_length=256, max_new_tokens=40, saturation_requests=8, pool_tokens=384,
                             checkpoint_interval_tokens=128, saturation_deadline_s=deadline_s)
    report = SmokeReport(url=url, settings={}, thresholds={})

    async def run() -> None:
        async with OpenAIClient(url, timeout_s=deadline_s + 30) as client:
            await client.resolve_model()
            await saturation_probe(client, from_id_range(32, 127), settings, report)

    asyncio.run(run())
    return report


def test_every_saturating_request_finishes_and_the_server_still_answers(small_pool_url):
    report = probe(small_pool_url, deadline_s=120.0)
    assert report.checks["saturation"].status == "pass", report.checks["saturation"].reason
    figures = report.figures["saturation"]
    assert figures["complete"] == 8 and (figures["prompt_tokens"], figures["max_tokens"]) == (200, 40)
    assert figures["after_ttft_s"] is not None


def test_requests_still_running_at_the_deadline_fail_the_probe(small_pool_url):
    report = probe(small_pool_url, deadline_s=0.05)
    check = report.checks["saturation"]
    assert check.status == "fail" and "finished within 0 s" in check.reason and "still running" in check.reason
