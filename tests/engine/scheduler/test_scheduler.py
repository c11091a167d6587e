"""Scheduler budget policy: even split, lone request, mixed passes, ITL bound. CPU only, no model."""

from __future__ import annotations

import pytest
from headroom.engine.scheduler.capacity import CountingCapacity, run_counted_pass
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import PassCostModel, Phase, SchedRequest, SchedulerConfig


def make(config: SchedulerConfig, kv_tokens: int = 1_000_000, slots: int = 64) -> tuple[Scheduler, CountingCapacity]:
    capacity = CountingCapacity(kv_tokens, slots)
    return Scheduler(config, capacity), capacity


def chunk_sizes(plan) -> dict[str, int]:
    return {item.request.request_id: item.num_tokens for item in plan.prefills}


def test_lone_request_gets_the_whole_budget():
    scheduler, capacity = make(SchedulerConfig(chunked_prefill_size=2048, max_running_requests=10))
    scheduler.add(SchedRequest("long", prompt_len=100_000, max_new_tokens=4))
    for _ in range(3):
        assert chunk_sizes(run_counted_pass(scheduler, capacity)) == {"long": 2048}


def test_budget_is_split_evenly_over_prefilling_and_waiting():
    config = SchedulerConfig(chunked_prefill_size=1200, max_running_requests=10, cap_contended_chunks=False,
                             policy="fair")
    scheduler, capacity = make(config)
    for name in ("a", "b", "c"):
        scheduler.add(SchedRequest(name, prompt_len=50_000, max_new_tokens=4))
    assert chunk_sizes(run_counted_pass(scheduler, capacity)) == {"a": 400, "b": 400, "c": 400}
    # A newcomer shrinks everyone's share at once.
    scheduler.add(SchedRequest("d", prompt_len=50_000, max_new_tokens=4))
    assert chunk_sizes(run_counted_pass(scheduler, capacity)) == {"a": 300, "b": 300, "c": 300, "d": 300}


def test_contended_cap_is_derived_from_the_concurrency_limit():
    config = SchedulerConfig(chunked_prefill_size=8192, max_running_requests=10, policy="fair")
    assert config.per_request_cap == 409
    scheduler, capacity = make(config)
    scheduler.add(SchedRequest("a", prompt_len=50_000, max_new_tokens=4))
    scheduler.add(SchedRequest("b", prompt_len=50_000, max_new_tokens=4))
    assert chunk_sizes(run_counted_pass(scheduler, capacity)) == {"a": 409, "b": 409}


def test_a_short_request_leaves_its_unused_share_to_the_long_one():
    config = SchedulerConfig(chunked_prefill_size=4126, max_running_requests=8, cap_contended_chunks=False,
                             policy="fair")
    scheduler, capacity = make(config)
    scheduler.add(SchedRequest("long", prompt_len=130_000, max_new_tokens=4))
    scheduler.add(SchedRequest("short", prompt_len=30, max_new_tokens=4))
    assert chunk_sizes(run_counted_pass(scheduler, capacity)) == {"long": 4096, "short": 30}


def test_every_pass_carries_the_running_decodes_alongside_prefill():
    scheduler, capacity = make(SchedulerConfig(chunked_prefill_size=512, max_running_requests=4))
    scheduler.add(SchedRequest("chat", prompt_len=20, max_new_tokens=50))
    run_counted_pass(scheduler, capacity)
    scheduler.add(SchedRequest("document", prompt_len=20_000, max_new_tokens=2))
    for _ in range(10):
        plan = run_counted_pass(scheduler, capacity)
        assert [item.request.request_id for item in plan.decodes] == ["chat"]
        assert chunk_sizes(plan).get("document", 0) > 0


def test_decode_inter_token_latency_stays_within_the_target():
    """Where passes cannot be interrupted (no interjection: the fair policy, tensor parallel), the chunk shrinks."""
    cost = PassCostModel(fixed_s=0.05, prefill_tokens_per_s=1000.0, decode_s=0.005)
    bounded = SchedulerConfig(chunked_prefill_size=4096, max_running_requests=8, itl_target_s=0.3, cost_model=cost,
                              interject_short=False)
    for config, expect_within in ((bounded, True), (SchedulerConfig(chunked_prefill_size=4096, cost_model=cost), False)):
        scheduler, capacity = make(config)
        for index in range(4):
            scheduler.add(SchedRequest(f"chat{index}", prompt_len=10, max_new_tokens=200))
        run_counted_pass(scheduler, capacity)
        scheduler.add(SchedRequest("document", prompt_len=30_000, max_new_tokens=2))
        pass_seconds = []
        while any(r.request_id == "document" and r.phase is not Phase.DECODE for r in scheduler.running + scheduler.waiting):
            plan = run_counted_pass(scheduler, capacity)
            assert len(plan.decodes) == 4
            pass_seconds.append(cost.pass_seconds(plan.num_prefill_tokens, len(plan.decodes)))
        assert (max(pass_seconds) <= 0.3 + 1e-9) is expect_within
        # The long prefill still moves: 30,000 tokens at >= 200 tokens a pass.
        assert len(pass_seconds) <= 30_000 // 200 + 1


def test_itl_bound_never_stops_prefill_progress():
    cost = PassCostModel(fixed_s=0.5, prefill_tokens_per_s=1000.0, decode_s=0.0)
    config = SchedulerConfig(chunked_prefill_size=4096, itl_target_s=0.1, min_prefill_tokens=64, cost_model=cost,
                             interject_short=False)
    scheduler, capacity = make(config)
    scheduler.add(SchedRequest("chat", prompt_len=10, max_new_tokens=100))
    run_counted_pass(scheduler, capacity)
    scheduler.add(SchedRequest("document", prompt_len=1000, max_new_tokens=2))
    assert run_counted_pass(scheduler, capacity).num_prefill_tokens == 64


@pytest.mark.parametrize("field,value", [("chunked_prefill_size", 0), ("skip_ahead_limit", -1), ("itl_target_s", 0.0)])
def test_config_errors_name_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}"):
        SchedulerConfig(**{field: value})


def test_an_admission_the_caches_refuse_is_deferred_not_failed():
    scheduler, capacity = make(SchedulerConfig(chunked_prefill_size=1024, max_running_requests=4))
    scheduler.add(SchedRequest("held", prompt_len=3000, max_new_tokens=4))
    scheduler.add(SchedRequest("other", prompt_len=100, max_new_tokens=4))
    plan = scheduler.schedule()
    held = next(r for r in plan.admitted if r.request_id == "held")
    scheduler.defer(plan, held, "ssm_slot_held")
    assert "held" not in chunk_sizes(plan) and "other" in chunk_sizes(plan)
    assert [r.request_id for r in scheduler.waiting] == ["held"]
    assert scheduler.rejections["ssm_slot_held"] == 1
    scheduler.complete(plan)
    # Next pass it is admitted again, from scratch.
    assert "held" in chunk_sizes(scheduler.schedule())
