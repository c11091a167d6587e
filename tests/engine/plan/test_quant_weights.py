"""The planner prices quantized weights: from the checkpoint's safetensors headers (codes and scales as stored)
or, from a config.json alone, from shapes at the format's bytes; the plan reports the format."""

from __future__ import annotations

import json

import pytest
from headroom.engine.plan import Pinned, PlanRequest, Targets, geometry_from_config, load_geometry, make_plan
from headroom.engine.plan.geometry import GeometryError, safetensors_weight_bytes
from headroom.engine.plan.presets import preset_config
from headroom.engine.plan.report import render_plan
from headroom.engine.runtime.quant_checkpoint import fp8_block_config, int4_pack_config

from tests.engine.quant_checkpoints import build_dense, write_fp8, write_gptq, write_int4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    dense = build_dense("qwen3_5", root / "dense")
    return {"dense": dense, "fp8": write_fp8(dense, root / "fp8", (16, 32)),
            "int4-sym": write_int4(dense, root / "int4s", symmetric=True),
            "int4-asym": write_int4(dense, root / "int4a", symmetric=False),
            "gptq": write_gptq(dense, root / "gptq", symmetric=True)}


@pytest.mark.parametrize("fmt", ["dense", "fp8", "int4-sym", "int4-asym", "gptq"])
def test_shape_estimate_equals_the_headers(checkpoints, fmt):
    """The config.json-only estimate (what a ConfigMap plans with) is exact on a dense-MLP hybrid."""
    model_dir = checkpoints[fmt]
    measured = load_geometry(model_dir)
    estimated = geometry_from_config(json.loads((model_dir / "config.json").read_text()))
    assert measured.weight_bytes == safetensors_weight_bytes(model_dir)
    assert estimated.weight_bytes is None
    assert estimated.total_weight_bytes() == measured.weight_bytes


def test_quantized_checkpoints_are_smaller_and_the_plan_says_the_format(checkpoints):
    sizes = {fmt: load_geometry(path).total_weight_bytes() for fmt, path in checkpoints.items()}
    assert sizes["int4-sym"] < sizes["int4-asym"] < sizes["fp8"] < sizes["dense"]
    assert sizes["int4-sym"] < sizes["gptq"] < sizes["fp8"]  # GPTQ keeps zero points and g_idx
    assert load_geometry(checkpoints["gptq"]).weight_format == "int4 W4A16, group 16, symmetric (GPTQ, gptq)"
    plan = make_plan(PlanRequest(geometry=load_geometry(checkpoints["int4-asym"]), gpu_memory_bytes=2 * 1024**3,
                                 targets=Targets(context_length=4096, max_running_requests=2)))
    assert plan.weight_format == "int4 W4A16, group 16, asymmetric"
    assert plan.ledger["weights"] == sizes["int4-asym"]
    assert "weights               int4 W4A16, group 16, asymmetric" in render_plan(plan)


@pytest.mark.parametrize(("quant", "ratio"), [(fp8_block_config(), (0.50, 0.62)), (int4_pack_config(), (0.27, 0.40))])
def test_27b_quantized_estimate_against_bf16(quant, ratio):
    """Qwen3.5-27B: the embeddings and output head stay bf16, the linears shrink to about 1/2 and 1/4."""
    config, _ = preset_config("qwen3.5-27b")
    dense = geometry_from_config(config).total_weight_bytes()
    quantized = geometry_from_config({**config, "quantization_config": quant})
    assert ratio[0] < quantized.total_weight_bytes() / dense < ratio[1]
    assert quantized.weight_format in ("fp8 e4m3, 128x128 blocks", "int4 W4A16, group 128, symmetric")


def test_unsupported_quantization_config_is_a_geometry_error():
    config, _ = preset_config("qwen3.5-4b")
    with pytest.raises(GeometryError, match="quant_method 'awq' is not supported"):
        geometry_from_config({**config, "quantization_config": {"quant_method": "awq"}})


def test_prefill_passes_price_one_dequantized_weight():
    """Passes of WEIGHT_DEQUANT_MIN_ROWS rows or more dequantize the widest quantized linear (Qwen3.5-4B: the
    MLP's 9,216 x 2,560 up/gate projection, bf16) outside the static budget, a TP rank its shard; the kernel's
    threshold is the planner's."""
    from headroom.engine.plan.quant_format import WEIGHT_DEQUANT_MIN_ROWS
    from headroom.kernels.quant_matmul import DENSE_MIN_ROWS

    assert DENSE_MIN_ROWS == WEIGHT_DEQUANT_MIN_ROWS
    config, _ = preset_config("qwen3.5-4b")
    geometry = geometry_from_config({**config, "quantization_config": int4_pack_config()})
    widest = config["intermediate_size"] * config["hidden_size"]

    def line(chunk: int, tp: int = 1) -> int:
        plan = make_plan(PlanRequest(geometry=geometry, gpu_memory_bytes=24 * 1024**3, tp=tp,
                                     targets=Targets(context_length=16384, max_running_requests=4),
                                     pinned=Pinned(chunked_prefill_size=chunk)))
        return plan.ledger["weight_dequant_transient"]

    assert line(8192) == 2 * widest
    assert line(8192, tp=2) == widest
    assert line(100) == 0
    dense = make_plan(PlanRequest(geometry=geometry_from_config(config), gpu_memory_bytes=24 * 1024**3,
                                  targets=Targets(context_length=16384, max_running_requests=4)))
    assert dense.ledger["weight_dequant_transient"] == 0
