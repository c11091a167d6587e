"""fla-core's Gated DeltaNet against naive_gated_delta_rule (GPU only); the shape checks run everywhere."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.gdn_fla import fla_available, gated_delta_rule_varlen, naive_gated_delta_rule_varlen


def _inputs(lens, hk, hv, dk, dv, device):
    gen = torch.Generator().manual_seed(0)
    n = sum(lens)
    q, k = (torch.randn(n, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    states = torch.randn(len(lens), hv, dk, dv, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return [t.to(device) for t in (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), states, cu)]


def test_bad_state_shape_names_the_numbers():
    q, k, v, g, beta, states, cu = _inputs([3, 2], 2, 4, 16, 16, "cpu")
    with pytest.raises(ValueError, match=r"states \(1, 4, 16, 16\) must be \[2, 4, 16, 16\]"):
        naive_gated_delta_rule_varlen(q, k, v, g, beta, states[:1], cu)


@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core")
@pytest.mark.parametrize("lens", [[1, 1, 1], [70, 1, 129]])
def test_fla_matches_naive(lens):
    args = _inputs(lens, 2, 4, 128, 128, "cuda")
    out, final = gated_delta_rule_varlen(*args)
    ref, ref_final = naive_gated_delta_rule_varlen(*args)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(final, ref_final, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core")
def test_normed_one_row_pieces_take_the_chunked_kernel():
    """A round of in-pass checkpoints whose every piece is one row, q/k normed by the conv: ops takes fla's chunked
    kernel (its recurrent one would norm them again) and matches the reference on the raw q/k."""
    from headroom.kernels import ops
    from headroom.kernels.norm import naive_l2_norm

    q, k, v, g, beta, states, cu = _inputs([1, 1, 1], 2, 4, 128, 128, "cuda")
    out, final = ops.gated_delta_rule_varlen(naive_l2_norm(q, 1e-6), naive_l2_norm(k, 1e-6), v, g, beta, states, cu,
                                             cu.cpu(), qk_normed=True)
    ref, ref_final = naive_gated_delta_rule_varlen(q, k, v, g, beta, states, cu)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(final, ref_final, atol=3e-2, rtol=3e-2)


def test_chunk_index_lists_each_sequence_s_chunks_in_order():
    """What fla's prepare_chunk_indices gives (sequence, chunk within it), built on the host: a sequence of n rows
    has ceil(n / 64) chunks, an empty one none."""
    from headroom.kernels.gdn_fla import chunk_index

    index = chunk_index([0, 64, 65, 65, 200])
    assert index.dtype == torch.long and index.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [3, 2]]
    assert chunk_index([0, 0]).shape == (0, 2)


@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core")
def test_chunk_index_is_fla_s_own():
    from fla.ops.utils.index import prepare_chunk_indices
    from headroom.kernels.gdn_fla import chunk_index

    for bounds in ([0, 64, 65, 65, 200], [0, 8192], [0, 1, 2, 3], [0, 100, 8292, 8300]):
        cu = torch.tensor(bounds, device="cuda")
        assert torch.equal(chunk_index(bounds).cuda(), prepare_chunk_indices(cu, 64))


def _slow_module(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)


def test_fla_imports_on_its_own_thread_and_callers_wait_for_it(tmp_path, monkeypatch):
    """import_in_background imports on a thread of its own; wait_for_import returns once the module is imported;
    a second call starts nothing."""
    import sys

    from headroom.kernels import gdn_fla

    _slow_module(tmp_path, monkeypatch, "slow_fla_stand_in",
                 "import threading, time\ntime.sleep(0.3)\nTHREAD = threading.current_thread().name\n")
    monkeypatch.setattr(gdn_fla, "_importing", None)
    started = gdn_fla.import_in_background("slow_fla_stand_in")
    assert started is not None and started.is_alive()  # still sleeping on its thread
    gdn_fla.wait_for_import()
    assert sys.modules["slow_fla_stand_in"].THREAD == "headroom-fla-import"
    assert gdn_fla.import_in_background("slow_fla_stand_in") is None


def test_an_import_that_fails_ahead_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    """The failure is the call's own import's to raise, where it always did."""
    import sys

    from headroom.kernels import gdn_fla

    _slow_module(tmp_path, monkeypatch, "broken_fla_stand_in", "raise ImportError('libcuda.so.1: not found')\n")
    monkeypatch.setattr(gdn_fla, "_importing", None)
    gdn_fla.import_in_background("broken_fla_stand_in")
    gdn_fla.wait_for_import()
    assert "broken_fla_stand_in" not in sys.modules
    assert "importing broken_fla_stand_in ahead failed: ImportError: libcuda.so.1: not found" in caplog.text


def test_the_context_the_import_set_reaches_every_thread_that_waits_for_it(tmp_path, monkeypatch):
    """fla's import sets Triton's allocator (a ContextVar) on TMA GPUs: on its own thread that would be lost to the
    threads that launch fla's kernels. Each thread that waits takes it, unless it set its own."""
    import threading

    from headroom.kernels import gdn_fla

    _slow_module(tmp_path, monkeypatch, "allocator_holder",
                 "import contextvars\nALLOCATOR = contextvars.ContextVar('_allocator', default='none')\n"
                 "OTHER = contextvars.ContextVar('fla_dplr_cp_context', default='none')\n")
    _slow_module(tmp_path, monkeypatch, "fla_setting_an_allocator",
                 "import allocator_holder\nallocator_holder.ALLOCATOR.set('fla scratch')\n"
                 "allocator_holder.OTHER.set('import-time state')\n")
    import allocator_holder  # type: ignore[import-not-found]

    monkeypatch.setattr(gdn_fla, "_importing", None)
    monkeypatch.setattr(gdn_fla, "_import_context", [])
    monkeypatch.setattr(gdn_fla, "_context_taken", threading.local())
    gdn_fla.import_in_background("fla_setting_an_allocator")
    seen: dict[str, str] = {}

    def launcher(name: str, own: str | None = None) -> None:
        if own is not None:
            allocator_holder.ALLOCATOR.set(own)
        gdn_fla.wait_for_import()
        seen[name] = allocator_holder.ALLOCATOR.get()
        seen[name + " other"] = allocator_holder.OTHER.get()

    threads = [threading.Thread(target=launcher, args=("engine",)),
               threading.Thread(target=launcher, args=("user", "user's own"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Triton's allocator only (CONTEXT_TAKEN): the import's other context stays on its thread.
    assert seen == {"engine": "fla scratch", "user": "user's own", "engine other": "none", "user other": "none"}


def test_the_gated_delta_call_waits_for_the_import_before_its_own(monkeypatch):
    """gated_delta_rule_varlen joins the import ahead before importing fla itself (two threads never import it
    at once). fla stands in as modules that record the order."""
    import sys
    import types

    from headroom.kernels import gdn_fla

    order: list[str] = []
    ops = types.ModuleType("fla.ops.gated_delta_rule")

    def recurrent(q, k, v, **kwargs):
        order.append("fla recurrent")
        return v.clone(), kwargs["initial_state"].clone()

    ops.fused_recurrent_gated_delta_rule = recurrent
    ops.chunk_gated_delta_rule = None
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.gated_delta_rule", ops)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(gdn_fla, "wait_for_import", lambda: order.append("waited"))
    q, k, v, g, beta, states, cu = _inputs([1, 1, 1], 2, 4, 16, 16, "cpu")
    out, final = gated_delta_rule_varlen(q, k, v, g, beta, states, cu)
    assert order == ["waited", "fla recurrent"] and out.shape == v.shape and final.shape == states.shape
