"""Loading quantized checkpoints: which linears are quantized follows the checkpoint, and a missing scale,
a mis-typed tensor or a quantization_config the engine cannot honour is an error that names it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from headroom.engine.config import EngineConfig
from headroom.engine.layers.linear import linear_weight
from headroom.engine.models.config import ModelConfigError
from headroom.engine.runtime.loader import WeightError
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.kernels.quant_weight import QuantizedWeight
from safetensors.torch import load_file, save_file

from tests.engine.quant_checkpoints import build_dense, write_fp8, write_int4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    dense = build_dense("qwen3_5", root / "dense")
    return {"fp8": write_fp8(dense, root / "fp8", (16, 32)), "int4": write_int4(dense, root / "int4", symmetric=False)}


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=64, ssm_slots=4, max_running_requests=2))


def _edited_copy(src, dst, edit_tensors=None, edit_quant=None):
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        for path in dst.glob("*.safetensors"):
            save_file(edit_tensors(load_file(str(path))), str(path))
    if edit_quant is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_quant(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_linears_follow_the_ignore_list(checkpoints, fmt):
    runner = _runner(checkpoints[fmt])
    config, layer = runner.model_config, runner.model.layers[0]
    # gate|up merged into one quantized weight (layers/linear.py's MergedLinear).
    (mlp_up,) = layer.mlp.gate_up.weights
    assert isinstance(mlp_up, QuantizedWeight) and mlp_up.shape == (2 * config.intermediate_size, config.hidden_size)
    # The GDN gate/decay projections and the output head stay dense, as the checkpoint's ignore list says.
    qkvz, ba = layer.mixer.project.parts  # quantized qkv|z cannot stack with dense b|a: two GEMMs
    assert all(isinstance(w, QuantizedWeight) for w in qkvz.weights)
    assert all(isinstance(w, torch.Tensor) for w in ba.weights)
    assert isinstance(runner.model.lm_head, torch.Tensor)
    # The plan's weight bytes are the checkpoint's: codes and scales, not dense bf16.
    dense_linear = mlp_up.out_features * mlp_up.in_features * 4
    # fp32 model: fp8 is 1 byte + a 4-byte scale per 512; int4 half a byte + 4.5 bytes of scale/zero per 16.
    assert mlp_up.nbytes < dense_linear / (3.5 if fmt == "fp8" else 5)


@pytest.mark.parametrize(("fmt", "missing"), [
    ("fp8", "model.layers.0.mlp.up_proj.weight_scale_inv"),
    ("int4", "model.layers.2.linear_attn.out_proj.weight_scale"),
    ("int4", "model.layers.3.self_attn.q_proj.weight_zero_point"),
])
def test_missing_scale_tensor_is_named(checkpoints, tmp_path, fmt, missing):
    broken = _edited_copy(checkpoints[fmt], tmp_path / "broken",
                          edit_tensors=lambda t: {k: v for k, v in t.items() if k != missing})
    with pytest.raises(WeightError, match="1 missing tensors: " + missing.replace(".", r"\.")):
        _runner(broken)


def test_fp8_weight_of_an_ignored_module_is_named(checkpoints, tmp_path):
    """The checkpoint stores in_proj_a in fp8 while its ignore list says it is dense."""
    name = "model.layers.0.linear_attn.in_proj_a.weight"
    broken = _edited_copy(checkpoints["fp8"], tmp_path / "broken",
                          edit_tensors=lambda t: {**t, name: t[name].to(torch.float8_e4m3fn)})
    with pytest.raises(WeightError, match=name.replace(".", r"\.") + " is float8_e4m3fn but quantization_config leaves it"):
        _runner(broken)


def test_wrong_weight_shape_is_named(checkpoints, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_shape"
    broken = _edited_copy(checkpoints["int4"], tmp_path / "broken",
                          edit_tensors=lambda t: {**t, name: torch.tensor([48, 64])})
    with pytest.raises(WeightError, match=name.replace(".", r"\.") + r" holds \[48, 64\], not \[48, 80\]"):
        _runner(broken)


@pytest.mark.parametrize(("fmt", "edit", "message"), [
    ("fp8", lambda q: q.update(weight_block_size=[128]), "weight_block_size must be two positive multiples of 16"),
    ("fp8", lambda q: q.update(activation_scheme="static"), "activation_scheme is 'static'"),
    ("fp8", lambda q: q.update(fmt="e5m2"), "fmt is 'e5m2'"),
    ("fp8", lambda q: q.update(quant_method="awq"), "quant_method 'awq' is not supported"),
    ("int4", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), r"weights\.num_bits is 8"),
    ("int4", lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder is 'group'"),
    ("int4", lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "input_activations is set"),
    ("int4", lambda q: q.update(format="marlin-24"), "format is 'marlin-24'"),
    ("int4", lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme is set"),
    ("int4", lambda q: q.update(bits=4), "keys the engine does not support: bits"),
])
def test_unsupported_quantization_config_names_the_key(checkpoints, tmp_path, fmt, edit, message):
    broken = _edited_copy(checkpoints[fmt], tmp_path / "broken", edit_quant=edit)
    with pytest.raises(ModelConfigError, match=message):
        _runner(broken)


def test_dense_checkpoint_needs_no_quant_tensors(checkpoints):
    """Without quantization_config, linear_weight hands back the dense tensor itself."""
    runner = _runner(checkpoints["fp8"].parent / "dense")
    weights = {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 3)}
    assert linear_weight(runner.model_config, weights, "model.layers.0.mlp.up_proj") is weights[
        "model.layers.0.mlp.up_proj.weight"]
