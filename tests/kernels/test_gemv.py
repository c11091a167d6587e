"""The decode GEMV (kernels/gemv.py, Triton interpreter on CPU) against naive_gemv: one row and several, with and
without a split over K, shapes that no block divides."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from headroom.kernels.gemv import GemvConfig, gemv, naive_gemv  # noqa: E402


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_matches_naive(rows, split):
    gen = torch.Generator().manual_seed(rows * 10 + split)
    x = torch.randn(rows, 200, generator=gen)
    w = torch.randn(70, 200, generator=gen)
    out = gemv(x, w, GemvConfig(block_n=32, block_k=64, split=split, num_stages=2))
    torch.testing.assert_close(out, naive_gemv(x, w), atol=1e-4, rtol=1e-4)


def test_gemv_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"w \(4, 9\)"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 9))
