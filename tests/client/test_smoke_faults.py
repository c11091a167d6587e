"""The smoke test against a stub server that misbehaves on purpose: each fault fails the right check."""

from __future__ import annotations

import pytest
from headroom.client.smoke import run_smoke
from headroom.client.smoke_types import SmokeThresholds

from tests.client.client_stub_server import StubConfig, StubServer

SMALL = dict(context_length=512, max_new_tokens=32, short_delay_s=0.01, retention_sessions=2, retention_tokens=96)


def smoke_against(config: StubConfig, thresholds: SmokeThresholds | None = None, **options):
    with StubServer(config) as url:
        return run_smoke(url, thresholds=thresholds, metrics_interval_s=0.05, **{**SMALL, **options})


def failed(report) -> set[str]:
    return set(report.failures)


def test_well_behaved_stub_passes_every_check():
    report = smoke_against(StubConfig())
    assert report.passed, report.failures
    assert report.figures["long_prompt_tokens"] == 512 - 32 - 16
    assert report.figures["retention"]["hit_rate"] == 1.0
    assert report.checks["gpu_cliff"].status == "skip"


def test_empty_answer_at_the_boundary_fails_the_boundary_probes():
    report = smoke_against(StubConfig(faults={"boundary_empty"}))
    assert failed(report) == {"boundary_prompt_over_context", "boundary_no_room_for_output"}
    assert "answered ''" in report.checks["boundary_no_room_for_output"].reason
    assert "silent truncation" in report.checks["boundary_prompt_over_context"].reason


def test_silent_truncation_is_caught_by_the_prompt_count():
    report = smoke_against(StubConfig(faults={"truncate"}))
    assert "boundary_prompt_over_context" in failed(report)
    assert "accepted (HTTP 200)" in report.checks["boundary_prompt_over_context"].reason


def test_server_dying_on_the_long_prefill():
    report = smoke_against(StubConfig(die_over_tokens=300, faults={"die_on_long"}))
    assert {"long_prefill", "alive_after_long_prefill"} <= failed(report)
    assert "HTTP 500" in report.checks["long_prefill"].reason and "device not ready" in report.checks["long_prefill"].reason
    assert "503" in report.checks["alive_after_long_prefill"].reason
    # The remaining probes are not run against a dead server.
    assert "retention" not in report.checks


def test_pool_too_small_for_the_sessions_fails_retention():
    # Field report 004 in small: 3 sessions x 96 tokens do not fit a 200-token pool, so revisits miss.
    report = smoke_against(StubConfig(pool_tokens=200), retention_sessions=3)
    assert failed(report) == {"retention"}
    assert "hit rate 0.0%" in report.checks["retention"].reason


def test_hybrid_checkpoints_bound_the_reachable_hit_rate():
    # 96-token sessions on an engine that checkpoints every 64 tokens: 64 of 96 can be reused.
    hybrid = StubConfig(checkpoint_every=64)
    assert "hit rate 66.7%" in smoke_against(hybrid).checks["retention"].reason
    report = smoke_against(hybrid, checkpoint_interval_tokens=64)
    assert report.checks["retention"].status == "pass"
    assert report.figures["retention"]["reusable_session_tokens"] == 64
    short = smoke_against(hybrid, checkpoint_interval_tokens=128)
    assert short.checks["retention"].status == "skip" and "shorter than one checkpoint" in short.checks["retention"].reason


def test_head_of_line_blocking_fails_the_short_ttft_threshold():
    slow = StubConfig(prefill_s_per_token=0.002, faults={"serial_prefill"})
    report = smoke_against(slow, SmokeThresholds(max_short_ttft_s=0.3, min_prefill_tokens_per_s=1e6))
    assert {"short_ttft_during_long_prefill", "prefill_rate"} <= failed(report)
    reason = report.checks["short_ttft_during_long_prefill"].reason
    assert "vs limit 0.300 s" in reason and "during the long prefill" in reason
    assert report.figures["short_ttft_s"] > 0.3


def test_gpu_cliff_in_metrics_fails():
    report = smoke_against(StubConfig(faults={"gpu_cliff"}))
    assert failed(report) == {"gpu_cliff"}
    assert "250 W (power limit)" in report.checks["gpu_cliff"].reason


def test_missing_usage_skips_retention_instead_of_inventing_a_rate():
    report = smoke_against(StubConfig(faults={"no_usage"}))
    assert report.passed
    assert report.checks["retention"].status == "skip"


def test_unreachable_server_fails_without_raising():
    report = run_smoke("http://127.0.0.1:9", **SMALL)
    assert failed(report) == {"server_reachable"}
    assert not report.passed


def test_report_serializes_every_check():
    report = smoke_against(StubConfig(faults={"boundary_empty"}))
    data = report.to_dict()
    assert data["passed"] is False
    assert data["checks"]["boundary_no_room_for_output"]["status"] == "fail"
    assert all({"status", "reason"} == set(check) for check in data["checks"].values())


@pytest.mark.parametrize("bad", [dict(context_length=40), dict(retention_tokens=600)])
def test_sizes_that_cannot_fit_are_usage_errors(bad):
    with pytest.raises(ValueError, match="context"):
        run_smoke("http://127.0.0.1:9", **{**SMALL, **bad})
