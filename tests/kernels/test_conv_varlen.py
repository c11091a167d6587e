"""Prefill conv of many sequences in one launch (Triton, in the interpreter on CPU) against the per-sequence
reference: outputs and the new states in the pool, sequences shorter than the kernel's window included, the
one-matrix and the q | k | v plane layouts, with and without the fused q/k L2 norm, and every tile config."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.conv import naive_causal_conv1d_varlen, naive_causal_conv1d_varlen_qkv
from headroom.kernels.conv_varlen import causal_conv1d_varlen, causal_conv1d_varlen_qkv

LENGTHS = [[1], [2, 40, 1], [70, 3, 33]]
# (BLOCK_T, BLOCK_C, num_warps): the default and the edges of the GPU sweep.
CONFIGS = [None, (16, 32, 4), (128, 64, 8)]


def _inputs(lengths, channels, kernel=4, pool_slots=6, strided=False):
    gen = torch.Generator().manual_seed(sum(lengths) + channels)
    # strided: x a column slice of a wider projection, as the layer passes it.
    wide = torch.randn(sum(lengths), channels + (24 if strided else 0), generator=gen)
    x = wide[:, 8 : 8 + channels] if strided else wide
    weight = torch.randn(channels, kernel, generator=gen)
    states = torch.randn(pool_slots, channels, kernel - 1, generator=gen)
    slots = torch.tensor([5, 0, 2][: len(lengths)])
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))])
    return x, weight, states, slots, cu


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_matches_reference(lengths, config):
    x, weight, states, slots, cu = _inputs(lengths, 136, strided=True)
    want_states = states.clone()
    want = naive_causal_conv1d_varlen(x, weight, want_states, slots, lengths)
    got = causal_conv1d_varlen(x, weight, states, slots, cu, max(lengths), config=config)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)
    # The slots of no sequence in the pass are untouched.
    assert not torch.equal(states[5], torch.zeros_like(states[5]))


@pytest.mark.parametrize("norm_dim", [0, 16, 32])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_qkv_planes(lengths, config, norm_dim):
    """q, k 64 channels each (4 or 2 heads), v 72: v's last block partly masked, a 32-channel config block
    raised to the 32-channel norm head, a 64-channel one holding two 16-channel heads."""
    key_dim, kernel = 64, 3
    x, weight, states, slots, cu = _inputs(lengths, 2 * key_dim + 72, kernel=kernel, strided=True)
    want_states = states.clone()
    want = naive_causal_conv1d_varlen_qkv(x, weight, want_states, slots, lengths, key_dim, norm_dim)
    got = causal_conv1d_varlen_qkv(x, weight, states, slots, cu, max(lengths), key_dim, norm_dim, config=config)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.is_contiguous() and g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)
    if norm_dim:
        norms = got[0].view(sum(lengths), -1, norm_dim).norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-3, rtol=0)


def test_qkv_key_dim_not_a_block_multiple():
    """key_dim 48: the launcher halves a 64-channel block to 16 so that no block straddles q | k | v."""
    lengths, key_dim = [9, 5], 48
    x, weight, states, slots, cu = _inputs(lengths, 2 * key_dim + 40)
    want = naive_causal_conv1d_varlen_qkv(x, weight, states.clone(), slots, lengths, key_dim, 16)
    got = causal_conv1d_varlen_qkv(x, weight, states, slots, cu, max(lengths), key_dim, 16, config=(32, 64, 4))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="conv: x"):
        causal_conv1d_varlen(torch.zeros(4, 8), torch.zeros(8, 4), torch.zeros(2, 8, 2), torch.tensor([0]),
                             torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match="key_dim 4 must leave v channels of 8"):
        causal_conv1d_varlen_qkv(torch.zeros(4, 8), torch.zeros(8, 4), torch.zeros(2, 8, 3), torch.tensor([0]),
                                 torch.tensor([0, 4]), 4, 4)
    with pytest.raises(ValueError, match="norm_dim 12"):
        causal_conv1d_varlen_qkv(torch.zeros(4, 64), torch.zeros(64, 4), torch.zeros(2, 64, 3), torch.tensor([0]),
                                 torch.tensor([0, 4]), 4, 24, norm_dim=12)
