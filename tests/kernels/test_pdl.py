"""kernels/pdl.py: off on the CPU, and every decode kernel that takes PDL compiles for sm_90 with it, waiting on
its producer (griddepcontrol.wait) before it touches the producer's data; without it, no wait."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.pdl import pdl_launch, use_pdl

from tests.kernels.sm90 import compile_sm90

BF, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
# (module, kernel, pointer arguments, constexprs other than PDL, float scalars) at the 4B model's decode shapes.
KERNELS = [
    ("norm_triton", "rms_norm_fwd_kernel", dict(x=BF, delta=BF, weight=BF, out=BF, summed=BF),
     dict(BLOCK_D=4096, UNIT_OFFSET=True, HAS_DELTA=True), ("eps",)),
    ("norm_triton", "gated_rms_norm_fwd_kernel", dict(x=BF, gate=BF, weight=BF, out=BF),
     dict(BLOCK_R=1, BLOCK_D=128), ("eps",)),
    ("rotary_triton", "rms_norm_rotary_fwd_kernel", dict(x=BF, weight=BF, positions=I64, inv_freq=F32, out=BF),
     dict(BLOCK_H=4, BLOCK_D=256, VEC=2, UNIT_OFFSET=True), ("eps",)),
    ("gates_triton", "silu_mul_fwd_kernel", dict(gate=BF, up=BF, out=BF), dict(BLOCK=1024), ()),
    ("gates_triton", "silu_mul_fwd_kernel", dict(gate=BF, up=BF, out=BF), dict(BLOCK=1024, PAIRED=True), ()),
    ("gates_triton", "sigmoid_mul_fwd_kernel", dict(x=BF, gate=BF, out=BF), dict(BLOCK=1024), ()),
    ("gates_triton", "gdn_gates_fwd_kernel", dict(b=BF, a=BF, neg_a=F32, dt_bias=BF, beta=BF, g=F32),
     dict(BLOCK=32), ()),
    ("conv_update", "causal_conv1d_update_fwd_kernel", dict(x=BF, weight=BF, states=BF, slots=I64, out=BF),
     dict(CHANNELS=8192, KERNEL=4, BLOCK_C=128, BLOCK_K=4), ()),
    ("attention_merge_triton", "merge_splits_fwd_kernel", dict(parts=F32, lses=F32, out=BF, out_lse=F32),
     dict(BLOCK_S=32, BLOCK_D=32), ()),
    ("gdn_decode", "gated_delta_decode_fwd_kernel",
     dict(q=BF, k=BF, v=BF, g=BF, beta=BF, states=F32, slots=I64, bounds=I64, out=BF, neg_a=F32, dt_bias=BF),
     dict(GROUP=2, DK=128, DV=128, BLOCK_K=128, BLOCK_V=16, ROWS=False, QK_NORMED=False, RAW_GATES=True), ("scale",)),
    ("gdn_decode", "gated_delta_tail_fwd_kernel",
     dict(q=BF, k=BF, v=BF, g=F32, beta=BF, states=F32, out=BF, pool=F32, row_lo=I32, row_hi=I32, snap_at=I32,
          snap_slot=I32),
     dict(GROUP=2, DK=128, DV=128, BLOCK_K=128, BLOCK_V=8, MAX_SNAPS=2, QK_NORMED=False), ("scale",)),
]


def test_off_without_a_gpu():
    assert not use_pdl(torch.device("cpu"))
    assert pdl_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("pdl", [True, False])
def test_decode_kernels_compile_for_the_h200(pdl):
    variants = [(f"headroom.kernels.{module}", name, {**pointers, **{f: "fp32" for f in floats}},
                 {**constants, "PDL": pdl}) for module, name, pointers, constants, floats in KERNELS]
    for (_, name, _, _), result in zip(variants, compile_sm90(variants), strict=True):
        assert result["ok"], (name, result.get("error"))
        assert ("griddepcontrol.wait" in result["ptx"]) == pdl, name
        assert ("griddepcontrol.launch_dependents" in result["ptx"]) == pdl, name
