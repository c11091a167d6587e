"""bench/engine_speed_parts.py's _logits_of (logit_check's run of one engine) on the CPU: a row for each prompt's
prefill end and each decoded token, prompt after prompt; the same logits (within bf16 rounding of batched rows)
whether the prompts decode one a pass or all in one; and each row is its position's: about as far from
transformers fp32 as transformers bf16 is. The GPU runs the same function with CUDA graphs."""

import importlib.util
from pathlib import Path

import torch

from tests.engine.conftest import build_model

_spec = importlib.util.spec_from_file_location(
    "engine_speed_parts", Path(__file__).resolve().parents[2] / "bench" / "engine_speed_parts.py")
engine_speed_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_speed_parts)


def test_logit_runs_row_for_row(tmp_path):
    model = build_model("qwen3_5", 0, tmp_path)
    vocab = model.config.vocab_size
    inputs = [[(7 * k + 3 * i) % vocab for i in range(12)] for k in range(3)]
    one_a_pass = engine_speed_parts._logits_of(tmp_path, inputs, 4, "bf16", False, False, device="cpu")
    all_at_once = engine_speed_parts._logits_of(tmp_path, inputs, 4, "bf16", False, True, device="cpu")
    assert one_a_pass.shape == all_at_once.shape == (3 * 5, vocab) and one_a_pass.dtype == torch.float32
    torch.testing.assert_close(all_at_once, one_a_pass, atol=0.05, rtol=0.02)
    with torch.no_grad():
        truth = torch.cat([model(torch.tensor([tokens])).logits[0, 7:12] for tokens in inputs])
        model.to(torch.bfloat16)
        bound = torch.cat([model(torch.tensor([tokens])).logits[0, 7:12].float() for tokens in inputs])
    # the rows are the positions they claim: about as far from fp32 as transformers bf16 is (a row off by one
    # position is as far as two unrelated rows)
    assert (one_a_pass - truth).abs().max() <= 2 * (bound - truth).abs().max()
    assert (one_a_pass - truth).abs().max() < 0.2 * (one_a_pass[:-1] - truth[1:]).abs().max()
