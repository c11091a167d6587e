"""Next-token choice: greedy, or temperature + top-p with a per-request, per-step seed."""

from __future__ import annotations

import torch
from headroom.engine.sequence import Sequence

# torch.Generator.manual_seed takes a 64-bit value; a client's seed is any integer.
_SEED_MODULUS = 2**64


def sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    """logits [vocab] -> token id. Same seed, same step, same logits -> same token."""
    params = seq.sampling
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    # fp64 and the max subtracted first: a temperature as small as the API admits (any float > 0) gives
    # -inf or 0 here, never inf - inf = NaN, and a tiny top_p does not round to 0 below.
    shifted = logits.double() - logits.max().double()
    probs = torch.softmax(shifted / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest head whose mass reaches top_p (the first token always stays).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    generator = torch.Generator(device=probs.device)
    if params.seed is not None:
        generator.manual_seed((params.seed * 1_000_003 + len(seq.output_token_ids)) % _SEED_MODULUS)
    else:
        generator.seed()
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [num_items, vocab], one row per sequence. Greedy rows share one argmax (one device sync)."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(seqs)} sequences")
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [
        int(greedy[i]) if seq.sampling.temperature == 0 else sample_one(logits[i], seq)
        for i, seq in enumerate(seqs)
    ]
