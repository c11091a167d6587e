"""Prefix reuse through the LLM API: a cache hit followed by the rest of the prompt equals a cold run."""

from __future__ import annotations

import pytest
import torch
from headroom.engine.llm import LLM

from tests.engine.helpers import (
    assert_hit_then_rest_equals_cold_run,
    random_prompt,
    reference_greedy,
    reference_logits,
)


@pytest.mark.parametrize(("kind", "index"), [("qwen3", 0), ("qwen3_5", 0), ("qwen3_5", 2)])
def test_hit_then_rest_equals_cold_run(tiny_model_factory, kind, index):
    model_dir, reference = tiny_model_factory(kind, index)
    assert_hit_then_rest_equals_cold_run(model_dir, reference.config.vocab_size)


def test_hybrid_hit_stops_at_the_deepest_checkpoint_then_at_the_divergence_point(tiny_model_factory):
    model_dir, reference = tiny_model_factory("qwen3_5", 1)
    vocab = reference.config.vocab_size
    ids = random_prompt(vocab, 200, seed=5)
    llm = LLM(str(model_dir), max_total_tokens=1024, ssm_slots=32, chunked_prefill_size=48)
    llm.generate([ids], max_new_tokens=1)
    # Stops at 128, 192 (tail), 144, 192 (chunk multiples), 199 (exact repeat): sharing 170 tokens hits 144.
    other = ids[:170] + random_prompt(vocab, 5, seed=6)
    first = llm.generate([other], max_new_tokens=2)[0]
    assert first.cached_tokens == 144
    # `other` left the cached path at 170 and checkpointed there: the next continuation hits all 170.
    third = ids[:170] + random_prompt(vocab, 7, seed=7)
    hit = llm.generate([third], max_new_tokens=4)[0]
    assert hit.cached_tokens == 170
    # Greedy tokens after the divergence-point hit equal transformers' (fp32) on the whole prompt.
    assert hit.token_ids == reference_greedy(reference, third, 4)
    torch.testing.assert_close(hit.prompt_logits, reference_logits(reference, third)[-1], atol=1e-4, rtol=0)


def test_multi_turn_reuses_the_whole_previous_turn(tiny_model_factory):
    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    vocab = reference.config.vocab_size
    llm = LLM(str(model_dir), max_total_tokens=256, ssm_slots=32, chunked_prefill_size=64)
    turn1 = random_prompt(vocab, 13, seed=8)
    out1 = llm.generate([turn1], max_new_tokens=4)[0].token_ids
    # The final SSM state (after prompt + 3 computed outputs) is a checkpoint.
    turn2 = turn1 + out1 + random_prompt(vocab, 5, seed=9)
    assert llm.generate([turn2], max_new_tokens=2)[0].cached_tokens == 13 + 3


def test_pools_return_to_empty_after_eviction(tiny_model_factory):
    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    llm = LLM(str(model_dir), max_total_tokens=64, ssm_slots=8, max_running_requests=2, chunked_prefill_size=16)
    for seed in range(6):
        # Each run must evict earlier sessions' KV and checkpoints to fit.
        llm.generate([random_prompt(reference.config.vocab_size, 40, seed=seed)], max_new_tokens=4)
    radix = llm.cache.radix
    assert radix is not None
    radix.evict(10**6)
    radix.evict_checkpoints(10**6)
    assert llm.runner.kv_allocator.num_free_tokens == 64
    assert llm.runner.ssm_pool is not None and llm.runner.ssm_pool.num_free == 8


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_more_prompts_than_running_requests_run_in_waves(tiny_model_factory, kv_dtype):
    """LLM.generate holds at most max_running_requests together (a KIVI pool has one window row each): three
    prompts with room for two give each prompt the tokens it gets alone."""
    model_dir, reference = tiny_model_factory("qwen3_5", 2)
    prompts = [random_prompt(reference.config.vocab_size, n, seed=n) for n in (7, 9, 11)]
    llm = LLM(str(model_dir), max_total_tokens=512, ssm_slots=16, max_running_requests=2, kv_dtype=kv_dtype,
              enable_prefix_cache=False)
    together = [g.token_ids for g in llm.generate(prompts, max_new_tokens=5)]
    assert together == [llm.generate([p], max_new_tokens=5)[0].token_ids for p in prompts]
    assert not llm.runner.kv_pool._residual_rows
