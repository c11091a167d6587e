"""exact_float (Triton, in the interpreter on CPU): every integer of [0, 2^23) it is given comes back as the
same value in fp32, the edges included."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headroom.kernels.int_float import exact_float


@triton.jit
def _convert_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, exact_float(tl.load(x + offs, mask=offs < n, other=0)), mask=offs < n)


def test_integers_below_two_to_the_23_are_exact():
    values = torch.cat([torch.arange(0, 300), torch.tensor([2**16 - 1, 15 << 16, 15 << 19, 2**23 - 2, 2**23 - 1]),
                        torch.randint(0, 2**23, (2000,), generator=torch.Generator().manual_seed(0))]).to(torch.int32)
    out = torch.empty(values.shape, dtype=torch.float32)
    _convert_kernel[(triton.cdiv(values.numel(), 256),)](values, out, values.numel(), BLOCK=256)
    assert torch.equal(out, values.to(torch.float32))
