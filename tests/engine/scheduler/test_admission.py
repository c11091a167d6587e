"""Scheduler admission: skip-ahead, strict FCFS switch, aging, preemption, rejection log. CPU, no model."""

from __future__ import annotations

import itertools
import logging

import pytest
from headroom.engine.scheduler.capacity import (
    CountingCapacity,
    finish_counted_pass,
    run_counted_pass,
    start_counted_pass,
)
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import SchedRequest, SchedulerConfig


def crowded(config: SchedulerConfig) -> tuple[Scheduler, CountingCapacity]:
    """A pool of 1,000 tokens with 900 held by a running request, then a too-big and a short request."""
    capacity = CountingCapacity(1000, 8)
    scheduler = Scheduler(config, capacity)
    scheduler.add(SchedRequest("holder", prompt_len=900, max_new_tokens=1000))
    run_counted_pass(scheduler, capacity)
    scheduler.add(SchedRequest("big", prompt_len=5000, max_new_tokens=4))
    scheduler.add(SchedRequest("short", prompt_len=30, max_new_tokens=4))
    return scheduler, capacity


def admitted_ids(plan) -> list[str]:
    return [r.request_id for r in plan.admitted]


def test_skip_ahead_admits_the_short_request_behind_one_that_does_not_fit(caplog):
    config = SchedulerConfig(chunked_prefill_size=1024, max_running_requests=8, decode_reserve_tokens=0,
                             cap_contended_chunks=False, log_rejections=True, policy="fair")
    scheduler, capacity = crowded(config)
    with caplog.at_level(logging.INFO, logger="headroom.scheduler"):
        plan = run_counted_pass(scheduler, capacity)
    assert admitted_ids(plan) == ["short"]
    assert scheduler.rejections["NO_KV"] == 1
    assert "id=big reason=NO_KV need=512 kv_free=99 budget_left=1024" in caplog.text


def test_strict_fcfs_stops_at_the_first_request_that_does_not_fit():
    config = SchedulerConfig.strict_fcfs(chunked_prefill_size=1024, max_running_requests=8, chunk_per_request=512)
    scheduler, capacity = crowded(config)
    assert admitted_ids(run_counted_pass(scheduler, capacity)) == []


def test_admission_judges_the_next_chunk_not_the_whole_prompt():
    capacity = CountingCapacity(2000, 8)
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=512, decode_reserve_tokens=0), capacity)
    # 10,000 tokens never fit the pool at once, but its first 512-token chunk does.
    scheduler.add(SchedRequest("long", prompt_len=1500, max_new_tokens=4))
    assert admitted_ids(run_counted_pass(scheduler, capacity)) == ["long"]


def drive_with_short_stream(max_times_overtaken: int, passes: int, policy: str = "fair") -> int | None:
    """Shorts arrive every pass and keep the pool busy; returns the pass at which `big` was admitted."""
    config = SchedulerConfig(chunked_prefill_size=512, max_running_requests=8, even_split=False,
                             cap_contended_chunks=False, decode_reserve_tokens=0,
                             max_times_overtaken=max_times_overtaken, policy=policy)
    capacity = CountingCapacity(600, 16)
    scheduler = Scheduler(config, capacity)
    scheduler.add(SchedRequest("warm", prompt_len=100, max_new_tokens=20))
    run_counted_pass(scheduler, capacity)
    scheduler.add(SchedRequest("big", prompt_len=2000, max_new_tokens=2))
    for index in itertools.count():
        if index == passes:
            return None
        scheduler.add(SchedRequest(f"short{index}", prompt_len=100, max_new_tokens=20))
        if "big" in admitted_ids(run_counted_pass(scheduler, capacity)):
            return index
    return None


@pytest.mark.parametrize("policy", ["fair", "short_first"])
def test_a_skipped_request_is_not_starved(policy):
    admitted_at = drive_with_short_stream(max_times_overtaken=3, passes=200, policy=policy)
    assert admitted_at is not None and admitted_at < 40


def test_without_aging_the_short_stream_would_starve_it():
    # The control for the test above: the same workload starves `big` when aging is off (fair policy;
    # short_first admits it anyway, in the min_prefill_tokens a short pass leaves to long prompts).
    assert drive_with_short_stream(max_times_overtaken=10**9, passes=200) is None


def run_two_on_a_small_pool(prompt_len: int, max_new_tokens: int, decode_reserve_tokens: int):
    """Two requests on a 160-token pool until both finish (or 2,000 passes): (scheduler, capacity, requests)."""
    capacity = CountingCapacity(160, 4)
    # The even split admits both at once, so the pool runs out mid-decode (short_first would run them in turn).
    config = SchedulerConfig(chunked_prefill_size=64, decode_reserve_tokens=decode_reserve_tokens, policy="fair")
    scheduler = Scheduler(config, capacity)
    requests = [SchedRequest(name, prompt_len=prompt_len, max_new_tokens=max_new_tokens) for name in ("a", "b")]
    for request in requests:
        scheduler.add(request)
    for _ in range(2000):
        if not scheduler.has_work:
            break
        # CountingCapacity.allocate raises if the scheduler ever over-commits the pool.
        run_counted_pass(scheduler, capacity)
    return scheduler, capacity, requests


def test_kv_exhaustion_preempts_by_recompute_and_every_request_completes():
    scheduler, capacity, requests = run_two_on_a_small_pool(50, 100, decode_reserve_tokens=0)
    assert not scheduler.has_work
    assert scheduler.num_preemptions >= 1
    assert [r.num_generated for r in requests] == [100, 100]
    assert capacity.free_kv_tokens() == 160


def test_a_preempted_request_as_long_as_the_pool_comes_back_once_the_pool_is_idle():
    """Prompt 150 + 10 new tokens fill a 160-token pool exactly. The second request is preempted; judged on
    its whole length plus the decode reserve it never fitted, even alone, and waited forever."""
    scheduler, _, requests = run_two_on_a_small_pool(150, 10, decode_reserve_tokens=16)
    assert not scheduler.has_work
    assert scheduler.num_preemptions >= 1
    assert [r.num_generated for r in requests] == [10, 10]


def test_no_free_ssm_slot_means_wait_not_crash():
    capacity = CountingCapacity(100_000, 1)
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=256), capacity)
    scheduler.add(SchedRequest("first", prompt_len=10, max_new_tokens=3))
    scheduler.add(SchedRequest("second", prompt_len=10, max_new_tokens=3))
    plans = [run_counted_pass(scheduler, capacity) for _ in range(8)]
    assert admitted_ids(plans[0]) == ["first"]
    assert scheduler.rejections["NO_SSM_SLOT"] >= 1
    assert not scheduler.has_work


def test_abort_removes_the_request_wherever_it_is():
    capacity = CountingCapacity(10_000, 4)
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=256), capacity)
    scheduler.add(SchedRequest("running", prompt_len=1000, max_new_tokens=3))
    run_counted_pass(scheduler, capacity)
    scheduler.add(SchedRequest("queued", prompt_len=10, max_new_tokens=3))
    assert scheduler.abort("running") is not None and scheduler.abort("queued") is not None
    assert scheduler.abort("missing") is None
    assert not scheduler.has_work


def test_a_decode_preempted_to_pay_for_an_older_one_leaves_the_pass():
    """Three decodes and one free token: the first takes it, the second preempts the newest (the third), whose
    pages pay for it; the third, a victim before its own turn came, is in no item of the pass and waits."""
    capacity = CountingCapacity(34, 8)
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=64, decode_reserve_tokens=0), capacity)
    for name in ("a", "b", "c"):
        scheduler.add(SchedRequest(name, prompt_len=10, max_new_tokens=50))
    run_counted_pass(scheduler, capacity)
    run_counted_pass(scheduler, capacity)
    assert [r.phase.value for r in scheduler.running] == ["decode"] * 3 and capacity.free_kv_tokens() == 1
    plan = start_counted_pass(scheduler, capacity, scheduler.schedule())
    assert [item.request.request_id for item in plan.items] == ["a", "b"]
    assert [r.request_id for r in plan.preempted] == ["c"] and [r.request_id for r in scheduler.waiting] == ["c"]
    finish_counted_pass(scheduler, capacity, plan)
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
