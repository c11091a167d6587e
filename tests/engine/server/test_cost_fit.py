"""The warm-up's pass-cost fit (server/factory.py): the first full chunk compiles the kernels and must not set
the prefill rate, or the pass-time bound cuts every later chunk (seen on a cold H200)."""

from __future__ import annotations

import pytest
from headroom.engine.loop.step import StepStats
from headroom.engine.server.factory import fit_cost_model


def test_the_compiling_pass_does_not_set_the_rate():
    timings = [StepStats(seconds=9.5, num_prefill_tokens=8192, num_decodes=1),  # compiles
               StepStats(seconds=0.284, num_prefill_tokens=8192, num_decodes=1),
               StepStats(seconds=0.02, num_prefill_tokens=1, num_decodes=1),
               StepStats(seconds=0.006, num_prefill_tokens=0, num_decodes=1),
               StepStats(seconds=0.004, num_prefill_tokens=0, num_decodes=1)]
    model = fit_cost_model(timings)
    assert model.fixed_s == pytest.approx(0.004)
    assert model.prefill_tokens_per_s == pytest.approx(8192 / 0.28)
    # An 8,192-token pass fits a 1 s bound: the bound does not bind on this GPU.
    assert model.prefill_tokens_within(1.0, 0) >= 8192


def test_small_passes_do_not_set_the_rate():
    """A 1-token pass's overhead is not a rate: only passes of at least half the biggest one's tokens count."""
    timings = [StepStats(seconds=0.5, num_prefill_tokens=4096, num_decodes=0),
               StepStats(seconds=0.0041, num_prefill_tokens=1, num_decodes=1),
               StepStats(seconds=0.004, num_prefill_tokens=0, num_decodes=1)]
    assert fit_cost_model(timings).prefill_tokens_per_s == pytest.approx(4096 / 0.496)


def test_a_mid_sized_pass_gives_the_marginal_rate_and_the_eager_overhead():
    """H200, session 5: a lone 2,048-token pass took 77 ms (launch-bound) and an 8,192-token one 165 ms, against a
    4 ms graphed decode. Through the decode's fixed cost alone the rate came out at 28K tokens/s; the marginal
    rate and the eager pass's own overhead predict both passes."""
    timings = [StepStats(seconds=0.077, num_prefill_tokens=2048, num_decodes=0),
               StepStats(seconds=0.165, num_prefill_tokens=8192, num_decodes=0),
               StepStats(seconds=0.004, num_prefill_tokens=0, num_decodes=1)]
    model = fit_cost_model(timings, marginal=True)
    assert model.prefill_tokens_per_s == pytest.approx(6144 / 0.088)
    assert model.pass_seconds(2048, 0) == pytest.approx(0.077)
    assert model.pass_seconds(8192, 0) == pytest.approx(0.165)
    assert model.pass_seconds(0, 1) == pytest.approx(0.004)
    # A 100 ms bound gets what the line between the two passes gives (3,653 tokens); the 8K pass alone through
    # the decode's fixed cost would allow 4,885, a pass of about 116 ms.
    assert model.prefill_tokens_within(0.1, 0) == 3653
    # A small pass that is not launch-bound (no overhead beyond the decode's) keeps the plain fit.
    plain = fit_cost_model([StepStats(seconds=0.040, num_prefill_tokens=2048, num_decodes=0), *timings[1:]],
                           marginal=True)
    # A CPU's warm-up passes (mixed batches, stops) keep the plain fit whatever their sizes.
    assert fit_cost_model(timings).prefill_fixed_s == 0
    assert plain.prefill_fixed_s == 0 and plain.prefill_tokens_per_s == pytest.approx(8192 / 0.161)


def test_on_a_gpu_the_fit_uses_clean_timed_passes(tmp_path, monkeypatch):
    """warm_up on a device that compiles kernels fits the pass cost on two timed passes run after everything
    has compiled, never on the warm-up's own (compiling) prefills; on a CPU it fits the warm-up's passes."""
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.loop.engine_loop import EngineLoop
    from headroom.engine.server import factory
    from headroom.engine.server.factory import ServeOptions, build_state, warm_up

    model = str(ensure_default_model(tmp_path / "m"))
    seen: list[list[StepStats]] = []
    names: list[list[str]] = []
    real_sequence = factory.Sequence
    declined: list[str] = []

    def sequence(name, *a, **k):
        names[-1].append(name)
        if not k.get("take_checkpoints", True):
            declined.append(name)
        return real_sequence(name, *a, **k)

    monkeypatch.setattr(factory, "Sequence", sequence)
    real_fit = factory.fit_cost_model
    monkeypatch.setattr(factory, "fit_cost_model", lambda timings, **kw: seen.append(list(timings)) or real_fit(timings, **kw))
    # The GEMV table's row counts the lone prompts miss (kernels/gemv.py warm_up_rows; none on a CPU) run alone too.
    from headroom.engine.runtime.model_runner import ModelRunner

    asked: list[tuple[int, ...]] = []
    monkeypatch.setattr(ModelRunner, "gemv_warm_up_lengths", lambda self, already: asked.append(already) or (2, 9))
    # And batches of sequences for the LM head's (it runs on one row a sequence).
    batches: list[tuple[int, ...]] = []
    monkeypatch.setattr(ModelRunner, "gemv_warm_up_batches", lambda self, already: batches.append(already) or (3,))
    for gpu in (False, True):
        monkeypatch.setattr(EngineLoop, "compiles_kernels", property(lambda self, gpu=gpu: gpu))
        names.append([])
        state = build_state(ServeOptions(model=model, context_length=1024, max_total_tokens=8192,
                                         chunked_prefill_size=128, max_running_requests=4, max_new_tokens=64))
        warm_up(state)
        assert state.ready.is_set()
        state.loop.stop()
    cpu, gpu_fit = seen
    prefill_sizes = {t.num_prefill_tokens for t in gpu_fit if t.num_prefill_tokens}
    # Chunk 128 < TIMING_PASS_TOKENS: each timed pass is one full chunk of a fresh prompt, alone.
    assert prefill_sizes == {128} and sum(1 for t in gpu_fit if t.num_prefill_tokens) == 2
    assert any(t.num_prefill_tokens == 0 and t.num_decodes for t in gpu_fit)
    assert len([t for t in cpu if t.num_prefill_tokens]) > 2
    # On the GPU the lone prompts (every length under the long warm-up prompt's 2 x 128 + 1 tokens) and one batch
    # of short prompts together (max_running_requests=4 of them) ran too; a CPU compiles nothing and skips them.
    alone = [n for n in names[1] if n.startswith("warmup-alone-")]
    assert alone == [f"warmup-alone-{n}" for n in sorted({*factory.WARMUP_ALONE_PROMPTS, 2, 9}) if n < 257]
    assert len(alone) >= 8 and asked == [tuple(n for n in factory.WARMUP_ALONE_PROMPTS if n < 257)]
    assert [n for n in names[1] if n.startswith("warmup-batch")] == [f"warmup-batch3-{i}" for i in range(3)]
    assert batches == [(4,)]  # after the four prompts together
    assert sum(n.startswith("warmup-together-") for n in names[1]) == 4
    assert not any(n.startswith(("warmup-alone-", "warmup-together-")) for n in names[0])
    # The timed passes take no checkpoint stops (the rounds between stops would price into the rate).
    assert declined == ["warmup-timing-0", "warmup-timing-1"]


def test_on_a_gpu_the_timed_passes_are_a_mid_sized_one_and_a_full_chunk(tmp_path, monkeypatch):
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.loop.engine_loop import EngineLoop
    from headroom.engine.server import factory
    from headroom.engine.server.factory import ServeOptions, build_state, warm_up

    seen: list[list[StepStats]] = []
    real_fit = factory.fit_cost_model
    monkeypatch.setattr(factory, "fit_cost_model", lambda timings, **kw: seen.append(list(timings)) or real_fit(timings, **kw))
    monkeypatch.setattr(factory, "TIMING_PASS_TOKENS", 48)
    monkeypatch.setattr(EngineLoop, "compiles_kernels", property(lambda self: True))
    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=1024,
                                     max_total_tokens=8192, chunked_prefill_size=128, max_running_requests=4,
                                     max_new_tokens=64))
    warm_up(state)
    assert state.ready.is_set()
    state.loop.stop()
    assert sorted(t.num_prefill_tokens for t in seen[0] if t.num_prefill_tokens) == [48, 128]


def test_an_itl_target_below_one_decode_pass_is_named_at_start_up(tmp_path, caplog):
    import logging

    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.server.factory import ServeOptions, build_state, warm_up

    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=512,
                                     max_total_tokens=4096, chunked_prefill_size=128, max_running_requests=4,
                                     max_new_tokens=64, itl_target_ms=0.001))
    with caplog.at_level(logging.WARNING, logger="headroom.engine.server.factory"):
        warm_up(state)
    state.loop.stop()
    warned = [r.getMessage() for r in caplog.records if "ITL target" in r.getMessage()]
    assert warned and "below one decode pass of 4 requests" in warned[0]
