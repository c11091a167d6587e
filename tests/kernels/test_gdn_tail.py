"""The Gated DeltaNet tail kernel (kernels/gdn_decode.py gated_delta_tail, Triton interpreter on CPU) against
naive_gated_delta_tail, and that reference against the plain recurrence run piece by piece: outputs at every row,
the final states, and each snapshot equal to the state a run that stopped there ends with; q/k normed in the kernel
or already (qk_normed, the prefill conv's norm); and ops.gated_delta_tail's snapshot tables."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels import ops
from headroom.kernels.gated_delta import naive_gated_delta_rule, naive_gated_delta_tail
from headroom.kernels.gdn_decode import gated_delta_tail
from headroom.kernels.norm import naive_l2_norm

TOL = {"atol": 2e-5, "rtol": 2e-5}
# Three sequences' pieces in one flattened batch (rows), with their snapshots (rows done, pool slot).
ROWS = [(0, 9), (9, 10), (14, 40)]
SNAPSHOTS = [[(3, 5), (8, 1)], [], [(1, 0), (25, 2), (13, 4)][::2]]


def _inputs(n=40, hk=2, hv=4, dk=16, dv=24, seqs=3, slots=6, qk_normed=False):
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(n, hk, 2 * dk, generator=gen)[..., :dk] for _ in range(2))  # strided rows, as q|k cut
    if qk_normed:  # the conv's planes: contiguous, each head L2-normed
        q, k = naive_l2_norm(q, 1e-6), naive_l2_norm(k, 1e-6)
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    states = torch.randn(seqs, hv, dk, dv, generator=gen) * 0.1
    pool = torch.zeros(slots, hv, dk, dv)
    return q, k, v, g, beta, states, pool


def test_reference_equals_runs_that_stop_at_each_snapshot():
    q, k, v, g, beta, states, pool = _inputs()
    out = torch.full_like(v, float("nan"))
    start_states = states.clone()
    naive_gated_delta_tail(q, k, v, g, beta, states, out, pool, [a for a, _ in ROWS], [b for _, b in ROWS], SNAPSHOTS)
    for b, (lo, hi) in enumerate(ROWS):
        want, final = naive_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], start_states[b])
        torch.testing.assert_close(out[lo:hi], want, **TOL)
        torch.testing.assert_close(states[b], final, **TOL)
        for n, slot in SNAPSHOTS[b]:
            _, at = naive_gated_delta_rule(q[lo:lo + n], k[lo:lo + n], v[lo:lo + n], g[lo:lo + n], beta[lo:lo + n],
                                           start_states[b])
            torch.testing.assert_close(pool[slot], at, **TOL)
    assert out[10:14].isnan().all()  # rows of no sequence are left alone


def test_reference_takes_normed_qk():
    """qk_normed on normed q/k gives what the reference's own norm gives on the raw ones."""
    q, k, v, g, beta, states, pool = _inputs()
    lo, hi = [a for a, _ in ROWS], [b for _, b in ROWS]
    want_states, want_pool, want_out = states.clone(), pool.clone(), torch.zeros_like(v)
    naive_gated_delta_tail(q, k, v, g, beta, want_states, want_out, want_pool, lo, hi, SNAPSHOTS)
    out = torch.zeros_like(v)
    naive_gated_delta_tail(naive_l2_norm(q, 1e-6), naive_l2_norm(k, 1e-6), v, g, beta, states, out, pool, lo, hi,
                           SNAPSHOTS, qk_normed=True)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(states, want_states, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


@pytest.mark.parametrize("qk_normed", [False, True], ids=["norm in kernel", "qk_normed"])
@pytest.mark.parametrize("config", [None, {"block_v": 16, "num_warps": 4}, {"block_v": 8, "num_warps": 1}])
@pytest.mark.parametrize("width", [2, 4])
def test_kernel_matches_the_reference(width, config, qk_normed):
    """Width 2: sequences 0 and 2 fill the table, so the look-up past their last snapshot is masked off."""
    q, k, v, g, beta, states, pool = _inputs(qk_normed=qk_normed)
    want_states, want_pool, want_out = states.clone(), pool.clone(), torch.zeros_like(v)
    naive_gated_delta_tail(q, k, v, g, beta, want_states, want_out, want_pool, [a for a, _ in ROWS],
                           [b for _, b in ROWS], SNAPSHOTS, qk_normed)
    out = torch.zeros_like(v)
    at = torch.tensor([[n for n, _ in s] + [0] * (width - len(s)) for s in SNAPSHOTS], dtype=torch.int32)
    slot = torch.tensor([[x for _, x in s] + [0] * (width - len(s)) for s in SNAPSHOTS], dtype=torch.int32)
    gated_delta_tail(q, k, v, g, beta, states, out, pool, torch.tensor([a for a, _ in ROWS], dtype=torch.int32),
                     torch.tensor([b for _, b in ROWS], dtype=torch.int32), at, slot, qk_normed=qk_normed,
                     config=config)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(states, want_states, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


@pytest.mark.parametrize("qk_normed", [False, True], ids=["norm in kernel", "qk_normed"])
def test_op_launches_the_kernel_as_the_reference_runs(monkeypatch, qk_normed):
    """ops.gated_delta_tail on the fused path (the interpreter standing in for CUDA): snapshot lists into padded
    tables, qk_normed passed on; the same outputs, states and pool slots as its CPU path (the reference).
    Snapshots at a piece's first and second-to-last row, and one sequence with none."""
    from headroom.kernels import gdn_decode

    q, k, v, g, beta, states, pool = _inputs(qk_normed=qk_normed)
    lo, hi, snapshots = [0, 9, 14], [9, 10, 40], [[(1, 5), (8, 1)], [], [(13, 4), (25, 2)]]
    want_states, want_pool, want_out = states.clone(), pool.clone(), torch.zeros_like(v)
    ops.gated_delta_tail(q, k, v, g, beta, want_states, want_out, want_pool, ops.TailIndex(lo, hi, snapshots), qk_normed)
    launched = []
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(gdn_decode, "gated_delta_tail",
                        lambda *a, _run=gdn_decode.gated_delta_tail, **kw: launched.append(kw) or _run(*a, **kw))
    out = torch.zeros_like(v)
    ops.gated_delta_tail(q, k, v, g, beta, states, out, pool, ops.TailIndex(lo, hi, snapshots), qk_normed)
    assert launched == [{"qk_normed": qk_normed}]
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(states, want_states, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


def test_an_index_uploads_its_tables_once_for_every_layer(monkeypatch):
    """A pass's TailIndex serves all its layers: the fused path's four tables go to the device at the first launch
    only (they were four host-to-device copies in every layer), padded to the fixed snapshot width."""
    from headroom.kernels import gdn_decode

    q, k, v, g, beta, states, pool = _inputs()
    index = ops.TailIndex([0, 9, 14], [9, 10, 40], [[(1, 5), (8, 1)], [], [(13, 4)]])
    uploads, launched = [], []
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(ops, "to_device", lambda values, *a, _run=ops.to_device: uploads.append(values) or _run(values, *a))
    monkeypatch.setattr(gdn_decode, "gated_delta_tail",
                        lambda *a, _run=gdn_decode.gated_delta_tail, **kw: launched.append(a[8:12]) or _run(*a, **kw))
    for _layer in range(3):
        ops.gated_delta_tail(q, k, v, g, beta, states.clone(), torch.zeros_like(v), pool.clone(), index)
    assert len(launched) == 3 and len(uploads) == 4
    assert all(got is first for tables in launched for got, first in zip(tables, launched[0], strict=True))
    assert uploads[2] == [[1, 8] + [0] * 6, [0] * 8, [13] + [0] * 7]
    assert uploads[3] == [[5, 1] + [0] * 6, [0] * 8, [4] + [0] * 7]


def test_bad_shapes_are_named():
    q, k, v, g, beta, states, pool = _inputs()
    rows = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"states \(2, 4, 16, 24\)"):
        gated_delta_tail(q, k, v, g, beta, states[:2], torch.zeros_like(v), pool, rows, rows,
                         torch.zeros(3, 1, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32))
