"""The client against the real headroom engine (`headroom serve`, embedded tiny hybrid model, CPU)."""

from __future__ import annotations

import json

import pytest
from headroom.client.smoke import run_smoke
from headroom.client.smoke_types import SmokeThresholds
from headroom.client.workloads import builtin_workloads
from headroom.main import main

from tests.client.client_stub_server import AppThread
from tests.client.engine_process import EngineProcess, boundary_breaking_proxy

# Checkpoints every 64 tokens, so 256-token sessions can be reused (hybrid prefix reuse stops at the
# last SSM checkpoint inside the shared prefix).
GOOD_FLAGS = ["--context-length", "1024", "--max-new-tokens", "64", "--chunked-prefill-size", "64"]
SMOKE = dict(context_length=1024, max_new_tokens=64, short_delay_s=0.02, metrics_interval_s=0.2,
             retention_sessions=2, retention_tokens=256, checkpoint_interval_tokens=64, wait_ready_s=5.0)
# CPU timings on a shared 2-core machine: generous, the behaviour is what is checked here.
CPU_THRESHOLDS = SmokeThresholds(max_short_ttft_s=10.0)


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    with EngineProcess(GOOD_FLAGS, root / "cache", root / "serve.log") as url:
        yield url


def test_smoke_passes_against_a_well_configured_engine(engine_url):
    report = run_smoke(engine_url, thresholds=CPU_THRESHOLDS, **SMOKE)
    assert report.passed, report.failures
    assert report.checks["retention"].status == "pass"
    assert report.checks["boundary_no_room_for_output"].status == "pass"
    assert "HTTP 400" in report.checks["boundary_prompt_over_context"].reason
    assert report.figures["long_prompt_tokens"] == 1024 - 64 - 16
    assert report.figures["prefill_tokens_per_s"] > 0
    assert report.checks["gpu_cliff"].status == "skip" and report.checks["metrics_endpoint"].status == "pass"


def test_retention_probe_sees_prefix_reuse(engine_url):
    report = run_smoke(engine_url, thresholds=CPU_THRESHOLDS, **SMOKE)
    assert report.checks["retention"].status == "pass", report.checks["retention"].reason
    assert report.figures["retention"]["hit_rate"] >= 0.9


def test_smoke_fails_when_the_boundary_is_answered_with_an_empty_string(engine_url):
    with AppThread(boundary_breaking_proxy(engine_url)) as proxy_url:
        report = run_smoke(proxy_url, thresholds=CPU_THRESHOLDS, **{**SMOKE, "retention_sessions": 0})
    assert set(report.failures) == {"boundary_prompt_over_context", "boundary_no_room_for_output"}
    assert "answered '' with finish_reason='stop'" in report.checks["boundary_no_room_for_output"].reason


def test_smoke_fails_when_the_engine_runs_with_a_shorter_context_than_planned(tmp_path):
    # The plan promises 1024 tokens; the engine was started with 512, so the long prefill cannot run.
    with EngineProcess(["--context-length", "512", "--max-new-tokens", "64"], tmp_path / "cache", tmp_path / "serve.log") as url:
        report = run_smoke(url, thresholds=CPU_THRESHOLDS, **SMOKE)
    assert "long_prefill" in report.failures
    reason = report.checks["long_prefill"].reason
    assert "944-token prompt: HTTP 400" in reason and "512" in reason
    assert "prefill_rate" in report.failures


@pytest.mark.parametrize("workload", list(builtin_workloads()))
def test_bench_every_workload_at_reduced_size(engine_url, workload, tmp_path, capsys):
    out = tmp_path / "out"
    code = main([
        "bench", "--url", engine_url, "--workload", workload, "--scale", "0.01", "--question-delay-s", "0.02",
        "--out", str(out), "--label", "cpu-tiny", "--no-progress",
    ])
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    data = result["workloads"][workload]
    summary = data["summary"]
    assert summary["errors"] == 0 and summary["requests"] == len(builtin_workloads()[workload].requests)
    assert summary["ttft"]["count"] == summary["requests"] and summary["aggregate_tokens_per_s"] > 0
    assert summary["prompt_count_mismatches"] == 0
    assert (out / f"{workload}.png").read_bytes()[:4] == b"\x89PNG"
    assert f"| {workload} | cpu-tiny |" in (out / "table.md").read_text()
    if workload == "chains_k3_revisit":
        # The first lap is cold; the revisit laps' ratio is asserted once prefix reuse works (see above).
        assert data["classes"]["lap1"]["cached_token_ratio"] == 0
        assert {"lap1", "lap2", "lap3"} == set(data["classes"])


def test_chat_streaming_is_timed_per_token(engine_url):
    import asyncio

    from headroom.client.http import OpenAIClient

    async def chat():
        async with OpenAIClient(engine_url) as client:
            await client.resolve_model()
            return await client.stream_chat([{"role": "user", "content": "hello"}], 6, extra={"ignore_eos": True})

    result = asyncio.run(chat())
    assert result.ok, result.error
    assert result.ttft_s is not None and result.completion_tokens == 6 and result.finish_reason == "length"
