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


def _mlp(tiny_model_factory) -> tuple[SwiGLU, dict[str, torch.Tensor], int]:
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


def test_gate_and_up_rows_interleave_and_the_cpu_path_is_silu_mul_of_the_pairs(tiny_model_factory):
    mlp, w, hidden = _mlp(tiny_model_factory)
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

    mlp, w, hidden = _mlp(tiny_model_factory)
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

    mlp, w, hidden = _mlp(tiny_model_factory)
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
