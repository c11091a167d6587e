"""The retention probe's sizes come from the plan's promise, never beyond it."""

from __future__ import annotations

from headroom.client.retention_target import retention_settings
from headroom.client.smoke_types import SmokeSettings

BASE = SmokeSettings(context_length=32768, max_new_tokens=1024)
DEFAULT_PLAN = {"retained_sessions": 885, "session_tokens": 8192, "reuse_interval_tokens": 64,
                "chunked_prefill_size": 8192}


def test_a_plan_that_retains_many_is_probed_with_three_of_its_sessions_at_its_length():
    settings = retention_settings(BASE, DEFAULT_PLAN)
    assert (settings.retention_sessions, settings.retention_context_tokens) == (3, 8192)
    assert settings.reusable_session_tokens == 8192 and settings.checkpoint_interval_tokens == 64


def test_targets_smaller_than_the_probe_are_probed_exactly_and_a_plan_retaining_none_is_not_probed():
    settings = retention_settings(BASE, {**DEFAULT_PLAN, "retained_sessions": 1, "session_tokens": 300})
    assert (settings.retention_sessions, settings.retention_context_tokens) == (1, 300)
    assert retention_settings(BASE, {**DEFAULT_PLAN, "retained_sessions": 0}).retention_sessions == 0


def test_sessions_longer_than_the_context_allows_are_clamped_to_fit_below_the_limit():
    settings = retention_settings(BASE, {**DEFAULT_PLAN, "retained_sessions": 2, "session_tokens": 40000})
    assert settings.retention_context_tokens == BASE.retention_room < 32768


def test_peer_plans_judge_against_the_chunk_and_no_plan_gets_the_old_default():
    sglang = {"retained_sessions": 3, "session_tokens": 66000, "chunked_prefill_size": 8192}
    assert retention_settings(BASE, sglang).checkpoint_interval_tokens == 8192
    plain = retention_settings(BASE, None)
    assert plain.retention_sessions == 2 and plain.retention_context_tokens == 32768 // 4


def test_explicit_sizes_win_over_the_plan():
    explicit = SmokeSettings(context_length=32768, max_new_tokens=1024, retention_sessions=1, retention_tokens=500)
    settings = retention_settings(explicit, DEFAULT_PLAN)
    assert (settings.retention_sessions, settings.retention_context_tokens) == (1, 500)
