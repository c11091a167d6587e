"""ModelRunner with compile ahead on (kernels/compile_ahead.py, the warm-up's): every eager pass is handed to it
as a dry pass first, on a batch of its own, and a new sequence's SSM state is zeroed after the dry pass, so its
real pass computes what it would have without one. On the CPU the dry pass computes for real (it writes the
sequence's SSM state as a GPU dry pass writes garbage there), which is what makes the order visible here."""

from __future__ import annotations

import pytest
import torch
from headroom.engine.config import EngineConfig
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.model_runner import ModelRunner

from tests.engine.helpers import RunsDryPasses, new_sequence, random_prompt


def _runner(model_dir, graph_batch: int = 0) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=128, ssm_slots=4,
                                    max_running_requests=2, cuda_graph_max_batch=graph_batch))


def test_off_on_a_cpu(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    runner = _runner(model_dir)
    assert runner.start_compile_ahead() == 0 and runner.compile_ahead is None
    assert runner.stop_compile_ahead() is None


def test_a_new_sequence_computes_the_same_after_a_dry_pass(tiny_model_factory):
    model_dir, reference = tiny_model_factory("qwen3_5", 1)
    prompt = random_prompt(reference.config.vocab_size, 9, seed=3)
    plain = _runner(model_dir)
    want = plain.forward([BatchItem(new_sequence(plain, "a", prompt), prompt)], all_positions=True)
    runner = _runner(model_dir)
    ahead = RunsDryPasses()
    runner.compile_ahead = ahead  # type: ignore[assignment]
    seq = new_sequence(runner, "a", prompt)
    got = runner.forward([BatchItem(seq, prompt)], all_positions=True)
    assert ahead.report.dry_passes == 1
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert seq.num_computed_tokens == len(prompt)


@pytest.mark.parametrize("graph_batch", [2, 0])
def test_decode_steps_run_no_dry_pass(tiny_model_factory, graph_batch):
    """Graphed, a decode step runs what the graphs compiled at capture; eager (no graphs: MoE models), its pass
    time is what the warm-up fits the fixed pass cost on, which a dry pass would double."""
    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    prompt = random_prompt(reference.config.vocab_size, 5, seed=4)
    runner = _runner(model_dir, graph_batch=graph_batch)
    ahead = RunsDryPasses()
    runner.compile_ahead = ahead  # type: ignore[assignment]
    seq = new_sequence(runner, "a", prompt)
    runner.forward([BatchItem(seq, prompt[:3])])
    runner.forward([BatchItem(seq, prompt[3:])])
    assert ahead.report.dry_passes == 2
    for token in (7, 8):
        seq.output_token_ids.append(token)
        seq.kv_slots += runner.kv_allocator.alloc(1) or []
        runner.forward([BatchItem(seq, [token])])
    assert ahead.report.dry_passes == 2 and seq.num_computed_tokens == len(prompt) + 2
