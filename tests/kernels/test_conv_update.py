"""Batched conv1d decode update (interpreter on CPU) against the naive per-sequence conv."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.conv import naive_causal_conv1d_update
from headroom.kernels.conv_update import causal_conv1d_update


@pytest.mark.parametrize("channels,kernel", [(37, 4), (256, 4), (130, 2), (64, 3)])
def test_update_matches_naive(channels, kernel):
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(3, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    states = torch.randn(6, channels, kernel - 1, generator=gen)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    ref_states = states.clone()
    out = causal_conv1d_update(x, weight, states, slots)
    ref = naive_causal_conv1d_update(x, weight, ref_states, slots)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Every slot updated as the reference; untouched slots stay as they were.
    torch.testing.assert_close(states, ref_states, atol=0, rtol=0)


def test_bad_state_shape_is_named():
    with pytest.raises(ValueError, match="states"):
        causal_conv1d_update(torch.zeros(1, 8), torch.zeros(8, 4), torch.zeros(2, 8, 4), torch.zeros(1, dtype=torch.int32))
