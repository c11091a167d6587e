"""Overlapped decode (engine/loop/in_flight.py, StepRunner._advance) against the same requests read step by step.

On the CPU the decode graphs run their static-buffer pass uncaptured, so the overlapped path (each step launched
on the previous step's tokens before the host has read them) runs here exactly as on the GPU, bar the asynchrony.
Every request must end with the same tokens and finish reason either way: stops on a token read after the next
step was launched, seeded sampling, arrivals that break the chain, aborts of a request in flight; and the caches
must end in the same state (pages, SSM slots, graph table rows, what the prefix cache hands a follow-up).
"""

from __future__ import annotations

import random

import pytest
from headroom.engine.default_model import ensure_default_model
from headroom.engine.loop.step import TokenEvent
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.factory import ServeOptions, build_state


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("overlap") / "m")


def _state(model_dir, overlap: bool):
    state = build_state(ServeOptions(model=str(model_dir), context_length=256, max_total_tokens=2048,
                                     chunked_prefill_size=64, max_running_requests=4, max_new_tokens=64,
                                     cuda_graph_max_batch=4))
    steps = state.loop.steps
    assert state.loop.runner.decode_graphs is not None
    steps.overlap = overlap
    chained = []
    forward = state.loop.runner.forward

    def counting(items, all_positions=False, between_layers=None, tokens_on_device=None):
        chained.append(tokens_on_device is not None)
        return forward(items, all_positions, between_layers, tokens_on_device)

    state.loop.runner.forward = counting
    return state, chained


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def _run(model_dir, overlap: bool, stop_token: int | None = None, abort_at: int | None = None):
    """r0 greedy, r1 greedy with a stop token, r2 seeded sampling, r3 arriving mid-run; r0 aborted at step
    abort_at. Returns (per request: tokens, finish reason), the chained-launch flags, the state."""
    state, chained = _state(model_dir, overlap)
    steps = state.loop.steps
    events: dict[str, list[TokenEvent]] = {}
    steps.emit = lambda rid, event: events.setdefault(rid, []).append(event)
    stops = (stop_token,) if stop_token is not None else ()
    steps.add(Sequence("r0", _prompt(0, 40), SamplingParams(max_new_tokens=30, ignore_eos=True)), frozenset())
    steps.add(Sequence("r1", _prompt(1, 21), SamplingParams(max_new_tokens=25, ignore_eos=True, stop_token_ids=stops)),
              frozenset())
    steps.add(Sequence("r2", _prompt(2, 9), SamplingParams(max_new_tokens=18, temperature=0.9, top_p=0.8, seed=5,
                                                          ignore_eos=True)), frozenset())
    # Steps counted in emitted tokens of r0, so both modes act at the same point of r0's output.
    arrived = False
    while steps.has_work:
        steps.step()
        produced = sum(len(e.token_ids) for e in events.get("r0", []))
        if not arrived and produced >= 6:
            steps.add(Sequence("r3", _prompt(3, 70), SamplingParams(max_new_tokens=11, ignore_eos=True)), frozenset())
            arrived = True
        if abort_at is not None and produced >= abort_at and "r0" in steps.sequences:
            steps.abort("r0")
    ended = {rid: ([t for e in evs for t in e.token_ids], evs[-1].finish_reason) for rid, evs in events.items()}
    return ended, chained, state


def _cache_state(state) -> tuple:
    runner, cache = state.loop.runner, state.loop.steps.cache
    return (runner.kv_allocator.num_free_tokens, cache.ssm_allocator.num_free if cache.ssm_allocator else None,
            runner.decode_graphs.leased_rows)


def test_overlapped_decode_gives_the_tokens_of_step_by_step_decode(model_dir):
    plain, plain_chained, plain_state = _run(model_dir, overlap=False)
    # r1 stops on its 7th token: read only after its next step was launched (overlapped).
    stop = plain["r1"][0][6]
    plain, _, plain_state = _run(model_dir, overlap=False, stop_token=stop)
    overlapped, chained, state = _run(model_dir, overlap=True, stop_token=stop)
    assert not any(plain_chained)
    assert sum(chained) >= 20, "the overlapped run hardly chained a step"
    assert overlapped == plain
    assert plain["r1"][1] == "stop" and len(plain["r1"][0]) <= 7
    assert {rid: reason for rid, (_, reason) in plain.items()} == {"r0": "length", "r1": "stop", "r2": "length",
                                                                 "r3": "length"}
    assert _cache_state(state) == _cache_state(plain_state)
    # What each run published: a follow-up repeating r0's conversation hits the same prefix.
    for run_state in (plain_state, state):
        steps = run_state.loop.steps
        seen: list[TokenEvent] = []
        steps.emit = lambda rid, event, seen=seen: seen.append(event)
        steps.add(Sequence("again", _prompt(0, 40) + plain["r0"][0], SamplingParams(max_new_tokens=3, ignore_eos=True)),
                  frozenset())
        while steps.has_work:
            steps.step()
        assert seen[-1].finish_reason == "length"
    assert plain_state.loop.steps.cache.stats.__dict__ == state.loop.steps.cache.stats.__dict__


def test_a_request_aborted_in_flight_ends_once_and_frees_everything(model_dir):
    plain, _, plain_state = _run(model_dir, overlap=False, abort_at=9)
    overlapped, chained, state = _run(model_dir, overlap=True, abort_at=9)
    assert any(chained)
    assert overlapped["r0"][1] == plain["r0"][1] == "abort"
    # The abort lands between two steps: the overlapped run may have read one step fewer of r0 by then, never more.
    assert plain["r0"][0][: len(overlapped["r0"][0])] == overlapped["r0"][0]
    assert {k: v for k, v in overlapped.items() if k != "r0"} == {k: v for k, v in plain.items() if k != "r0"}
    assert _cache_state(state) == _cache_state(plain_state)
    assert not state.loop.steps.sequences and not state.loop.steps.has_work


def test_the_library_api_overlapped_gives_the_tokens_of_step_by_step_decode(model_dir):
    from headroom.engine.llm import LLM

    prompts = [_prompt(seed, n) for seed, n in ((4, 30), (5, 12), (6, 50))]
    runs = []
    for overlap in (False, True):
        llm = LLM(str(model_dir), max_total_tokens=1024, ssm_slots=8, chunked_prefill_size=16, max_running_requests=4,
                  context_length=256, cuda_graph_max_batch=4)
        llm.overlap = overlap
        chained = []
        forward = llm.runner.forward

        def counting(items, all_positions=False, between_layers=None, tokens_on_device=None, forward=forward,
                     chained=chained):
            chained.append(tokens_on_device is not None)
            return forward(items, all_positions, between_layers, tokens_on_device)

        llm.runner.forward = counting
        greedy = llm.generate(prompts, max_new_tokens=13, ignore_eos=True)
        stop = greedy[1].token_ids[4]
        stopped = llm.generate(prompts, max_new_tokens=13, stop_token_ids=(stop,), ignore_eos=True)
        sampled = llm.generate(prompts, max_new_tokens=9, temperature=1.0, seed=11, ignore_eos=True)
        runs.append(([g.token_ids for g in greedy + stopped + sampled], any(chained), llm.runner.kv_allocator.num_free_tokens,
                     llm.runner.decode_graphs.leased_rows))
    assert runs[0][1] is False and runs[1][1] is True
    assert runs[0][0] == runs[1][0]
    assert runs[0][2:] == runs[1][2:]
    assert len(runs[1][0][4]) == 5  # the second prompt stopped on its 5th token
