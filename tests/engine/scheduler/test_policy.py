"""The short_first policy (the default): short prefills first and whole, long prompts back to back. CPU, no model."""

from __future__ import annotations

from headroom.engine.scheduler.capacity import CountingCapacity, run_counted_pass
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import SchedRequest, SchedulerConfig


def make(config: SchedulerConfig) -> tuple[Scheduler, CountingCapacity]:
    capacity = CountingCapacity(1_000_000, 64)
    return Scheduler(config, capacity), capacity


def chunks(plan) -> dict[str, int]:
    return {item.request.request_id: item.num_tokens for item in plan.prefills}


def test_long_prompts_run_back_to_back_at_full_passes():
    scheduler, capacity = make(SchedulerConfig(chunked_prefill_size=8192, max_running_requests=16))
    for name in "abcd":
        scheduler.add(SchedRequest(name, prompt_len=16_000, max_new_tokens=2))
    assert chunks(run_counted_pass(scheduler, capacity)) == {"a": 8192}
    # a's last 7,808 tokens, and b starts with the 384 left: every pass is full.
    assert chunks(run_counted_pass(scheduler, capacity)) == {"a": 7808, "b": 384}
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]


def test_a_short_question_goes_first_and_whole_behind_long_prompts():
    scheduler, capacity = make(SchedulerConfig(chunked_prefill_size=8192, max_running_requests=16))
    for name in "abcd":
        scheduler.add(SchedRequest(name, prompt_len=16_000, max_new_tokens=2))
    run_counted_pass(scheduler, capacity)
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=8))
    plan = run_counted_pass(scheduler, capacity)
    assert chunks(plan) == {"question": 30, "a": 64}
    # Next pass it decodes alongside the long prefill.
    assert "question" in [item.request.request_id for item in run_counted_pass(scheduler, capacity).decodes]


def test_a_pass_carrying_a_short_prefill_stays_short():
    """The question waits for the pass in flight and one short pass, not a full 8,192-token one."""
    config = SchedulerConfig(chunked_prefill_size=8192, max_running_requests=16, min_prefill_tokens=64)
    scheduler, capacity = make(config)
    scheduler.add(SchedRequest("long", prompt_len=50_000, max_new_tokens=2))
    assert chunks(run_counted_pass(scheduler, capacity)) == {"long": 8192}
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=8))
    assert chunks(run_counted_pass(scheduler, capacity)) == {"question": 30, "long": 64}
    assert chunks(run_counted_pass(scheduler, capacity)) == {"long": 8192}


def test_a_lone_long_prompt_gets_the_whole_budget():
    scheduler, capacity = make(SchedulerConfig(chunked_prefill_size=2048, max_running_requests=10, itl_target_s=0.05))
    scheduler.add(SchedRequest("long", prompt_len=100_000, max_new_tokens=4))
    for _ in range(3):
        assert chunks(run_counted_pass(scheduler, capacity)) == {"long": 2048}


def test_max_pass_s_bounds_every_prefill_pass_even_without_decodes():
    """A pass cannot be interrupted: bounding its length bounds a later short question's wait."""
    from headroom.engine.scheduler.types import PassCostModel

    cost = PassCostModel(fixed_s=0.02, prefill_tokens_per_s=1000.0, decode_s=0.0)
    config = SchedulerConfig(chunked_prefill_size=8192, max_running_requests=16, max_pass_s=1.0, cost_model=cost)
    scheduler, capacity = make(config)
    scheduler.add(SchedRequest("long", prompt_len=20_000, max_new_tokens=2))
    # (1.0 s - 0.02 s fixed) x 1,000 tok/s = 980 tokens, with nothing decoding.
    assert chunks(run_counted_pass(scheduler, capacity)) == {"long": 980}
    assert cost.pass_seconds(980, 0) <= 1.0
    unbounded, capacity = make(SchedulerConfig(chunked_prefill_size=8192, max_running_requests=16, cost_model=cost))
    unbounded.add(SchedRequest("long", prompt_len=20_000, max_new_tokens=2))
    assert chunks(run_counted_pass(unbounded, capacity)) == {"long": 8192}


def test_max_pass_s_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="max_pass_s=0"):
        SchedulerConfig(chunked_prefill_size=8192, max_running_requests=16, max_pass_s=0.0)
