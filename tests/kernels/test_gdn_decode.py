"""Fused Gated DeltaNet decode step (interpreter on CPU) against the naive per-sequence recurrence."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.gated_delta import naive_gated_delta_decode
from headroom.kernels.gdn_decode import gated_delta_decode


@pytest.mark.parametrize("num_seqs,hk,hv,dk,dv", [(3, 2, 4, 16, 24), (1, 1, 3, 8, 40), (5, 2, 2, 24, 8)])
def test_decode_matches_naive_in_place(num_seqs, hk, hv, dk, dv):
    gen = torch.Generator().manual_seed(num_seqs * 100 + dv)
    conv_out = torch.randn(num_seqs, 2 * hk * dk + hv * dv, generator=gen)
    # Strided views of one conv output, as the layer passes them.
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(num_seqs, hk, dk), k.reshape(num_seqs, hk, dk), v.reshape(num_seqs, hv, dv)
    g = -torch.rand(num_seqs, hv, generator=gen)
    beta = torch.rand(num_seqs, hv, generator=gen)
    states = torch.randn(7, hv, dk, dv, generator=gen)
    slots = torch.randperm(7, generator=gen)[:num_seqs]
    ref_states = states.clone()
    out = gated_delta_decode(q, k, v, g, beta, states, slots)
    want = naive_gated_delta_decode(q, k, v, g, beta, ref_states, slots)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # The slots' states advanced exactly as the reference's; the others untouched.
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)


def test_bad_state_shape_is_named():
    q = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="states"):
        gated_delta_decode(q, q, torch.zeros(1, 2, 8), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(3, 2, 8, 9),
                           torch.zeros(1, dtype=torch.long))
