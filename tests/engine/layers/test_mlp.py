"""The SwiGLU MLP (engine/layers/mlp.py): dense gate and up rows kept interleaved in one weight; on the CPU one GEMM,
silu_mul of its even and odd columns, then the down projection; where the GEMV table has the gate|up shape at the
row count (CUDA decode; here the Triton interpreter with a patched table), the activation made in that GEMV's
epilogue, bit for bit the GEMV then silu_mul, and no silu_mul launch. The fused down projection (silu_mul input)
for halves that come apart (a quantized gate|up)."""

from __future__ import annotations

import os

# triton.jit reads this when a kernel module is first imported (here, inside ops' fused branches).
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from headroom.engine.layers.mlp import SwiGLU, interleave_gate_up  # noqa: E402
from headroom.engine.layers.residual import Projection  # noqa: E402
from headroom.engine.runtime.loader import load_config, load_weights  # noqa: E402
from headroom.kernels import ops  # noqa: E402
from headroom.kernels.gates import naive_silu_mul  # noqa: E402


def _mlp(tiny_model_factory, monkeypatch) -> tuple[SwiGLU, dict[str, torch.Tensor], int]:
    from headroom.engine.layers import mlp as mlp_module

    monkeypatch.setattr(mlp_module, "FUSED_SWIGLU", True)
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    config = load_config(model_dir)
    weights = load_weights(model_dir, torch.bfloat16, torch.device("cpu"))
    prefix = "model.layers.0.mlp."
    originals = {name: weights[prefix + name + ".weight"].clone() for name in ("gate_proj", "up_proj", "down_proj")}
    mlp = SwiGLU(config, weights, prefix)
    # the parts leave the weights as they are interleaved (loading holds one layer's twice at most)
    assert prefix + "gate_proj.weight" not in weights and prefix + "up_proj.weight" not in weights
    return mlp, originals, config.hidden_size


def _counted_silu_mul(monkeypatch) -> list[tuple[int, int]]:
    """Each gates_triton.silu_mul launch recorded: (rows, the gate's column stride)."""
    from headroom.kernels import gates_triton

    calls: list[tuple[int, int]] = []
    run = gates_triton.silu_mul

    def counted(gate, up):
        calls.append((gate.shape[0], gate.stride(-1)))
        return run(gate, up)

    monkeypatch.setattr(gates_triton, "silu_mul", counted)
    return calls


def test_gate_and_up_rows_interleave_and_the_cpu_path_is_silu_mul_of_the_pairs(tiny_model_factory, monkeypatch):
    mlp, w, hidden = _mlp(tiny_model_factory, monkeypatch)
    assert mlp.interleaved is not None
    assert torch.equal(mlp.interleaved[0::2], w["gate_proj"]) and torch.equal(mlp.interleaved[1::2], w["up_proj"])
    assert torch.equal(interleave_gate_up(w["gate_proj"], w["up_proj"]), mlp.interleaved)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    pairs = F.linear(x, mlp.interleaved)
    torch.testing.assert_close(pairs[:, 0::2], F.linear(x, w["gate_proj"]), atol=1e-2, rtol=1e-2)
    assert torch.equal(mlp(x), F.linear(naive_silu_mul(pairs[:, 0::2], pairs[:, 1::2]), w["down_proj"]))


def test_decode_makes_the_activation_in_the_gate_up_gemv_where_the_table_has_it(tiny_model_factory, monkeypatch):
    from headroom.kernels import gates_triton
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import GemvConfig, gemv

    mlp, w, hidden = _mlp(tiny_model_factory, monkeypatch)
    assert mlp.interleaved is not None
    inter = w["down_proj"].shape[1]
    config = GemvConfig(block_n=16, block_k=32, split=2, num_stages=2)
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)  # CUDA-like: the kernels in the interpreter
    monkeypatch.setattr(gemv_module, "_tuned", {(2 * inter, hidden, 1, "x"): config})
    calls = _counted_silu_mul(monkeypatch)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    one = mlp.projection(x[:1])  # one row: the table's gate|up entry, the activation in its epilogue
    assert calls == [] and one.up is None
    pairs = gemv(x[:1], mlp.interleaved, config)
    assert torch.equal(one.a, gates_triton.silu_mul(pairs[:, 0::2], pairs[:, 1::2]))
    calls.clear()
    both = mlp(x)  # two rows: no entry, cuBLAS's pairs, then silu_mul on the strided halves
    assert calls == [(2, 2)]
    reference = F.linear(x, mlp.interleaved)
    torch.testing.assert_close(both, F.linear(naive_silu_mul(reference[:, 0::2], reference[:, 1::2]), w["down_proj"]),
                               atol=2e-2, rtol=2e-2)
    # Either op on its reference (set_fused's off, the logit check's ablation) turns the epilogue off.
    monkeypatch.setattr(ops, "_fused", lambda x, op: op != "silu_mul")

    def refuse(*args, **kwargs):
        raise AssertionError("the gate|up epilogue ran with silu_mul on its reference")

    monkeypatch.setattr(gemv_module, "swiglu_gemv", refuse)
    torch.testing.assert_close(mlp(x[:1]), F.linear(one.a, w["down_proj"]), atol=2e-2, rtol=2e-2)


def test_halves_that_come_apart_take_the_fused_down_projection_where_the_table_has_it(tiny_model_factory, monkeypatch):
    """A gate|up that stays stacked (a quantized one) hands contiguous-column halves to the down projection: where
    the table has the fused down shape, its GEMV makes the activation as it loads it, no silu_mul launch; strided
    halves (the interleaved pairs) never take it."""
    from headroom.kernels import gates_triton
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import GemvConfig, gemv

    mlp, w, hidden = _mlp(tiny_model_factory, monkeypatch)
    inter = w["down_proj"].shape[1]
    config = GemvConfig(block_n=16, block_k=32, split=2, num_stages=2)
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(gemv_module, "_tuned", {(hidden, inter, 1, "silu_mul"): config})
    calls = _counted_silu_mul(monkeypatch)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    gate, up = torch.split(F.linear(x, torch.cat((w["gate_proj"], w["up_proj"]))), inter, dim=-1)
    fused = Projection(gate, mlp.down, up=up).run()
    assert calls == []
    assert torch.equal(fused, gemv(gates_triton.silu_mul(gate, up), w["down_proj"], config))
    calls.clear()
    pairs = F.linear(x, mlp.interleaved)
    Projection(pairs[:, 0::2], mlp.down, up=pairs[:, 1::2]).run()
    assert calls == [(1, 2)]


def test_on_as_shipped_and_off_the_halves_stay_stacked(tiny_model_factory, monkeypatch):
    """FUSED_SWIGLU on as shipped (measured on an H100 in session 30) and off (HEADROOM_FUSED_SWIGLU=0):
    MergedLinear's stacked halves, as before the epilogue; at most FUSED_SWIGLU_ROWS rows take the epilogue when on
    (more: the pairs, then silu_mul)."""
    from headroom.engine.layers import mlp as mlp_module
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import GemvConfig

    # on unless HEADROOM_FUSED_SWIGLU says otherwise (anything but 1 turns it off, as the other switches)
    assert mlp_module.FUSED_SWIGLU is (os.environ.get("HEADROOM_FUSED_SWIGLU", "1") == "1")
    monkeypatch.setattr(mlp_module, "FUSED_SWIGLU", False)
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    config = load_config(model_dir)
    weights = load_weights(model_dir, torch.bfloat16, torch.device("cpu"))
    mlp = SwiGLU(config, weights, "model.layers.0.mlp.")
    assert mlp.interleaved is None and len(mlp.gate_up.weights) == 1
    on, w, hidden = _mlp(tiny_model_factory, monkeypatch)
    inter = w["down_proj"].shape[1]
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(gemv_module, "_tuned", {(2 * inter, hidden, 2, "x"): GemvConfig(block_n=16, block_k=32)})
    monkeypatch.setattr(mlp_module, "FUSED_SWIGLU_ROWS", 1)
    calls = _counted_silu_mul(monkeypatch)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert on.projection(x).up is not None and calls == []
    on(x)
    assert calls == [(2, 2)]


def test_the_engine_with_the_epilogue_decodes_the_same_bits(tiny_model_factory, monkeypatch):
    """The whole engine with every projection in the GEMV table (the interpreter), FUSED_SWIGLU on against off:
    no silu_mul launch in any decode step on (one-row steps norm their rows in the same launch, residual.py), the
    same tokens and decode logits bit for bit (the epilogue rounds the pairs as the GEMV stores them, then as
    silu_mul does)."""
    from headroom.engine.layers import mlp as mlp_module
    from headroom.kernels import gemv as gemv_module

    from tests.engine.layers.test_residual import _decode_logits, _EveryShape, _generate

    model_dir, reference = tiny_model_factory("qwen3_5", 2)
    vocab = reference.config.vocab_size
    class PlainShapes(_EveryShape):
        """Every plain shape, no fused down projection (as the H100's table): off, silu_mul runs at decode."""

        def get(self, key, default=None):
            return default if key[3] == "silu_mul" else super().get(key, default)

    runs = {}
    for on in (False, True):
        monkeypatch.setattr(ops, "_fused", lambda x, op: True)
        monkeypatch.setattr(gemv_module, "_tuned", PlainShapes((1, 2)))
        monkeypatch.setattr(mlp_module, "FUSED_SWIGLU", on)
        calls = _counted_silu_mul(monkeypatch)
        logits = _decode_logits(monkeypatch)
        outputs = _generate(model_dir, vocab)
        monkeypatch.undo()
        runs[on] = (outputs, logits, calls)
    (off_out, off_logits, off_calls), (on_out, on_logits, on_calls) = runs[False], runs[True]
    layers = reference.config.num_hidden_layers
    decode_calls = {on: [rows for rows, _ in runs[on][2] if rows <= 2] for on in (False, True)}
    assert len(decode_calls[False]) == len(off_logits) * layers and decode_calls[True] == []
    # prefill passes take the pairs path on: silu_mul on the strided halves
    assert {stride for _, stride in off_calls} == {1} and {stride for _, stride in on_calls} == {2}
    assert [o.token_ids for o in on_out] == [o.token_ids for o in off_out]
    assert len(on_logits) == len(off_logits) >= 4
    for a, b in zip(off_logits, on_logits, strict=True):
        assert torch.equal(a, b)
