"""The residual stream between projections (engine/layers/residual.py): at decode the add rides on a layer's last GEMV
and the RMSNorm on the next one's first (kernels/gemv.py RESIDUAL and NORM), elsewhere the unfused ops run. On the
CPU the GEMV kernels run in Triton's interpreter, with a GEMV table made for the tiny model's shapes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from headroom.engine.layers import mlp, residual  # noqa: E402
from headroom.engine.layers.normed_rows import NormedRows  # noqa: E402
from headroom.engine.layers.residual import Projection, add_and_norm  # noqa: E402
from headroom.engine.llm import LLM  # noqa: E402
from headroom.kernels import ops  # noqa: E402
from headroom.kernels.norm import naive_add_rms_norm, naive_rms_norm  # noqa: E402

from tests.engine.helpers import random_prompt  # noqa: E402


class _EveryShape(dict):
    """A GEMV table with an entry for every shape and input kind at the given row counts: one row as bf16 pairs,
    several on the CUDA cores (the interpreter's bf16 dot is garbage)."""

    def __init__(self, rows: tuple[int, ...]):
        super().__init__()
        self.rows = rows

    def get(self, key, default=None):
        from headroom.kernels.gemv import GemvConfig

        if key[2] not in self.rows:
            return default
        return GemvConfig(block_n=16, block_k=32, split=2, num_stages=2, rows_on_cores=key[2] > 1)


def _generate(model_dir, vocab: int):
    llm = LLM(str(model_dir), dtype="bfloat16", max_total_tokens=512, ssm_slots=8, chunked_prefill_size=64,
              max_running_requests=2, cuda_graph_max_batch=0)
    prompts = [random_prompt(vocab, n, seed=n) for n in (5, 9)]
    return llm.generate(prompts, max_new_tokens=5, ignore_eos=True)


def _decode_logits(monkeypatch) -> list[torch.Tensor]:
    """Every decode pass's logits, recorded as the model returns them."""
    from headroom.engine.models.causal_lm import CausalLM

    logits: list[torch.Tensor] = []
    run = CausalLM.__call__

    def recorded(self, batch, *args, **kwargs):
        out = run(self, batch, *args, **kwargs)
        if batch.is_decode_only:
            logits.append(out.clone())
        return out

    monkeypatch.setattr(CausalLM, "__call__", recorded)
    return logits


def _count(monkeypatch, module, names: tuple[str, ...]) -> dict[str, list[int]]:
    """Each call of module.<name> recorded with its rows."""
    calls: dict[str, list[int]] = {name: [] for name in names}
    for name in names:
        def counted(*args, _run=getattr(module, name), _name=name, **kwargs):
            calls[_name].append(args[0].shape[0])
            return _run(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def test_decode_adds_and_norms_inside_the_gemvs(tiny_model_factory, monkeypatch):
    """A decode step with every projection in the GEMV table: the add rides on each out/down projection, Gated
    DeltaNet's output norm on its out-projection, and the next RMSNorm on the next projection (one norm kernel a
    step, the first layer's, against one a layer's norm before; no gated norm kernel), the same tokens as with
    HEADROOM_FUSED_RESIDUAL=0, and decode logits within bf16 rounding of them. (Config 2: heads of 16 value channels,
    whole heads in the table's 32-wide tiles.)"""
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels import norm_triton

    model_dir, reference = tiny_model_factory("qwen3_5", 2)
    vocab = reference.config.vocab_size
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(gemv_module, "_tuned", _EveryShape((1, 2)))
    monkeypatch.setattr(residual, "FUSED_RESIDUAL", False)
    monkeypatch.setattr(residual, "FUSED_ROWS", 16)  # the mechanism at two rows (shipped at one: FUSED_ROWS)
    monkeypatch.setattr(mlp, "FUSED_SWIGLU", True)  # as shipped, whatever HEADROOM_FUSED_SWIGLU says here
    unfused_norms = _count(monkeypatch, norm_triton, ("rms_norm", "gated_rms_norm"))
    unfused_logits = _decode_logits(monkeypatch)
    unfused = _generate(model_dir, vocab)
    monkeypatch.undo()

    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(gemv_module, "_tuned", _EveryShape((1, 2)))
    monkeypatch.setattr(residual, "FUSED_ROWS", 16)
    monkeypatch.setattr(mlp, "FUSED_SWIGLU", True)
    norms = _count(monkeypatch, norm_triton, ("rms_norm", "gated_rms_norm"))
    gemvs = _count(monkeypatch, gemv_module, ("residual_gemv", "normed_gemv", "conv_gemv", "swiglu_gemv"))
    fused_logits = _decode_logits(monkeypatch)
    fused = _generate(model_dir, vocab)
    layers = reference.config.num_hidden_layers
    gdn_layers = reference.config.layer_types.count("linear_attention")
    # every out-projection and down projection added its residual; the norms after them ran in the next GEMV
    # (each layer's first projection but the first layer's, and lm_head; a Gated DeltaNet layer's in-projection
    # is a conv_gemv, and the MLP's gate|up a swiglu_gemv (mlp.FUSED_SWIGLU), which norm as normed_gemv does); the
    # prefill pass (14 rows: no table entry) ran its norm kernels in both runs alike
    assert len(gemvs["residual_gemv"]) == len(gemvs["normed_gemv"]) + len(gemvs["conv_gemv"]) \
        + len(gemvs["swiglu_gemv"])
    steps, leftover = divmod(len(gemvs["residual_gemv"]), 2 * layers)
    assert steps >= 4 and leftover == 0 and len(gemvs["swiglu_gemv"]) == steps * layers
    assert len(unfused_norms["rms_norm"]) - len(norms["rms_norm"]) == steps * 2 * layers
    decode_gated = [rows for rows in norms["gated_rms_norm"] if rows <= 2]
    assert decode_gated == [] and \
        len(unfused_norms["gated_rms_norm"]) - len(norms["gated_rms_norm"]) == steps * gdn_layers
    for a, b in zip(unfused, fused, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.prompt_logits, a.prompt_logits, atol=0.0, rtol=0.0)  # prefill: unfused both
    assert len(fused_logits) == len(unfused_logits) == steps
    worst = max((f - u).abs().max().item() for f, u in zip(fused_logits, unfused_logits, strict=True))
    # (equal on this machine; the rows' 1 / rms is summed in another order, which may move a last bit; a residual
    # scaled by 0.99 in the add moves them by 0.1)
    assert worst <= 0.02


def test_fused_residual_off_or_outside_the_table_runs_the_norm_kernels(tiny_model_factory, monkeypatch):
    """HEADROOM_FUSED_RESIDUAL=0, or no table entry for two rows: no fused GEMV runs, the add and norm are
    add_rms_norm between the projections."""
    from headroom.kernels import gemv as gemv_module

    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(residual, "FUSED_ROWS", 16)
    # The two-row decode steps have no entry, nor a larger one to take (gemv.NEAREST_ROWS).
    monkeypatch.setattr(gemv_module, "_tuned", _EveryShape((1,)))
    gemvs = _count(monkeypatch, gemv_module, ("residual_gemv", "normed_gemv", "gemv"))
    _generate(model_dir, reference.config.vocab_size)
    assert gemvs["residual_gemv"] == gemvs["normed_gemv"] == []
    monkeypatch.setattr(gemv_module, "_tuned", _EveryShape((2,)))
    monkeypatch.setattr(residual, "FUSED_RESIDUAL", False)
    _generate(model_dir, reference.config.vocab_size)
    assert gemvs["residual_gemv"] == gemvs["normed_gemv"] == [] and 2 in gemvs["gemv"]  # plain GEMVs ran
    # As shipped (FUSED_ROWS 1), two-row steps do not fuse though the table has them.
    monkeypatch.setattr(residual, "FUSED_RESIDUAL", True)
    monkeypatch.setattr(residual, "FUSED_ROWS", 1)
    _generate(model_dir, reference.config.vocab_size)
    assert gemvs["residual_gemv"] == gemvs["normed_gemv"] == []


def test_add_and_norm_without_a_fused_gemv_is_add_rms_norm():
    """On the CPU (no fused GEMV): a Projection delta is run, then added and normed; a bias, a plain tensor and no
    delta at all take the same ops; tensor parallel's reduce runs on the projection's output first."""
    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(3, 8, generator=gen), torch.randn(3, 5, generator=gen)
    w, bias, norm = torch.randn(8, 5, generator=gen), torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    h, summed = add_and_norm(x, Projection(a, w, bias), norm, 1e-6, True)
    want_h, want_sum = naive_add_rms_norm(F.linear(a, w, bias), x, norm, 1e-6, True)
    assert torch.equal(h, want_h) and torch.equal(summed, want_sum)
    h, summed = add_and_norm(x, Projection(a, w), norm, 1e-6, False, reduce=lambda t: 2 * t)
    want_h, want_sum = naive_add_rms_norm(2 * F.linear(a, w), x, norm, 1e-6, False)
    assert torch.equal(h, want_h) and torch.equal(summed, want_sum)
    h, same = add_and_norm(x, None, norm, 1e-6, True)
    assert same is x and torch.equal(h, naive_rms_norm(x, norm, 1e-6, True))


def test_normed_rows_stand_in_for_the_normed_tensor():
    """NormedRows: the residual's shape, dtype and device; a linear with no fused GEMV norms them first (once)."""
    from headroom.engine.layers.linear import linear

    gen = torch.Generator().manual_seed(1)
    x, norm, w = torch.randn(2, 6, generator=gen), torch.randn(6, generator=gen), torch.randn(4, 6, generator=gen)
    rows = NormedRows(x, x.pow(2).sum(-1, keepdim=True), norm, 1e-6, True)
    assert rows.shape == x.shape and rows.dtype == x.dtype and rows.device == x.device and not rows.is_cuda
    normed = naive_rms_norm(x, norm, 1e-6, True)
    assert torch.equal(linear(rows, w), F.linear(normed, w))
    assert rows.tensor() is rows.tensor()


@pytest.mark.parametrize("up", [False, True])
def test_projection_runs_the_down_projection_with_its_activation(up):
    from headroom.kernels.gates import naive_silu_mul

    gen = torch.Generator().manual_seed(2)
    a, u, w = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen), torch.randn(3, 6, generator=gen)
    out = Projection(a, w, up=u if up else None).run()
    assert torch.equal(out, F.linear(naive_silu_mul(a, u) if up else a, w))


def test_a_short_prefill_pass_norms_in_the_gemvs_then_takes_its_last_rows(tiny_model_factory, monkeypatch):
    """A prefill pass of at most 16 rows (two prompts of 3 and 4 tokens: 7 rows) runs the same fused GEMVs as a
    decode step of 7 rows, its final norm included; lm_head then reads the two last rows (with their sums of
    squares). Its prompt logits are the unfused pass's within bf16 rounding, its tokens the same."""
    from headroom.kernels import gemv as gemv_module

    model_dir, reference = tiny_model_factory("qwen3_5", 2)
    vocab = reference.config.vocab_size

    def generate():
        llm = LLM(str(model_dir), dtype="bfloat16", max_total_tokens=512, ssm_slots=8, chunked_prefill_size=64,
                  max_running_requests=2, cuda_graph_max_batch=0)
        return llm.generate([random_prompt(vocab, n, seed=n) for n in (3, 4)], max_new_tokens=3, ignore_eos=True)

    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(gemv_module, "_tuned", _EveryShape((1, 2, 7)))
    monkeypatch.setattr(residual, "FUSED_ROWS", 16)
    monkeypatch.setattr(mlp, "FUSED_SWIGLU", True)  # as shipped, whatever HEADROOM_FUSED_SWIGLU says here
    monkeypatch.setattr(residual, "FUSED_RESIDUAL", False)
    unfused = generate()
    monkeypatch.setattr(residual, "FUSED_RESIDUAL", True)
    gemvs = _count(monkeypatch, gemv_module, ("residual_gemv", "normed_gemv", "swiglu_gemv"))
    fused = generate()
    layers = reference.config.num_hidden_layers
    assert gemvs["residual_gemv"].count(7) == 2 * layers
    # the norms ride on the next projection: each MLP's gate|up (its SwiGLU epilogue, mlp.FUSED_SWIGLU) and each
    # layer's first projection but the first layer's; lm_head's on two rows
    assert gemvs["swiglu_gemv"].count(7) == layers
    assert gemvs["normed_gemv"].count(7) == layers - 1 and gemvs["normed_gemv"].count(2) >= 1
    for a, b in zip(unfused, fused, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.prompt_logits, a.prompt_logits, atol=0.02, rtol=0.0)


def test_only_a_decode_sized_pass_defers_its_projection(monkeypatch):
    """residual.deferred: a module's last linear is left to the decoder layer only for at most FUSED_ROWS rows (one
    as shipped; never more than ops.GEMV_ROWS), where its GEMV may add the residual; a longer pass, or the fusion
    off, runs it at once, so that its inputs (and a Gated DeltaNet layer's in-projection output, which z views) are
    freed as the module returns."""
    from headroom.engine.layers.residual import deferred

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 6, generator=gen)
    short, long = torch.randn(ops.GEMV_ROWS, 6, generator=gen), torch.randn(ops.GEMV_ROWS + 1, 6, generator=gen)
    monkeypatch.setattr(residual, "PRESCALED_NORM", False)  # as shipped, whatever HEADROOM_PRESCALED_NORM says
    assert isinstance(deferred(Projection(short[:residual.FUSED_ROWS], w)), Projection)
    assert isinstance(deferred(Projection(short[:residual.FUSED_ROWS + 1], w)), torch.Tensor)
    monkeypatch.setattr(residual, "FUSED_ROWS", ops.GEMV_ROWS)
    assert isinstance(deferred(Projection(short, w)), Projection)
    ran = deferred(Projection(long, w))
    assert isinstance(ran, torch.Tensor) and torch.equal(ran, F.linear(long, w))
    monkeypatch.setattr(residual, "FUSED_RESIDUAL", False)
    assert isinstance(deferred(Projection(short, w)), torch.Tensor)


def test_as_shipped_a_lone_sequences_decode_fuses(tiny_model_factory, monkeypatch):
    """FUSED_ROWS as shipped (one row): a lone sequence's decode steps add and norm inside the GEMVs; its prefill (more
    rows) does not."""
    from headroom.kernels import gemv as gemv_module

    model_dir, reference = tiny_model_factory("qwen3_5", 2)
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(gemv_module, "_tuned", _EveryShape((1, 2, 6)))
    gemvs = _count(monkeypatch, gemv_module, ("residual_gemv", "normed_gemv"))
    llm = LLM(str(model_dir), dtype="bfloat16", max_total_tokens=512, ssm_slots=8, chunked_prefill_size=64,
              max_running_requests=2, cuda_graph_max_batch=0)
    llm.generate([random_prompt(reference.config.vocab_size, 6, seed=6)], max_new_tokens=4, ignore_eos=True)
    layers = reference.config.num_hidden_layers
    assert set(gemvs["residual_gemv"]) == {1} and len(gemvs["residual_gemv"]) == 3 * 2 * layers


def test_prescaled_norm_defers_every_decode_sized_pass(monkeypatch):
    """PRESCALED_NORM: passes past FUSED_ROWS up to ops.GEMV_ROWS leave their projection to the decoder layer too (its
    GEMV adds and applies the next norm's weight); longer ones still run it at once."""
    from headroom.engine.layers.residual import deferred

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(4, 6, generator=gen)
    monkeypatch.setattr(residual, "PRESCALED_NORM", True)
    assert isinstance(deferred(Projection(torch.randn(ops.GEMV_ROWS, 6, generator=gen), w)), Projection)
    assert isinstance(deferred(Projection(torch.randn(ops.GEMV_ROWS + 1, 6, generator=gen), w)), torch.Tensor)


def test_prescaled_norm_factors_the_norm_out_of_the_next_projection(tiny_model_factory, monkeypatch):
    """HEADROOM_PRESCALED_NORM=1 with FUSED_ROWS as shipped: two-row decode steps add each out/down projection in its
    GEMV, which also stores the sum times the next norm's weight (residual_prescaled_gemv), and the next projection
    reads those rows and scales its output rows by their 1 / rms (normed_gemv / swiglu_gemv with a prescaled
    RowNorm), so a step runs one norm kernel (the first layer's) where it ran one a layer's norm; Gated DeltaNet's
    output norm still runs as its own kernel, once; the same tokens, and decode logits within bf16 rounding of
    those with it off (the rounding falls on r * (1 + g) instead of the normed row)."""
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels import norm_triton

    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    vocab = reference.config.vocab_size
    layers = reference.config.num_hidden_layers
    gdn_layers = reference.config.layer_types.count("linear_attention")
    runs = {}
    for prescaled in (False, True):
        monkeypatch.setattr(ops, "_fused", lambda x, op: True)
        monkeypatch.setattr(gemv_module, "_tuned", _EveryShape((1, 2)))
        monkeypatch.setattr(residual, "FUSED_ROWS", 1)
        monkeypatch.setattr(residual, "PRESCALED_NORM", prescaled)
        monkeypatch.setattr(mlp, "FUSED_SWIGLU", True)
        norms = _count(monkeypatch, norm_triton, ("rms_norm", "gated_rms_norm"))
        gemvs = _count(monkeypatch, gemv_module, ("residual_prescaled_gemv",))
        gemvs["row_scaled"] = []

        def launched(x, *args, _run=gemv_module._launch, _scaled=gemvs["row_scaled"], **kwargs):
            norm = kwargs.get("norm")
            if norm is not None and norm.prescaled:
                _scaled.append((x.shape[0], kwargs.get("swiglu", False)))
            return _run(x, *args, **kwargs)

        monkeypatch.setattr(gemv_module, "_launch", launched)
        logits = _decode_logits(monkeypatch)
        runs[prescaled] = (_generate(model_dir, vocab), norms, gemvs, logits)
        monkeypatch.undo()
    (off, off_norms, off_gemvs, off_logits), (on, on_norms, on_gemvs, on_logits) = runs[False], runs[True]
    assert off_gemvs["residual_prescaled_gemv"] == []
    prescaled = on_gemvs["residual_prescaled_gemv"]
    steps, leftover = divmod(len(prescaled), 2 * layers)
    assert steps >= 4 and leftover == 0 and set(prescaled) == {2}
    # every layer's first projection but the first layer's, each MLP's gate|up (SwiGLU's epilogue) and lm_head
    # read the prescaled rows
    assert off_gemvs["row_scaled"] == []
    assert on_gemvs["row_scaled"].count((2, True)) == steps * layers
    assert on_gemvs["row_scaled"].count((2, False)) == steps * layers
    assert [rows for rows in on_norms["rms_norm"] if rows == 2] == [2] * steps  # the first layer's, each step
    assert len(off_norms["rms_norm"]) - len(on_norms["rms_norm"]) == steps * 2 * layers
    assert [rows for rows in on_norms["gated_rms_norm"] if rows == 2] == [2] * (steps * gdn_layers)
    # (and no pass runs one twice: the prefill's 14 rows have no table entry, so its GEMVs fall back)
    assert sorted(on_norms["gated_rms_norm"]) == sorted(off_norms["gated_rms_norm"])
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids
    assert len(on_logits) == len(off_logits) >= steps
    worst = max((t - u).abs().max().item() for t, u in zip(on_logits, off_logits, strict=True))
    scale = max(u.abs().max().item() for u in off_logits)
    assert worst <= 0.03 * scale, (worst, scale)
