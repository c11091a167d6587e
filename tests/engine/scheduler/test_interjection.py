"""Interjection: short requests planned into a pass of their own while a long pass is in flight. CPU, no model."""

from __future__ import annotations

from dataclasses import replace

from headroom.engine.scheduler.capacity import CountingCapacity, finish_counted_pass, start_counted_pass
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import Phase, SchedRequest, SchedulerConfig

CONFIG = SchedulerConfig(chunked_prefill_size=8192, max_running_requests=16)


def in_flight(config: SchedulerConfig = CONFIG, pool: int = 1_000_000, slots: int = 64, longs: int = 4):
    """A scheduler whose first pass (long prompts) has started: its memory taken, not yet completed."""
    capacity = CountingCapacity(pool, slots)
    scheduler = Scheduler(config, capacity)
    for k in range(longs):
        scheduler.add(SchedRequest(f"long{k}", prompt_len=16_000, max_new_tokens=2))
    outer = start_counted_pass(scheduler, capacity, scheduler.schedule())
    return scheduler, capacity, outer


def chunks(plan) -> dict[str, int]:
    return {item.request.request_id: item.num_tokens for item in plan.prefills}


def test_a_question_arriving_mid_pass_gets_a_pass_of_its_own_whole():
    scheduler, capacity, outer = in_flight()
    assert scheduler.is_interruptible(outer)
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
    inner = scheduler.schedule_interjection(outer)
    assert inner is not None and chunks(inner) == {"question": 30} and not inner.decodes and not inner.preempted
    start_counted_pass(scheduler, capacity, inner)
    finish_counted_pass(scheduler, capacity, inner)
    question = next(r for r in scheduler.running if r.request_id == "question")
    assert question.phase is Phase.DECODE and question.num_generated == 1
    # The long pass then completes as planned, untouched.
    finish_counted_pass(scheduler, capacity, outer)
    assert chunks(outer) == {"long0": 8192}
    assert next(r for r in scheduler.running if r.request_id == "long0").num_computed == 8192


def test_only_short_requests_within_the_short_budget_are_interjected():
    scheduler, _, outer = in_flight()
    limit = CONFIG.short_limit
    for name, length in (("a", 1000), ("big", limit + 1), ("b", limit - 1000), ("c", 1001)):
        scheduler.add(SchedRequest(name, prompt_len=length, max_new_tokens=4))
    inner = scheduler.schedule_interjection(outer)
    # a and b fit the 2,048-token budget together; the long one waits for a normal pass; c no longer fits.
    assert inner is not None and chunks(inner) == {"a": 1000, "b": limit - 1000}
    assert [r.request_id for r in scheduler.waiting] == ["long1", "long2", "long3", "big", "c"]


def test_nothing_is_interjected_into_a_short_pass_or_under_another_policy():
    scheduler, _, outer = in_flight(longs=0)
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
    assert not scheduler.is_interruptible(outer) and scheduler.schedule_interjection(outer) is None
    for config in (replace(CONFIG, interject_short=False), replace(CONFIG, policy="fair"),
                   SchedulerConfig.strict_fcfs(8192, 16, 8192)):
        scheduler, _, outer = in_flight(config)
        scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
        assert not scheduler.is_interruptible(outer) and scheduler.schedule_interjection(outer) is None


def test_an_interjection_never_preempts_and_respects_every_limit():
    # The running limit: the first long prompt holds the only place.
    scheduler, _, outer = in_flight(replace(CONFIG, max_running_requests=1))
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
    assert scheduler.schedule_interjection(outer) is None
    # SSM slots: the long prompt holds the only one.
    scheduler, _, outer = in_flight(slots=1)
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
    assert scheduler.schedule_interjection(outer) is None
    # KV: the first chunk left 8,192 + 40 - 8,192 tokens, less than the question and the decode reserve need.
    scheduler, capacity, outer = in_flight(pool=8192 + 40)
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
    assert capacity.free_kv_tokens() == 40 and scheduler.schedule_interjection(outer) is None
    assert [r.request_id for r in scheduler.running] == ["long0"] and scheduler.num_preemptions == 0


def test_a_long_request_overtaken_too_often_bars_interjections_too():
    config = replace(CONFIG, max_times_overtaken=2)
    scheduler, _, outer = in_flight(config, longs=1)
    scheduler.add(SchedRequest("waiting-long", prompt_len=16_000, max_new_tokens=2))
    for k in range(3):
        scheduler.add(SchedRequest(f"q{k}", prompt_len=30, max_new_tokens=4))
        inner = scheduler.schedule_interjection(outer)
        assert (inner is not None) == (k < 2)
    assert scheduler.waiting[0].request_id == "waiting-long" and scheduler.waiting[0].times_overtaken == 2


def decoding_then_long(config: SchedulerConfig):
    """Four chats decoding, then a long document: its first pass is planned (not yet run)."""
    capacity = CountingCapacity(1_000_000, 64)
    scheduler = Scheduler(config, capacity)
    for k in range(4):
        scheduler.add(SchedRequest(f"chat{k}", prompt_len=10, max_new_tokens=200))
    finish_counted_pass(scheduler, capacity, start_counted_pass(scheduler, capacity, scheduler.schedule()))
    scheduler.add(SchedRequest("document", prompt_len=30_000, max_new_tokens=2))
    return scheduler, capacity, start_counted_pass(scheduler, capacity, scheduler.schedule())


def test_with_an_itl_target_a_long_pass_keeps_its_chunk_and_defers_the_decodes_to_steps_between_its_layers():
    config = replace(CONFIG, itl_target_s=0.05)
    scheduler, capacity, outer = decoding_then_long(config)
    assert chunks(outer) == {"document": 8192} and not outer.decodes
    assert [r.request_id for r in outer.deferred_decodes] == [f"chat{k}" for k in range(4)]
    step = scheduler.schedule_decode_step(outer)
    assert step is not None and not step.prefills
    assert [item.request.request_id for item in step.decodes] == [f"chat{k}" for k in range(4)]
    start_counted_pass(scheduler, capacity, step)
    finish_counted_pass(scheduler, capacity, step)
    assert all(r.num_generated == 2 for r in scheduler.running if r.request_id.startswith("chat"))
    finish_counted_pass(scheduler, capacity, outer)
    # Without interjection the ITL target shrinks the chunk, and the pass carries the decodes.
    _, _, shrunk = decoding_then_long(replace(config, interject_short=False))
    assert len(shrunk.decodes) == 4 and shrunk.num_prefill_tokens < 8192
    # Without a target the long pass carries the decodes, as it always did.
    _, _, mixed = decoding_then_long(CONFIG)
    assert len(mixed.decodes) == 4 and not mixed.deferred_decodes and chunks(mixed) == {"document": 8192}


def test_a_decode_step_is_due_when_one_more_layer_would_overshoot_the_target():
    from headroom.engine.scheduler.interjection import decode_step_due
    from headroom.engine.scheduler.types import PassCostModel

    config = replace(CONFIG, itl_target_s=0.030, cost_model=PassCostModel(fixed_s=0.004, decode_s=0.0005))
    step = 0.004 + 4 * 0.0005
    assert not decode_step_due(config, 0.030 - step - 0.0051, 4, layer_s=0.005)
    assert decode_step_due(config, 0.030 - step - 0.0049, 4, layer_s=0.005)
    assert not decode_step_due(config, 1.0, 0, layer_s=0.005)
    assert not decode_step_due(replace(config, itl_target_s=None), 1.0, 4, layer_s=0.005)


def test_a_request_the_pass_in_flight_preempted_is_not_taken_back_by_an_interjection():
    scheduler, _, outer = in_flight()
    victim = SchedRequest("victim", prompt_len=30, max_new_tokens=4)
    scheduler.add(victim)
    outer.preempted.append(victim)  # as if schedule() had preempted it to make room for this pass
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
    inner = scheduler.schedule_interjection(outer)
    assert inner is not None and chunks(inner) == {"question": 30}
    assert victim in scheduler.waiting


def test_interjections_take_at_most_the_long_pass_s_own_length():
    from headroom.engine.scheduler.interjection import interjection_budget_s

    scheduler, _, outer = in_flight()
    budget = interjection_budget_s(CONFIG, outer)
    assert budget == CONFIG.cost_model.pass_seconds(8192, 0)
    scheduler.add(SchedRequest("question", prompt_len=30, max_new_tokens=4))
    assert scheduler.schedule_interjection(outer, spent_s=budget) is None
    assert scheduler.schedule_interjection(outer, spent_s=budget * 0.99) is not None
