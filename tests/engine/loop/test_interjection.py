"""Interjected passes on the real engine (CPU, the demo's tiny hybrid model): a short request that arrives during a
long pass runs between its layers, both requests' tokens equal their solo runs, and aborts wait for the pass."""

from __future__ import annotations

import asyncio
import random

import pytest
from headroom.engine.default_model import ensure_default_model
from headroom.engine.loop.engine_loop import RequestStream
from headroom.engine.loop.step import TokenEvent
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.factory import ServeOptions, build_state

CHUNK = 64  # short_limit = 16: a 64-token chunk is interruptible, a 9-token question is short


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("interjection") / "m")


def make_loop(model_dir, **options):
    state = build_state(ServeOptions(model=str(model_dir), context_length=512, max_total_tokens=2048,
                                     chunked_prefill_size=CHUNK, max_running_requests=4, max_new_tokens=16, **options))
    return state.loop


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def request(name: str, seed: int, length: int, new_tokens: int = 6) -> Sequence:
    return Sequence(name, prompt(seed, length), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


def record(loop) -> list[tuple[str, TokenEvent, int]]:
    """Every event with the long request's computed tokens at that moment (a pass advances them at its end)."""
    log: list[tuple[str, TokenEvent, int]] = []

    def emit(request_id: str, event: TokenEvent) -> None:
        long = loop.steps.sequences.get("long")
        log.append((request_id, event, long.num_computed_tokens if long is not None else -1))

    loop.steps.emit = emit
    return log


def tokens(log, request_id: str) -> list[int]:
    return [t for rid, event, _ in log if rid == request_id for t in event.token_ids]


def stream() -> RequestStream:
    return RequestStream(asyncio.new_event_loop(), asyncio.Queue())


def arrive_at_first_boundary(loop, seq: Sequence) -> None:
    """seq is submitted when the engine first polls for arrivals between two layers."""
    arrived: list[bool] = []
    poll = loop.steps.poll_arrivals

    def arrive_once() -> bool:
        if not arrived:
            arrived.append(True)
            loop.submit(seq, frozenset(), stream())
        return poll()

    loop.steps.poll_arrivals = arrive_once


def solo(model_dir, seq: Sequence) -> list[int]:
    loop = make_loop(model_dir)
    log = record(loop)
    loop.steps.add(seq, frozenset())
    loop.run_until_idle()
    return tokens(log, seq.request_id)


def test_a_question_arriving_mid_pass_is_answered_inside_that_pass(model_dir):
    loop = make_loop(model_dir)
    log = record(loop)
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    arrive_at_first_boundary(loop, request("question", 2, 9))
    stats = loop._step()
    # The first long chunk's pass ran the question's whole prefill between two of its layers.
    assert [inner.admitted for inner in stats.interjected] == [["question"]]
    assert stats.interjected[0].num_prefill_tokens == 9 and stats.num_prefill_tokens == CHUNK
    first = next(i for i, (rid, _, _) in enumerate(log) if rid == "question")
    assert log[first][2] == 0, "the question's first token came before the long pass ended"
    assert loop.steps.sequences["long"].num_computed_tokens == CHUNK
    loop.run_until_idle()
    assert tokens(log, "long") == solo(model_dir, request("long", 1, 3 * CHUNK))
    assert tokens(log, "question") == solo(model_dir, request("question", 2, 9))
    assert [e.finish_reason for rid, e, _ in log if e.finish_reason] == ["length", "length"]
    cache = loop.steps.cache
    assert cache.kv_allocator.num_used_tokens == cache.radix.num_cached_tokens


@pytest.mark.parametrize("options", [{"interject_short": False}, {"policy": "fair"}, {"strict_fcfs": True}])
def test_no_interjection_when_switched_off_or_under_the_other_policies(model_dir, options):
    loop = make_loop(model_dir, **options)
    record(loop)
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    loop.submit(request("question", 2, 9), frozenset(), stream())
    polled = []
    loop.steps.poll_arrivals = lambda: polled.append(True) or False
    stats = loop._step()
    assert not stats.interjected and not polled


def test_an_abort_arriving_mid_pass_waits_for_the_pass_to_end(model_dir):
    loop = make_loop(model_dir)
    log = record(loop)
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    # While the long request's first pass runs, a question arrives and the long request's client goes away.
    loop.submit(request("question", 2, 9), frozenset(), stream())
    loop.abort("long")
    stats = loop._step()
    # The pass finished its chunk (nothing was freed under it) and interjected the question; the abort waited.
    assert [inner.admitted for inner in stats.interjected] == [["question"]]
    assert loop.steps.sequences["long"].num_computed_tokens == CHUNK
    loop.drain_inbox()
    assert "long" not in loop.steps.sequences
    assert [(rid, e.finish_reason) for rid, e, _ in log if e.finish_reason] == [("long", "abort")]
    loop.run_until_idle()
    assert tokens(log, "question") == solo(model_dir, request("question", 2, 9))


def test_a_runner_that_cannot_be_interrupted_is_not(model_dir, monkeypatch):
    """Tensor parallel: the other ranks run the pass they were sent in lockstep (ModelRunner.supports_interjection)."""
    from headroom.engine.runtime.model_runner import ModelRunner

    loop = make_loop(model_dir)
    record(loop)
    monkeypatch.setattr(ModelRunner, "supports_interjection", property(lambda self: False))
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    loop.submit(request("question", 2, 9), frozenset(), stream())
    stats = loop._step()
    assert not stats.interjected and [r.request_id for r in loop.scheduler.waiting] == []
    assert loop.steps.sequences["long"].num_computed_tokens == CHUNK


def test_the_hook_runs_between_every_two_layers_and_the_logits_do_not_change(model_dir):
    import torch
    from headroom.engine.runtime.forward_batch import BatchItem

    logits, calls = [], []
    for hook in (None, lambda: calls.append(True)):
        steps = make_loop(model_dir).steps
        seq = request("long", 1, CHUNK)
        steps.add(seq, frozenset())
        plan = steps.scheduler.schedule()
        steps._admit(plan, plan.admitted[0])
        assert steps._reserve(plan, plan.items[0])
        logits.append(steps.runner.forward([BatchItem(seq, seq.tokens_between(0, CHUNK), ())], between_layers=hook))
    assert len(calls) == steps.runner.model_config.num_layers - 1
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_decode_steps_interjected_into_a_long_pass_keep_the_chats_tokens(model_dir):
    """With an ITL target a long pass carries no decodes; steps between its layers advance them (every boundary
    here: the target is far below any pass), and every token equals the request's solo run."""
    loop = make_loop(model_dir, itl_target_ms=0.001)
    log = record(loop)
    chats = [request(f"chat{k}", 10 + k, 5, new_tokens=12) for k in range(2)]
    for chat in chats:
        loop.steps.add(chat, frozenset())
    loop._step()  # both chats prefill and take their first token
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    stats = loop._step()
    layers = loop.steps.runner.model_config.num_layers
    assert stats.num_decodes == 0 and stats.num_prefill_tokens == CHUNK
    assert [inner.num_decodes for inner in stats.interjected] == [2] * (layers - 1)
    assert all(len(seq.output_token_ids) == layers for seq in chats)
    loop.run_until_idle()
    for seq in chats:
        assert tokens(log, seq.request_id) == solo(model_dir, request(seq.request_id, 10 + int(seq.request_id[-1]), 5,
                                                                      new_tokens=12))
    assert tokens(log, "long") == solo(model_dir, request("long", 1, 3 * CHUNK))


def test_a_failure_while_planning_an_interjection_fails_neither_pass_nor_request(model_dir):
    loop = make_loop(model_dir)
    log = record(loop)
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    loop.submit(request("question", 2, 9), frozenset(), stream())
    real = loop.steps.scheduler.schedule_interjection

    def broken(outer, spent_s=0.0):
        raise RuntimeError("planning bug (simulated)")

    loop.steps.scheduler.schedule_interjection = broken
    stats = loop._step()
    assert not stats.interjected and loop.steps.sequences["long"].num_computed_tokens == CHUNK
    # The question arrived (poll took it in) and waits for a normal pass; nothing was half-admitted.
    assert [r.request_id for r in loop.scheduler.waiting] == ["question"]
    loop.steps.scheduler.schedule_interjection = real
    loop.run_until_idle()
    assert [e.finish_reason for _, e, _ in log if e.finish_reason] == ["length", "length"]
    assert tokens(log, "question") == solo(model_dir, request("question", 2, 9))


def test_a_failure_after_an_interjected_pass_ran_fails_only_its_request(model_dir):
    loop = make_loop(model_dir)
    log = record(loop)
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    loop.submit(request("question", 2, 9, new_tokens=1), frozenset(), stream())
    runner = loop.steps.runner
    real_release = runner.release

    def release(seq):
        real_release(seq)
        if seq.request_id == "question":
            raise RuntimeError("release bug (simulated)")

    runner.release = release
    stats = loop._step()
    assert stats.interjected_s > 0 and loop.steps.sequences["long"].num_computed_tokens == CHUNK
    runner.release = real_release
    loop.run_until_idle()
    finishes = {rid: e.finish_reason for rid, e, _ in log if e.finish_reason}
    assert finishes["long"] == "length" and "question" not in loop.steps.sequences
    assert tokens(log, "long") == solo(model_dir, request("long", 1, 3 * CHUNK))


def test_metrics_count_the_interjected_passes_once(model_dir):
    from headroom.engine.server.metrics import EngineMetrics

    loop = make_loop(model_dir)
    record(loop)
    metrics = EngineMetrics(with_gpu=False)
    loop.on_step = metrics.observe_step
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    loop.submit(request("question", 2, 9), frozenset(), stream())
    loop._step()
    assert metrics.registry.get_sample_value("headroom_interjected_passes_total") == 1
    assert metrics.registry.get_sample_value("headroom_forward_passes_total") == 2


def test_decodes_ride_in_the_pass_when_no_step_can_be_interjected(model_dir, monkeypatch):
    """Tensor parallel with an ITL target: the scheduler defers the decodes, but no hook can step them."""
    from headroom.engine.runtime.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "supports_interjection", property(lambda self: False))
    loop = make_loop(model_dir, itl_target_ms=0.001)
    record(loop)
    assert not loop.scheduler.config.interject_short
    chats = [request(f"chat{k}", 10 + k, 5, new_tokens=12) for k in range(2)]
    for chat in chats:
        loop.steps.add(chat, frozenset())
    loop._step()
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    stats = loop._step()
    assert stats.num_decodes == 2 and not stats.interjected
    assert all(len(seq.output_token_ids) == 2 for seq in chats)


def test_a_question_interjected_into_a_pass_without_decodes_gets_decode_steps_in_it(model_dir):
    """The long pass carried no decode (none was running), so it deferred none; the question it interjected
    decodes from its first token on, and with an ITL target its next tokens are stepped between the long pass's
    layers too, not held until the pass ends. Tokens equal the solo runs."""
    loop = make_loop(model_dir, itl_target_ms=0.001)
    log = record(loop)
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    arrive_at_first_boundary(loop, request("question", 2, 9, new_tokens=12))
    stats = loop._step()
    assert stats.num_decodes == 0
    assert stats.interjected[0].admitted == ["question"]
    assert [inner.num_decodes for inner in stats.interjected[1:]] == [1] * len(stats.interjected[1:])
    inside = [e for rid, e, computed in log if rid == "question" and computed == 0]
    assert len(inside) >= 2, "the question's second token came inside the long pass"
    loop.run_until_idle()
    assert tokens(log, "question") == solo(model_dir, request("question", 2, 9, new_tokens=12))
    assert tokens(log, "long") == solo(model_dir, request("long", 1, 3 * CHUNK))


def test_the_runner_bounds_its_lead_by_the_configured_lag(model_dir, monkeypatch):
    """An interruptible pass's hook is wrapped by bounded_lag with the runner's lag (what --interjection-lag
    sets through EngineLoop.set_interjection_lag, which refuses anything below one layer)."""
    from headroom.engine.runtime import model_runner

    loop = make_loop(model_dir)
    loop.set_interjection_lag(5)
    seen = []
    real = model_runner.bounded_lag
    monkeypatch.setattr(model_runner, "bounded_lag", lambda hook, device, lag: seen.append(lag) or real(hook, device, lag))
    loop.steps.add(request("long", 1, 3 * CHUNK), frozenset())
    loop._step()
    assert seen == [5]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="interjection lag"):
            loop.set_interjection_lag(bad)
