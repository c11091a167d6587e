"""Next-token choice: greedy, or temperature + top-p with a per-request, per-step seed.

sample_on_device leaves the tokens on the logits' device, so that a decode step can be launched from them
before the host has read them (engine/loop/step.py's overlapped decode); sample reads them back at once.
"""

from __future__ import annotations

import torch
from headroom.engine.sequence import Sequence

# torch.Generator.manual_seed takes a 64-bit value; a client's seed is any integer.
_SEED_MODULUS = 2**64


def _sampled_row(logits: torch.Tensor, seq: Sequence, step: int) -> torch.Tensor:
    """logits [vocab] -> the token id as a 0-d int64 tensor on logits' device (no host sync). step: how many
    tokens the request had generated before this one (the seed's per-step offset)."""
    params = seq.sampling
    if params.temperature == 0:
        return torch.argmax(logits)
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
        generator.manual_seed((params.seed * 1_000_003 + step) % _SEED_MODULUS)
    else:
        generator.seed()
    return torch.multinomial(probs / probs.sum(), 1, generator=generator)[0]


def sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    """logits [vocab] -> token id. Same seed, same step, same logits -> same token."""
    return int(_sampled_row(logits, seq, len(seq.output_token_ids)).item())


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0) -> torch.Tensor:
    """logits [num_items, vocab], one row per sequence -> token ids [num_items] int64 on logits' device, without
    waiting for them. ahead: tokens each sequence has generated that are not in its output_token_ids yet (1 for
    a step launched before the previous step's tokens were read), so that a seeded row's step stays the same."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(seqs)} sequences")
    greedy = torch.argmax(logits, dim=-1)
    if all(seq.sampling.temperature == 0 for seq in seqs):
        return greedy
    return torch.stack([greedy[i] if seq.sampling.temperature == 0
                        else _sampled_row(logits[i], seq, len(seq.output_token_ids) + ahead)
                        for i, seq in enumerate(seqs)])


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [num_items, vocab], one row per sequence -> token ids, read back in one device sync."""
    return sample_on_device(logits, seqs).tolist()
