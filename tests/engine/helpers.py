"""Shared helpers for engine tests: run prompts through the ModelRunner and through transformers."""

from __future__ import annotations

import torch
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.sequence import Sequence
from headroom.kernels.compile_ahead import CompileAheadReport


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


def assert_hit_then_rest_equals_cold_run(model_dir, vocab: int) -> None:
    """A 130-token prompt cached at chunk 64, then the prompt extended: the hit covers the shared prefix (a
    hybrid model's up to the exact-repeat checkpoint one token short of its end) and the logits and greedy
    tokens equal a cold run of the whole prompt."""
    from headroom.engine.llm import LLM

    shared = random_prompt(vocab, 130, seed=3)
    second = shared + random_prompt(vocab, 9, seed=4)
    warm = LLM(str(model_dir), max_total_tokens=512, ssm_slots=32, chunked_prefill_size=64)
    warm.generate([shared], max_new_tokens=3)
    hit = warm.generate([second], max_new_tokens=6)[0]
    # A hybrid model holds SSM states only at its checkpoint stops: the deepest inside `shared` is at 129.
    assert hit.cached_tokens == (129 if warm.runner.ssm_pool is not None else 130)
    cold = LLM(str(model_dir), max_total_tokens=512, ssm_slots=32, enable_prefix_cache=False)
    cold_run = cold.generate([second], max_new_tokens=6)[0]
    assert cold_run.cached_tokens == 0
    torch.testing.assert_close(hit.prompt_logits, cold_run.prompt_logits, atol=1e-4, rtol=0)
    assert hit.token_ids == cold_run.token_ids


def reference_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of ids (full recompute each step: slow, tiny models only)."""
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(int(reference_logits(model, ids + out)[-1].argmax()))
    return out


def perturb_hybrid(model: torch.nn.Module, seed: int) -> None:
    """Randomise every parameter of a tiny hybrid (MoE or dense) model in place: A_log uniform in [-1, 1), the
    MoE router drawn afresh (transformers starts it at 0: uniform routing), the rest shifted by N(0, 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 - 1)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)


class RunsDryPasses:
    """Stands in for kernels/compile_ahead.py's CompileAhead off the GPU: runs each dry pass it is handed (nothing
    compiles on a CPU) and counts them in its report."""

    def __init__(self, threads: int = 4) -> None:
        self.report = CompileAheadReport(threads)

    def prepare(self, dry_pass) -> int:
        self.report.dry_passes += 1
        dry_pass()
        return 0
