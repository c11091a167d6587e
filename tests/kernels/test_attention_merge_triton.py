"""One-launch merge of split-K partials (interpreter on CPU) against merge_attention_states."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.attention_merge import merge_attention_states
from headroom.kernels.attention_merge_triton import merge_splits_into


@pytest.mark.parametrize("splits,tokens,heads,dim", [(5, 3, 2, 24), (1, 2, 3, 8), (32, 1, 4, 40)])
def test_merge_matches_reference(splits, tokens, heads, dim):
    gen = torch.Generator().manual_seed(splits * 7 + dim)
    parts = torch.randn(splits, tokens, heads, dim, generator=gen)
    lses = torch.randn(splits, tokens, heads, generator=gen) * 3
    # Splits that saw no key (-inf), and one row that saw none in any split.
    lses[0, 0, 0] = float("-inf")
    lses[:, -1, -1] = float("-inf")
    out = torch.full((tokens, heads, dim), float("nan"))
    out_lse = torch.full((tokens, heads), float("nan"))
    merge_splits_into(parts, lses, out, out_lse)
    want, want_lse = merge_attention_states(parts, lses, torch.float32)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert out[-1, -1].abs().max() == 0 and out_lse[-1, -1] == float("-inf")


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="lses"):
        merge_splits_into(torch.zeros(2, 1, 1, 8), torch.zeros(3, 1, 1), torch.zeros(1, 1, 8), torch.zeros(1, 1))
