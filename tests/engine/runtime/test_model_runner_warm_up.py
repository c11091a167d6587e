"""ModelRunner's answers to the warm-up about the GEMV table (kernels/gemv.py warm_up_rows): lone prompts cover every
shape but the LM head, with the prompts already run and the captured decode graphs counted in; batches cover the LM
head alone (it runs on one row a sequence), up to max_running_requests sequences."""

from __future__ import annotations

from headroom.engine.config import EngineConfig
from headroom.engine.runtime.model_runner import ModelRunner


def test_lone_prompts_leave_the_lm_head_to_batches(tiny_model_factory, monkeypatch):
    from headroom.kernels import gemv

    model_dir, _ = tiny_model_factory("qwen3", 0)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=128, max_running_requests=12))
    asked: list = []
    monkeypatch.setattr(gemv, "warm_up_rows", lambda device, already, keep=None, most=16:
                        asked.append((already, keep, most)) or (5,))
    head = tuple(runner.model.lm_head.shape)
    other = (head[0] + 1, head[1])
    assert runner.decode_graphs is None  # a CPU: no graphs, no captured sizes
    assert runner.gemv_warm_up_lengths((1, 3, 7)) == (5,)
    assert asked[-1][0] == (1, 3, 7) and asked[-1][2] == 16

    class Captured:
        captured_sizes = (1, 2, 3, 4)

    runner.decode_graphs = Captured()  # type: ignore[assignment]
    assert runner.gemv_warm_up_lengths((1, 3, 7)) == (5,)
    already, keep, most = asked[-1]
    assert already == (1, 3, 7, 1, 2, 3, 4) and most == 16 and not keep(*head) and keep(*other)
    assert runner.gemv_warm_up_batches((8,)) == (5,)
    already, keep, most = asked[-1]
    # A lone prompt's LM head runs on one row; the graphs' decode steps on one row a sequence.
    assert already == (1, 8, 1, 2, 3, 4) and most == 12 and keep(*head) and not keep(*other)
