"""Shared helpers for engine tests: run prompts through the ModelRunner and through transformers."""

from __future__ import annotations

import torch
from headroom.engine.forward_batch import BatchItem
from headroom.engine.model_runner import ModelRunner
from headroom.engine.sequence import Sequence


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def new_sequence(runner: ModelRunner, name: str, ids: list[int]) -> Sequence:
    seq = Sequence(name, ids)
    slots = runner.kv_allocator.alloc(len(ids))
    assert slots is not None
    seq.kv_slots = slots
    if runner.ssm_pool is not None:
        seq.ssm_slot = runner.ssm_pool.alloc()
    return seq


def chunked_logits(runner: ModelRunner, seq: Sequence, chunk: int) -> torch.Tensor:
    """Prefill seq in chunks; logits [num_prompt_tokens, vocab] of every position."""
    rows = []
    while seq.is_prefilling:
        start = seq.num_computed_tokens
        tokens = seq.prompt_token_ids[start : start + chunk]
        rows.append(runner.forward([BatchItem(seq, tokens)], all_positions=True))
    return torch.cat(rows)
