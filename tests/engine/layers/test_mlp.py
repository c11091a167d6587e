"""The SwiGLU MLP (engine/layers/mlp.py): on the CPU silu_mul then the down projection, as before the fused path;
where the GEMV table has the fused down shape at the row count (CUDA decode; here the Triton interpreter with a
patched table), one fused GEMV whose result is silu_mul then the same GEMV, bit for bit, and no silu_mul launch."""

from __future__ import annotations

import os

# triton.jit reads this when a kernel module is first imported (here, inside ops' fused branches).
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from headroom.engine.layers.mlp import SwiGLU  # noqa: E402
from headroom.engine.runtime.loader import load_config, load_weights  # noqa: E402
from headroom.kernels import ops  # noqa: E402
from headroom.kernels.gates import naive_silu_mul  # noqa: E402


def _mlp(tiny_model_factory) -> tuple[SwiGLU, dict[str, torch.Tensor], int]:
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    config = load_config(model_dir)
    weights = load_weights(model_dir, torch.bfloat16, torch.device("cpu"))
    prefix = "model.layers.0.mlp."
    originals = {name: weights[prefix + name + ".weight"].clone() for name in ("gate_proj", "up_proj", "down_proj")}
    return SwiGLU(config, weights, prefix), originals, config.hidden_size


def test_cpu_path_is_silu_mul_then_down(tiny_model_factory):
    mlp, w, hidden = _mlp(tiny_model_factory)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    gate, up = mlp.gate_up(x)
    torch.testing.assert_close(gate, F.linear(x, w["gate_proj"]), atol=1e-2, rtol=1e-2)
    assert torch.equal(mlp(x), F.linear(naive_silu_mul(gate, up), w["down_proj"]))


def test_decode_takes_the_fused_down_projection_where_the_table_has_it(tiny_model_factory, monkeypatch):
    from headroom.kernels import gates_triton
    from headroom.kernels import gemv as gemv_module
    from headroom.kernels.gemv import GemvConfig, gemv

    mlp, w, hidden = _mlp(tiny_model_factory)
    inter = w["down_proj"].shape[1]
    config = GemvConfig(block_n=16, block_k=32, split=2, num_stages=2)
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)  # CUDA-like: the kernels in the interpreter
    monkeypatch.setattr(gemv_module, "_tuned", {(hidden, inter, 1, "silu_mul"): config})
    silu_mul_calls = []
    silu_mul = gates_triton.silu_mul

    def counted(gate, up):
        silu_mul_calls.append(gate.shape[0])
        return silu_mul(gate, up)

    monkeypatch.setattr(gates_triton, "silu_mul", counted)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    gate, up = mlp.gate_up(x)
    fused = mlp(x[:1])  # one row: the table's fused entry
    assert silu_mul_calls == []
    assert torch.equal(fused, gemv(silu_mul(gate[:1], up[:1]), w["down_proj"], config))
    both = mlp(x)  # two rows: no entry, silu_mul then the down projection (cuBLAS)
    assert silu_mul_calls == [2]
    torch.testing.assert_close(both, F.linear(naive_silu_mul(gate, up), w["down_proj"]), atol=2e-2, rtol=2e-2)
    # Either op on its reference (set_fused's off, the logit check's ablation) turns the fused path off.
    monkeypatch.setattr(ops, "_fused", lambda x, op: op != "silu_mul")

    def refuse(*args):
        raise AssertionError("the fused down projection ran with silu_mul on its reference")

    monkeypatch.setattr(gemv_module, "silu_mul_gemv", refuse)
    torch.testing.assert_close(mlp(x[:1]), fused, atol=2e-2, rtol=2e-2)
