"""The engine loop under failure: one bad request or one failed pass never takes the others (or the thread) down,
and a failed pass never leaves its half-updated state in the prefix cache."""

from __future__ import annotations

import threading
import time

import pytest
from headroom.engine.default_model import ensure_default_model
from headroom.engine.loop.step import TokenEvent
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.factory import ServeOptions, build_state


@pytest.fixture
def state(tmp_path):
    return build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=512,
                                    max_total_tokens=2048, chunked_prefill_size=64, max_running_requests=4,
                                    max_new_tokens=32))


def _capture(loop) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {}
    lock = threading.Lock()

    def emit(request_id: str, event: TokenEvent) -> None:
        with lock:
            events.setdefault(request_id, []).append(event)

    loop.steps.emit = emit
    return events


def _finish(events, request_id: str) -> str | None:
    return next((e.finish_reason for e in events.get(request_id, []) if e.finish_reason), None)


def _decoding(name: str, max_new: int = 12, **sampling) -> Sequence:
    return Sequence(name, [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=max_new, ignore_eos=True, **sampling))


def test_a_client_seed_beyond_64_bits_does_not_fail_the_batch(state):
    loop = state.loop
    events = _capture(loop)
    loop.steps.add(_decoding("innocent"), frozenset())
    loop.steps.add(_decoding("epoch-ns-seed", temperature=1.0, seed=time.time_ns()), frozenset())
    loop.steps.add(_decoding("huge-seed", temperature=0.7, top_p=0.9, seed=2**200), frozenset())
    loop.run_until_idle()
    assert {rid: _finish(events, rid) for rid in events} == {
        "innocent": "length", "epoch-ns-seed": "length", "huge-seed": "length"}


def test_a_failed_decode_pass_publishes_nothing_and_leaks_nothing(state):
    loop = state.loop
    steps, cache = loop.steps, loop.steps.cache
    events = _capture(loop)
    loop.steps.add(_decoding("victim", max_new=20), frozenset())
    while not any(s.output_token_ids and len(s.output_token_ids) >= 4 for s in steps.sequences.values()):
        steps.step()
    assert cache.radix is not None and cache.ssm_allocator is not None and steps.runner.ssm_pool is not None
    cached_before, checkpoints_before = cache.radix.num_cached_tokens, cache.radix.num_checkpoints
    pool = steps.runner.ssm_pool

    def corrupt_then_fail(batch, all_positions=False):
        # Some layers ran (their SSM state moved) before the pass failed.
        for item in batch:
            pool.recurrent[:, item.seq.ssm_slot] += 1.0
        raise RuntimeError("CUDA out of memory (simulated)")

    steps.runner.forward = corrupt_then_fail
    steps.step()
    assert _finish(events, "victim") == "error"
    assert not steps.scheduler.has_work
    # The half-updated state was not adopted as a checkpoint, nor its tokens published.
    assert (cache.radix.num_cached_tokens, cache.radix.num_checkpoints) == (cached_before, checkpoints_before)
    assert cache.ssm_allocator.num_used == cache.radix.num_checkpoints
    assert cache.kv_allocator.num_used_tokens == cache.radix.num_cached_tokens


def test_the_engine_thread_survives_a_failed_step_whose_abort_fails_too(state):
    loop = state.loop
    steps = loop.steps
    events = _capture(loop)
    steps.add(_decoding("first"), frozenset())
    real_step, real_abort = steps.step, steps.abort
    failures = {"step": 1, "abort": 1}

    def failing_step():
        if failures["step"]:
            real_step()
            failures["step"] -= 1
            raise RuntimeError("bug in a pass")
        return real_step()

    def failing_abort(request_id, reason="abort", error=None):
        if failures["abort"]:
            failures["abort"] -= 1
            raise RuntimeError("bug in abort")
        real_abort(request_id, reason, error)

    steps.step, steps.abort = failing_step, failing_abort
    loop.start()
    try:
        deadline = time.monotonic() + 20
        while _finish(events, "first") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _finish(events, "first") == "error"
        loop._inbox.put(("add", (_decoding("second"), frozenset())))
        loop._wake.set()
        while _finish(events, "second") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _finish(events, "second") == "length"
        assert loop._thread is not None and loop._thread.is_alive()
    finally:
        loop.stop()


def test_a_short_request_is_admitted_while_long_prefills_hold_their_checkpoints(tmp_path):
    """Four long prompts checkpoint at their stops and pin those checkpoints (their paths are locked); a
    30-token question arriving mid-prefill still gets an SSM slot at once and its first token long before
    the long prompts finish (it waited for them on the H200, docs/gpu.md)."""
    # The even split keeps all four prefilling at once, each pinning its checkpoints (short_first would
    # run them one after another).
    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=4096,
                                     chunked_prefill_size=512, max_running_requests=8, max_new_tokens=64,
                                     policy="fair"))
    loop = state.loop
    events = _capture(loop)
    for i in range(4):
        prompt = [(7 * j + i) % 200 + 5 for j in range(2000)]
        loop.steps.add(Sequence(f"long{i}", prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)), frozenset())
    for _ in range(20):
        loop.steps.step()
    cache = loop.steps.cache
    # 64 tokens each a pass (the contended cap) for 20 passes: each has passed its chunk checkpoint at 1024.
    assert cache.ssm_allocator is not None and cache.radix is not None and cache.radix.num_checkpoints >= 4
    loop.steps.add(Sequence("question", [9] * 30, SamplingParams(max_new_tokens=2, ignore_eos=True)), frozenset())
    assert "question" in loop.steps.step().admitted
    loop.steps.step()
    assert events.get("question") and events["question"][0].token_ids
    assert not any(events.get(f"long{i}") for i in range(4))


def test_a_scheduler_running_more_than_the_engine_holds_is_refused(state):
    """The runner keeps per-request state for EngineConfig.max_running_requests requests (SSM slots, KIVI window
    rows, graph table rows): a scheduler allowed more is refused with both numbers."""
    from dataclasses import replace

    from headroom.engine.loop.step import StepRunner

    steps = state.loop.steps
    with pytest.raises(ValueError, match=r"scheduler max_running_requests=5 exceeds the engine's 4"):
        StepRunner(steps.runner, replace(steps.scheduler.config, max_running_requests=5), steps.emit)


def test_events_pushed_together_wake_the_event_loop_once_and_keep_their_order(monkeypatch):
    """RequestStream's hand-off (engine_loop._Outbox): a step's events for many requests go over in one
    call_soon_threadsafe, each queue gets its events in order, and a push after a delivery schedules another."""
    import asyncio

    from headroom.engine.loop.engine_loop import RequestStream
    from headroom.engine.loop.step import TokenEvent

    loop = asyncio.new_event_loop()
    scheduled = []
    real = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda fn, *a: scheduled.append(fn) or real(fn, *a))
    streams = [RequestStream(loop, asyncio.Queue()) for _ in range(3)]
    for step in range(2):
        for index, stream in enumerate(streams):
            stream.push(TokenEvent([10 * index + step]))
    assert len(scheduled) == 1
    loop.run_until_complete(asyncio.sleep(0))
    assert [[s.events.get_nowait().token_ids for _ in range(2)] for s in streams] == [[[0], [1]], [[10], [11]],
                                                                                      [[20], [21]]]
    streams[0].push(TokenEvent([], "length"))
    assert len(scheduled) == 2
    loop.run_until_complete(asyncio.sleep(0))
    assert streams[0].events.get_nowait().finish_reason == "length"
    loop.close()
