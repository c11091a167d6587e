"""Prefill conv of many sequences in one launch (Triton, in the interpreter on CPU) against the per-sequence
reference: outputs and the new states in the pool, sequences shorter than the kernel's window included, the
one-matrix and the q | k | v plane layouts, with and without the fused q/k L2 norm, and every tile config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from headroom.kernels.conv import naive_causal_conv1d_varlen, naive_causal_conv1d_varlen_qkv
from headroom.kernels.conv_varlen import causal_conv1d_varlen, causal_conv1d_varlen_qkv

LENGTHS = [[1], [2, 40, 1], [70, 3, 33]]
# (BLOCK_T, BLOCK_C, num_warps): the default and the edges of the GPU sweep; then the rows variant: runs not a
# multiple of its 4-row step (30; 2, shorter than the window too, so a sequence's second program takes its
# window partly from the state), runs longer than the sequences.
CONFIGS = [None, (16, 32, 4), (128, 64, 8), (30, 64, 2, "rows"), (2, 128, 2, "rows"), (128, 128, 4, "rows")]
# The planes' tests without the 2-row runs (slow in the interpreter; the window's source does not depend on the
# output layout).
QKV_CONFIGS = [c for c in CONFIGS if c != (2, 128, 2, "rows")]


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
@pytest.mark.parametrize("config", QKV_CONFIGS, ids=str)
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


@pytest.mark.parametrize("kernel", [4, 2])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_rows_variant_bit_equal_to_tile(lengths, kernel):
    """fp32 in the interpreter: the rows kernel's outputs and states equal the tile kernel's bit for bit (the same
    taps in the same order, the same epilogue), one matrix and q | k | v planes with the norm."""
    x, weight, states, slots, cu = _inputs(lengths, 136, kernel=kernel, strided=True)
    tile_states, rows_states = states.clone(), states.clone()
    want = causal_conv1d_varlen(x, weight, tile_states, slots, cu, max(lengths), config=(16, 64, 4))
    got = causal_conv1d_varlen(x, weight, rows_states, slots, cu, max(lengths), config=(6, 64, 2, "rows"))
    assert torch.equal(got, want) and torch.equal(rows_states, tile_states)
    x, weight, states, slots, cu = _inputs(lengths, 2 * 64 + 72, kernel=kernel, strided=True)
    tile_states, rows_states = states.clone(), states.clone()
    want = causal_conv1d_varlen_qkv(x, weight, tile_states, slots, cu, max(lengths), 64, 32, config=(32, 64, 4))
    got = causal_conv1d_varlen_qkv(x, weight, rows_states, slots, cu, max(lengths), 64, 32,
                                   config=(32, 64, 4, "rows"))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(rows_states, tile_states)


def test_variant_is_checked():
    x, weight, states, slots, cu = _inputs([5], 16, kernel=5)
    with pytest.raises(ValueError, match="rows takes kernel widths up to 4, not 5"):
        causal_conv1d_varlen(x, weight, states, slots, cu, 5, config=(8, 16, 1, "rows"))
    with pytest.raises(ValueError, match="variant 'cols'"):
        causal_conv1d_varlen(x, weight, states, slots, cu, 5, config=(8, 16, 1, "cols"))


_SM90_CHILD = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from headroom.kernels import conv_varlen

out = []
for name, constants, warps in json.loads(sys.stdin.read()):
    kernel = getattr(conv_varlen, name)
    pointers = dict(x="*bf16", weight="*bf16", states="*bf16", slots="*i64", offsets="*i64", out="*bf16",
                    new_states="*bf16", eps="fp32")
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in kernel.arg_names}
    # What the launcher specializes at the 4B shapes: pointers, x's row stride (12,352), the pool's slot stride,
    # the token count divisible by 16; weight's and the states' channel strides (4, 3) not.
    aligned = ["x", "weight", "states", "slots", "offsets", "out", "new_states", "stride_x", "stride_ss",
               "stride_nb", "num_tokens"]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 3})
    out.append(compiled.asm["ptx"])
print(json.dumps(out))
"""


def _loop_blocks(ptx: str) -> str:
    """The PTX blocks of the (one) loop: those whose label LLVM comments as its header or in it, each cut at its
    branch back to the header (the code after a loop may follow that branch in the same block)."""
    header = re.search(r"\n(\$L__BB\w+):[^\n]*Loop Header", ptx).group(1)
    blocks = [b for b in re.split(r"\n(?=\$L__BB)", ptx) if "Loop" in b.split("\n", 1)[0]]
    return "\n".join(b.split(f"bra \t{header};")[0].split(f"bra.uni \t{header};")[0] for b in blocks)


def test_both_variants_compile_for_the_h200():
    """Both kernels compile for sm_90 at the 4B shapes (bf16, 128-channel heads normed, width 4), with the integer
    specializations the launcher gets there. The rows kernel's loop loads 4 rows (16 bytes a thread each), stores
    4, and needs neither shared memory nor a barrier: its row window is registers renamed, never moved."""
    constants = dict(CHANNELS=8192, KEY_DIM=2048, NORM_DIM=128, KERNEL=4, BLOCK_S=4)
    variants = [("causal_conv1d_varlen_fwd_kernel", {**constants, "BLOCK_T": 32, "BLOCK_C": 128}, 2),
                ("causal_conv1d_varlen_rows_kernel", {**constants, "BLOCK_T": 64, "BLOCK_C": 1024}, 4),
                ("causal_conv1d_varlen_rows_kernel", {**constants, "BLOCK_T": 32, "BLOCK_C": 512, "NORM_DIM": 0}, 2)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SM90_CHILD], input=json.dumps(variants), capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ptxs = json.loads(done.stdout.strip().splitlines()[-1])
    for (_, constants, _), ptx in zip(variants[1:], ptxs[1:], strict=True):
        loop = _loop_blocks(ptx)
        assert loop.count("ld.global.v4.b32") == 4 and loop.count("st.global.v4.b32") == 4, constants
        assert "shared" not in loop and "bar.sync" not in loop and ".local" not in ptx, constants
        # The fused norm: one 16-lane butterfly (4 shuffles) a row and 128-channel head.
        assert loop.count("shfl.sync") == (16 if constants["NORM_DIM"] else 0), constants


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
