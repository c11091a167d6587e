"""The engine's logits equal transformers' (fp32, CPU) for three random tiny configs per architecture."""

from __future__ import annotations

import pytest
import torch
from headroom.engine.config import EngineConfig
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.model_runner import ModelRunner

from tests.engine.helpers import chunked_logits, new_sequence, random_prompt, reference_logits

CASES = [("qwen3", i) for i in range(3)] + [("qwen3_5", i) for i in range(3)]


@pytest.mark.parametrize(("kind", "index"), CASES)
def test_full_forward_matches_transformers(tiny_model_factory, kind, index):
    model_dir, reference = tiny_model_factory(kind, index)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=128, ssm_slots=8))
    ids = random_prompt(reference.config.vocab_size, 41, seed=index)
    got = chunked_logits(runner, new_sequence(runner, "a", ids), chunk=len(ids))
    torch.testing.assert_close(got, reference_logits(reference, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("kind", "index"), [("qwen3", 1), ("qwen3_5", 0), ("qwen3_5", 2)])
@pytest.mark.parametrize("chunk", [1, 5, 13])
def test_chunked_prefill_equals_unchunked(tiny_model_factory, kind, index, chunk):
    model_dir, reference = tiny_model_factory(kind, index)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=128, ssm_slots=8))
    ids = random_prompt(reference.config.vocab_size, 30, seed=7)
    whole = chunked_logits(runner, new_sequence(runner, "whole", ids), chunk=len(ids))
    pieces = chunked_logits(runner, new_sequence(runner, "pieces", ids), chunk=chunk)
    torch.testing.assert_close(pieces, whole, atol=1e-4, rtol=0)


def test_mixed_batch_equals_separate_runs(tiny_model_factory):
    """A prefill chunk of one request and a decode of another in one pass: each as if alone."""
    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=128, ssm_slots=8))
    vocab = reference.config.vocab_size
    long_ids, short_ids = random_prompt(vocab, 23, seed=1), random_prompt(vocab, 9, seed=2)
    long_seq, short_seq = new_sequence(runner, "long", long_ids), new_sequence(runner, "short", short_ids)
    runner.forward([BatchItem(short_seq, short_ids[:8])])
    runner.forward([BatchItem(long_seq, long_ids[:11])])
    mixed = runner.forward([BatchItem(long_seq, long_ids[11:]), BatchItem(short_seq, short_ids[8:])])
    want_long = reference_logits(reference, long_ids)[-1]
    want_short = reference_logits(reference, short_ids)[-1]
    torch.testing.assert_close(mixed, torch.stack([want_long, want_short]), atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers_generate(tiny_model_factory):
    from headroom.engine.llm import LLM

    for kind, index in (("qwen3", 0), ("qwen3_5", 0), ("qwen3_5", 1)):
        model_dir, reference = tiny_model_factory(kind, index)
        ids = random_prompt(reference.config.vocab_size, 19, seed=11 + index)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        want = out[0, len(ids):].tolist()
        llm = LLM(str(model_dir), max_total_tokens=256, ssm_slots=32, chunked_prefill_size=6)
        assert llm.generate([ids], max_new_tokens=12)[0].token_ids == want, (kind, index)
