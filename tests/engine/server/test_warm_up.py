"""factory.warm_up and compiling ahead (kernels/compile_ahead.py): on a GPU every warm-up pass up to the timing
passes is run dry first, none of the timed ones (a dry pass would price into the fitted cost), compiling ahead is
over and logged before /ready, and the server starts with an empty prefix cache (dry passes leave garbage in the
states the warm-up's prompts cached). The GPU is simulated: compiles_kernels on, and a stand-in for CompileAhead
that runs the dry passes it is handed."""

from __future__ import annotations

import logging

from tests.engine.helpers import RunsDryPasses


def test_warm_up_compiles_ahead_until_the_timed_passes_and_leaves_no_cached_prefix(tmp_path, monkeypatch, caplog):
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.loop.engine_loop import EngineLoop
    from headroom.engine.runtime.model_runner import ModelRunner
    from headroom.engine.server import factory
    from headroom.engine.server.factory import ServeOptions, build_state, warm_up

    ahead = RunsDryPasses()

    def start(runner: ModelRunner) -> int:
        runner.compile_ahead = ahead  # type: ignore[assignment]
        return ahead.report.threads

    monkeypatch.setattr(ModelRunner, "start_compile_ahead", start)
    monkeypatch.setattr(EngineLoop, "compiles_kernels", property(lambda self: True))
    dry_before_timing: list[int] = []
    real_sequence = factory.Sequence

    def sequence(name, *a, **k):
        if name.startswith("warmup-timing-"):
            dry_before_timing.append(ahead.report.dry_passes)
        return real_sequence(name, *a, **k)

    monkeypatch.setattr(factory, "Sequence", sequence)
    # cuDNN's plans first: they build holding no GIL while fla imports on its thread, which the capture waits for.
    order: list[str] = []
    plans, capture = ModelRunner.warm_attention_plans, EngineLoop.capture_decode_graphs
    monkeypatch.setattr(ModelRunner, "warm_attention_plans",
                        lambda self, *a, **k: (order.append("cudnn plans"), plans(self, *a, **k))[1])
    monkeypatch.setattr(EngineLoop, "capture_decode_graphs",
                        lambda self, *a, **k: (order.append("decode graphs"), capture(self, *a, **k))[1])
    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=1024,
                                     max_total_tokens=8192, chunked_prefill_size=128, max_running_requests=4,
                                     max_new_tokens=64))
    with caplog.at_level(logging.INFO, logger="headroom.engine.server.factory"):
        warm_up(state)
    try:
        assert state.ready.is_set() and state.warmup_error is None
        assert order == ["cudnn plans", "decode graphs"]
        assert ahead.report.dry_passes > 10
        assert dry_before_timing == [ahead.report.dry_passes] * 2
        assert state.loop.runner.compile_ahead is None
        logged = [r.getMessage() for r in caplog.records]
        assert f"start-up: {ahead.report.summary()}" in logged
        assert any(m.startswith("start-up: dropped the warm-up's ") for m in logged)
        radix = state.loop.steps.cache.radix
        assert radix is not None and radix.num_cached_tokens == 0 and radix.num_checkpoints == 0
        assert state.loop.steps.cache.kv_allocator.num_used_tokens == 0
    finally:
        state.loop.stop()


def test_a_bad_compile_thread_count_fails_the_warm_up_by_name(tmp_path, monkeypatch):
    """HEADROOM_COMPILE_THREADS=four on a GPU: the warm-up fails through its report (/health names it), the server
    is never ready, and the thread does not die with the error unreported."""
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.runtime.model_runner import ModelRunner
    from headroom.engine.server.factory import ServeOptions, build_state, warm_up
    from headroom.kernels.compile_ahead import compile_threads

    monkeypatch.setattr(ModelRunner, "start_compile_ahead",
                        lambda runner: compile_threads({"HEADROOM_COMPILE_THREADS": "four"}))
    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=1024,
                                     max_total_tokens=8192, chunked_prefill_size=128, max_running_requests=4,
                                     max_new_tokens=64))
    try:
        warm_up(state)
        assert not state.ready.is_set()
        assert state.warmup_error is not None
        assert "HEADROOM_COMPILE_THREADS='four' must be a whole number of threads, at least 1" in state.warmup_error
    finally:
        state.loop.stop()
