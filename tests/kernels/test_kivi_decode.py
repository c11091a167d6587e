"""kernels/kivi_decode.py (Triton interpreter on CPU): the KIVI decode with the head in chunks against
naive_paged_attention and against the general kernel's answer, reached as a tile sweep reaches it (paged_attention's
DECODE_TUNING: d_chunks, magic_register, max_registers), with splits and with several tokens a sequence; the magic
exponent in a register leaves the general kernel's answer exactly as it was; heads the chunks cannot cut are
refused by name."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels import paged_attention as pa
from headroom.kernels.kivi_decode import chunks_supported
from headroom.kernels.paged_attention import naive_paged_attention, paged_attention

from tests.kernels.paged_pool import VALUE_GROUP, Recording, make_pool
from tests.kernels.test_paged_attention import _batch, _close

# (bits, KV heads, query heads a KV head, head_dim, keys a sequence, query tokens a sequence, chunks)
CASES = [
    (2, 2, 4, 64, [45], [1], 2),              # decode, a partly filled last page, 32-channel chunks
    (4, 1, 8, 128, [96, 33], [1, 2], 4),      # two sequences, one with 2 tokens (16 rows: 2 tokens x 8 heads)
    (8, 2, 2, 128, [64], [1], 1),             # one chunk: the general kernel's loop in this kernel's shape
    (2, 2, 4, 256, [70], [1], 4),             # the 4B model's heads: 64-channel chunks
]


def _args(bits, num_kv_heads, group, head_dim, kv_lens, q_lens):
    kv, table = make_pool("kivi", bits, num_kv_heads, head_dim, kv_lens, torch.bfloat16)
    q, positions, offsets = _batch(kv_lens, q_lens, num_kv_heads * group, head_dim, torch.bfloat16)
    return (q, positions, offsets, table, torch.zeros(len(kv_lens), dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32), kv, head_dim**-0.5)


@pytest.mark.parametrize("tuning", [{}, {"magic_register": 1, "max_registers": 168}], ids=["plain", "magic in register"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("bits,num_kv_heads,group,head_dim,kv_lens,q_lens,chunks", CASES)
def test_chunked_decode_matches_naive_and_the_general_kernel(monkeypatch, tuning, num_splits, bits, num_kv_heads,
                                                              group, head_dim, kv_lens, q_lens, chunks):
    args = _args(bits, num_kv_heads, group, head_dim, kv_lens, q_lens)
    # (the general kernel with fp32 tiles, as the chunked one dequantizes: decode's default half_tiles rounds to fp16)
    with pa.tuned(decode={"half_tiles": 0}):
        general, general_lse = paged_attention(*args, num_splits=num_splits)
    launched = []
    from headroom.kernels import kivi_decode

    monkeypatch.setattr(kivi_decode, "kivi_decode_fwd_kernel",
                        Recording(kivi_decode.kivi_decode_fwd_kernel, launched, "CHUNKS"))
    monkeypatch.setattr(pa, "DECODE_TUNING", {"d_chunks": chunks, **tuning})
    got, got_lse = paged_attention(*args, num_splits=num_splits)
    assert launched == [chunks], "the chunked kernel ran, once"
    want, want_lse = naive_paged_attention(*args)
    assert torch.isfinite(got).all() and torch.isfinite(got_lse).all()
    _close(got, want, got_lse, want_lse)
    # The same dots in another order of the q.k sums: within fp32 rounding of the general kernel.
    torch.testing.assert_close(got.float(), general.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_lse, general_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tuning", [pa.EXTEND_TUNING, pa.DECODE_TUNING], ids=["extend", "decode"])
def test_the_magic_exponent_in_a_register_changes_no_bit(monkeypatch, tuning):
    """The general kernel's KIVI tiles with MAGIC_IN_REGISTER (on by default): the same codes, the same floats as
    with the exponent a literal."""
    args = _args(2, 2, 4, 64, [45, 70], [1, 9] if tuning is pa.EXTEND_TUNING else [1, 1])
    with pa.tuned(extend={"magic_register": 0}, decode={"magic_register": 0}):
        want, want_lse = paged_attention(*args)
    launched: list = []
    monkeypatch.setattr(pa, "paged_attention_fwd_kernel",
                        Recording(pa.paged_attention_fwd_kernel, launched, "MAGIC_IN_REGISTER"))
    monkeypatch.setitem(tuning, "magic_register", 1)
    got, got_lse = paged_attention(*args)
    assert launched == [True]
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_extend_and_continued_ranges_keep_the_general_kernel(monkeypatch):
    """d_chunks is a decode setting: an extend launch, and a decode launch continuing an earlier range (prev),
    run the general kernel whatever it says."""
    from headroom.kernels import kivi_decode

    decode = _args(2, 2, 4, 64, [45], [1])
    first, first_lse = paged_attention(*decode)
    monkeypatch.setattr(kivi_decode, "kivi_decode_fwd_kernel", None)  # any launch of it fails
    monkeypatch.setattr(pa, "DECODE_TUNING", {"d_chunks": 2})
    monkeypatch.setattr(pa, "EXTEND_TUNING", {"d_chunks": 2})
    paged_attention(*_args(2, 2, 4, 64, [70], [9]))
    acc, lse = first.float(), first_lse.clone()
    paged_attention(*decode, prev=(acc, lse), out=acc, out_lse=lse)


@pytest.mark.parametrize("chunks,head_dim", [(3, 64), (4, 64), (8, 256), (2, 70)])
def test_heads_the_chunks_cannot_cut_are_refused_by_name(monkeypatch, chunks, head_dim):
    assert not chunks_supported(chunks, head_dim, VALUE_GROUP)
    monkeypatch.setattr(pa, "DECODE_TUNING", {"d_chunks": chunks})
    with pytest.raises(ValueError, match=rf"d_chunks={chunks} .* {head_dim} channels .* value groups of {VALUE_GROUP}"):
        paged_attention(*_args(2, 1, 4, head_dim, [40], [1]))


def test_a_decode_split_multiplier_reaches_the_launch(monkeypatch):
    """DECODE_TUNING's splits_x (a tuned row's more programs for the chunked kernel): that many times the default
    split count in a decode launch, the same answer; an extend launch keeps its own."""
    decode = _args(2, 2, 4, 64, [45, 70], [1, 1])
    want, want_lse = naive_paged_attention(*decode)
    extend = _args(2, 2, 4, 64, [70], [20])
    launched: list = []
    monkeypatch.setattr(pa, "paged_attention_fwd_kernel", Recording(pa.paged_attention_fwd_kernel, launched, "NUM_SPLITS"))
    paged_attention(*decode)
    paged_attention(*extend)
    monkeypatch.setattr(pa, "DECODE_TUNING", {"splits_x": 2})
    got, got_lse = paged_attention(*decode)
    paged_attention(*extend)
    assert launched[2] == 2 * launched[0] and launched[3] == launched[1]
    _close(got, want, got_lse, want_lse)

