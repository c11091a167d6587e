"""Prefill conv of many sequences in one launch (Triton, in the interpreter on CPU) against the per-sequence
reference: outputs and the new states in the pool, sequences shorter than the kernel's window included."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.conv import naive_causal_conv1d_varlen
from headroom.kernels.conv_varlen import causal_conv1d_varlen


@pytest.mark.parametrize("lengths", [[1], [2, 40, 1], [70, 3, 33]], ids=str)
def test_matches_reference(lengths):
    gen = torch.Generator().manual_seed(sum(lengths))
    channels, kernel, pool_slots = 136, 4, 6
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    states = torch.randn(pool_slots, channels, kernel - 1, generator=gen)
    slots = torch.tensor([5, 0, 2][: len(lengths)])
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))])
    want_states = states.clone()
    want = naive_causal_conv1d_varlen(x, weight, want_states, slots, lengths)
    got = causal_conv1d_varlen(x, weight, states, slots, cu, max(lengths))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)
    # The slots of no sequence in the pass are untouched.
    assert not torch.equal(states[5], torch.zeros_like(states[5]))


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="conv: x"):
        causal_conv1d_varlen(torch.zeros(4, 8), torch.zeros(8, 4), torch.zeros(2, 8, 2), torch.tensor([0]),
                             torch.tensor([0, 4]), 4)
