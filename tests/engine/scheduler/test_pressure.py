"""Scheduling under KV pressure with cached prefixes: no over-commit, progress every pass, everyone finishes.

CountingCapacity keeps a cached prefix in the pool as evictable pages (counted free until a request using
it is admitted and locks it), as the radix cache does. CPU, no model.
"""

from __future__ import annotations

import random

import pytest
from headroom.engine.scheduler.capacity import CountingCapacity, run_counted_pass
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import SchedRequest, SchedulerConfig


def run_to_completion(scheduler: Scheduler, capacity: CountingCapacity, max_passes: int = 20_000) -> int:
    """Passes until nothing is left; every pass must compute at least one token."""
    for num_passes in range(1, max_passes + 1):
        plan = run_counted_pass(scheduler, capacity)
        assert plan.num_prefill_tokens + len(plan.decodes) > 0, (
            f"pass {num_passes} computed nothing: {len(scheduler.running)} running, {len(scheduler.waiting)} waiting")
        if not scheduler.has_work:
            return num_passes
    raise AssertionError(f"still {len(scheduler.running)} running, {len(scheduler.waiting)} waiting after {max_passes}")


def test_admission_pays_for_the_cached_prefix_it_locks():
    """A's decode leaves 199 free, 150 of them B's evictable cached prefix. Judged on its 50 new tokens B fit
    (the old rule) and then over-committed the pool by locking its prefix; it must wait for A instead."""
    capacity = CountingCapacity(total_kv_tokens=500, total_ssm_slots=4)
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=512, max_running_requests=4), capacity)
    scheduler.add(SchedRequest("a", prompt_len=300, max_new_tokens=20))
    run_counted_pass(scheduler, capacity)
    capacity.set_cached_prefix("b", 150)
    scheduler.add(SchedRequest("b", prompt_len=200, max_new_tokens=20))
    plan = run_counted_pass(scheduler, capacity)
    assert [item.request.request_id for item in plan.decodes] == ["a"] and not plan.admitted
    assert scheduler.rejections["NO_KV"] >= 1
    run_to_completion(scheduler, capacity)


@pytest.mark.parametrize("seed", range(6))
def test_random_overload_with_cached_prefixes_progresses_every_pass(seed):
    rng = random.Random(seed)
    pool = rng.choice([512, 1024, 2048])
    capacity = CountingCapacity(total_kv_tokens=pool, total_ssm_slots=12, page_tokens=rng.choice([1, 16]))
    config = SchedulerConfig(chunked_prefill_size=rng.choice([64, 256]), max_running_requests=8)
    scheduler = Scheduler(config, capacity)
    for index in range(24):
        prompt = rng.randrange(16, pool // 3)
        scheduler.add(SchedRequest(f"r{index}", prompt_len=prompt, max_new_tokens=rng.randrange(1, pool // 3)))
        if rng.random() < 0.5:
            capacity.set_cached_prefix(f"r{index}", rng.randrange(1, prompt))
    run_to_completion(scheduler, capacity)
    assert not scheduler.running and not scheduler.waiting
