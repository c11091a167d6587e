"""/metrics' prefix-cache lines from a real CacheManager (no model): counters, slot split, the throttled log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from headroom.engine.cache.kv_slots import KVAllocator
from headroom.engine.cache.manager import CacheManager
from headroom.engine.cache.ssm_slots import SSMSlotAllocator
from headroom.engine.sequence import Sequence
from headroom.engine.server import metrics as metrics_module
from headroom.engine.server.metrics import EngineMetrics

from tests.engine.cache.test_manager import prefill


def _loop(cache: CacheManager) -> SimpleNamespace:
    scheduler = SimpleNamespace(waiting=[], running=[], num_prefilling=0, num_preemptions=0, rejections={})
    return SimpleNamespace(steps=SimpleNamespace(cache=cache), scheduler=scheduler)


def _value(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def _serve(cache: CacheManager, name: str, prompt: list[int]) -> None:
    seq = Sequence(name, prompt)
    assert cache.admit(seq)
    prefill(cache, seq, chunk=64)
    cache.finish(seq)


def _with_a_silent_miss(monkeypatch):
    """(clock, cache, metrics, loop, base): a cache that served `base` (300 tokens) and then 250 of them again, whose
    deepest state inside is at 192 (58 tokens matched without a state); the metrics' clock stands at clock[0]."""
    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    cache = CacheManager(KVAllocator(2048), SSMSlotAllocator(32), lambda s, d: None, checkpoint_interval=64)
    base = list(range(1000, 1300))
    _serve(cache, "a", base)
    _serve(cache, "b", base[:250] + [7] * 20)
    return clock, cache, EngineMetrics(with_gpu=False), _loop(cache), base


def test_counters_slots_and_one_silent_miss_log_a_minute(monkeypatch, caplog):
    clock, cache, metrics, loop, base = _with_a_silent_miss(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="headroom.prefix_cache"):
        metrics.refresh(loop)
        metrics.refresh(loop)
    assert _value(metrics, "headroom_prefix_lookup_tokens_total") == 299 + 269
    assert _value(metrics, "headroom_prefix_matched_tokens_total") == 250
    assert _value(metrics, "headroom_prefix_matched_no_state_tokens_total") == 250 - 192
    # Idle: no working slot held; every used slot is a checkpoint.
    assert _value(metrics, "headroom_ssm_used_slots") == 0
    assert _value(metrics, "headroom_ssm_checkpoint_slots") == cache.radix.num_checkpoints > 0  # type: ignore[union-attr]
    assert _value(metrics, "headroom_ssm_checkpoints_taken_total") == cache.stats.checkpoints_taken
    assert len([r for r in caplog.records if "no SSM checkpoint" in r.getMessage()]) == 1
    caplog.clear()
    # A new miss (100 matched, no state below 192) within the minute is counted, not logged; after it, logged.
    _serve(cache, "c", base[:100] + [9] * 10)
    with caplog.at_level(logging.WARNING, logger="headroom.prefix_cache"):
        clock[0] += 30
        metrics.refresh(loop)
        assert not caplog.records
        clock[0] += 31
        metrics.refresh(loop)
    assert len(caplog.records) == 1 and "100 prompt tokens" in caplog.records[0].getMessage()


def test_passes_count_on_the_engine_thread_and_the_gauges_at_the_scrape(monkeypatch, caplog):
    """observe_step (the engine thread, after each pass) counts the pass and logs a silent miss with no scrape at
    all; the gauges and prefix counters it leaves alone are brought up to date by refresh, which /metrics runs
    before rendering, and the miss is not logged twice."""
    from headroom.engine.loop.step import StepStats

    _, cache, metrics, loop, _ = _with_a_silent_miss(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="headroom.prefix_cache"):
        metrics.observe_step(StepStats(seconds=0.02, num_prefill_tokens=64, num_decodes=3), loop)
        metrics.observe_step(StepStats(seconds=0.01, num_decodes=3, interjected=[StepStats()]), loop)
        assert len([r for r in caplog.records if "no SSM checkpoint" in r.getMessage()]) == 1
        assert "58 prompt tokens" in caplog.records[0].getMessage()
        metrics.refresh(loop)
    assert len(caplog.records) == 1
    assert _value(metrics, "headroom_forward_passes_total") == 2
    assert _value(metrics, "headroom_interjected_passes_total") == 1
    assert _value(metrics, "headroom_prefill_tokens_computed_total") == 64
    assert _value(metrics, "headroom_pass_seconds_count") == 2
    assert _value(metrics, "headroom_pass_seconds_sum") == pytest.approx(0.03)
    assert _value(metrics, "headroom_kv_used_tokens") == cache.kv_allocator.num_used_tokens > 0
    assert _value(metrics, "headroom_prefix_cache_tokens") == cache.radix.num_cached_tokens  # type: ignore[union-attr]
    assert _value(metrics, "headroom_prefix_matched_no_state_tokens_total") == 250 - 192
