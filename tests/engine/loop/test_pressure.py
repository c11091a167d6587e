"""The engine under KV pressure (real caches, tiny model, CPU): every pass makes progress, every request ends.

Before the fix, six 100-token prompts + 40 new tokens in a 384-token pool stalled at pass 13 for good: a
preempted request's cached prefix counted as free (evictable) space, admission then locked it, no reserve
succeeded, the empty pass preempted it again, and the cycle repeated with 0 tokens computed.
"""

from __future__ import annotations

import random

import pytest
from headroom.engine.default_model import ensure_default_model
from headroom.engine.loop.step import TokenEvent
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.factory import ServeOptions, build_state


def _state(tmp_path, max_total_tokens: int):
    return build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=256,
                                    max_total_tokens=max_total_tokens, chunked_prefill_size=128, max_new_tokens=40))


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def test_more_load_than_the_pool_holds_progresses_every_pass_and_finishes(tmp_path):
    state = _state(tmp_path, max_total_tokens=384)
    steps = state.loop.steps
    finished: dict[str, TokenEvent] = {}
    steps.emit = lambda rid, event: finished.__setitem__(rid, event) if event.finish_reason else None
    for index in range(6):
        steps.add(Sequence(f"r{index}", _prompt(index, 100), SamplingParams(max_new_tokens=40, ignore_eos=True)),
                  frozenset())
    num_passes = 0
    while steps.scheduler.has_work:
        stats = steps.step()
        num_passes += 1
        assert stats.num_prefill_tokens + stats.num_decodes > 0, (
            f"pass {num_passes} computed nothing: {len(steps.scheduler.running)} running,"
            f" {len(steps.scheduler.waiting)} waiting, {steps.scheduler.num_preemptions} preemptions")
        assert num_passes < 2000
    assert {rid: event.finish_reason for rid, event in finished.items()} == {f"r{i}": "length" for i in range(6)}
    # 6 x 140 tokens cannot share 384 slots: it got there by preempting, and resumed from the cache.
    assert steps.scheduler.num_preemptions >= 1
    cache = steps.cache
    assert cache.kv_allocator.num_free_tokens + cache.radix.evictable_tokens() == 384


def test_a_request_that_could_never_fit_the_pool_is_refused_with_the_numbers(tmp_path):
    state = _state(tmp_path, max_total_tokens=384)
    steps = state.loop.steps
    events: list[TokenEvent] = []
    steps.emit = lambda rid, event: events.append(event)
    steps.add(Sequence("huge", _prompt(0, 380), SamplingParams(max_new_tokens=40, ignore_eos=True)), frozenset())
    assert not steps.scheduler.has_work
    assert [e.finish_reason for e in events] == ["error"]
    assert "380 tokens + max_new_tokens 40 = 420 exceeds the KV pool of 384 tokens" in (events[0].error or "")


@pytest.mark.parametrize("seed", [1, 2])
def test_usage_keeps_the_first_prefix_hit_after_a_preemption(tmp_path, seed):
    """A re-admitted request resumes from a hit that covers its generated tokens; usage must not claim it."""
    state = _state(tmp_path, max_total_tokens=384)
    steps = state.loop.steps
    last: dict[str, TokenEvent] = {}
    steps.emit = lambda rid, event: last.__setitem__(rid, event)
    for index in range(6):
        steps.add(Sequence(f"r{index}", _prompt(seed * 10 + index, 100),
                           SamplingParams(max_new_tokens=40, ignore_eos=True)), frozenset())
    for _ in range(2000):
        if not steps.scheduler.has_work:
            break
        steps.step()
    assert not steps.scheduler.has_work and steps.scheduler.num_preemptions >= 1
    assert all(event.num_cached_tokens < event.num_prompt_tokens for event in last.values())


@pytest.mark.parametrize("itl_target_ms", [None, 0.001])
def test_short_arrivals_interjected_under_pressure_all_finish_and_leak_nothing(tmp_path, itl_target_ms):
    """Long prompts fill the pool while short requests keep arriving mid-pass (one at every layer boundary until
    24 came): some are interjected, some wait for a normal pass, some are preempted; every one finishes."""
    import asyncio

    from headroom.engine.loop.engine_loop import RequestStream

    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=256,
                                     max_total_tokens=512, chunked_prefill_size=128, max_new_tokens=40,
                                     itl_target_ms=itl_target_ms))
    loop, steps = state.loop, state.loop.steps
    finished: dict[str, TokenEvent] = {}
    steps.emit = lambda rid, event: finished.__setitem__(rid, event) if event.finish_reason else None
    for index in range(4):
        steps.add(Sequence(f"long{index}", _prompt(index, 200), SamplingParams(max_new_tokens=20, ignore_eos=True)),
                  frozenset())
    poll, shorts = steps.poll_arrivals, []

    def arrivals() -> bool:
        if len(shorts) < 24:
            name = f"short{len(shorts)}"
            shorts.append(name)
            # 40 new tokens: with the ITL target they decode inside the long passes, and must still hold their KV
            # long enough to run the pool short.
            loop.submit(Sequence(name, _prompt(100 + len(shorts), 20), SamplingParams(max_new_tokens=40, ignore_eos=True)),
                        frozenset(), RequestStream(asyncio.new_event_loop(), asyncio.Queue()))
        return poll()

    steps.poll_arrivals = arrivals
    interjected, num_passes = 0, 0
    while steps.scheduler.has_work or len(shorts) < 24:
        loop.drain_inbox()
        stats = loop._step()
        interjected += len(stats.interjected)
        num_passes += 1
        assert num_passes < 3000
    assert interjected > 0, 'no short request was interjected'
    assert steps.scheduler.num_preemptions >= 1, 'the pool was never short: no pressure'
    expected = {f"long{i}": "length" for i in range(4)} | {name: "length" for name in shorts}
    assert {rid: event.finish_reason for rid, event in finished.items()} == expected
    cache = steps.cache
    assert cache.kv_allocator.num_free_tokens + cache.radix.evictable_tokens() == 512
    assert cache.ssm_allocator.num_used == cache.radix.num_checkpoints
