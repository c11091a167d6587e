"""GPTQ checkpoints read into the pack-quantized layout: the engine's weights dequantize to exactly what GPTQ's
published formula gives (zero points stored minus one, or as they are), and every malformed tensor set or
unsupported quantize_config is an error that names it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from headroom.engine.config import EngineConfig
from headroom.engine.layers.linear import linear_weight
from headroom.engine.models.config import ModelConfigError
from headroom.engine.runtime.loader import WeightError, load_weights
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.kernels.quant_weight import QuantizedWeight, naive_dequantize
from safetensors.torch import load_file, save_file

from tests.engine.quant_checkpoints import build_dense, gptq_dequantized, write_gptq

CASES = {"sym-gptq": (True, "gptq"), "asym-gptq": (False, "gptq"), "asym-gptq_v2": (False, "gptq_v2")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    dense = build_dense("qwen3_5", root / "dense")
    return {name: write_gptq(dense, root / name, sym, layout) for name, (sym, layout) in CASES.items()}


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=64, ssm_slots=4, max_running_requests=2))


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("case", list(CASES))
def test_weights_dequantize_to_gptqs_own_formula(checkpoints, case):
    model_dir = checkpoints[case]
    config = _runner(model_dir).model_config  # the whole load, checks included
    # The same reader the runner used, for the tensors it hands the layers.
    weights = load_weights(model_dir, torch.float32, torch.device("cpu"), config.weight_quant)
    assert config.weight_quant.layout == CASES[case][1] and config.weight_quant.symmetric == CASES[case][0]
    stored = _tensors(model_dir)
    modules = sorted(name.removesuffix(".qweight") for name in stored if name.endswith(".qweight"))
    assert "model.layers.0.linear_attn.in_proj_qkv" in modules and "model.layers.3.self_attn.o_proj" in modules
    for module in modules:
        weight = linear_weight(config, weights, module)
        assert isinstance(weight, QuantizedWeight), module
        assert torch.equal(naive_dequantize(weight), gptq_dequantized(stored, module, CASES[case][1])), module
    # What GPTQ leaves dense stays dense.
    assert not isinstance(linear_weight(config, weights, "model.layers.0.linear_attn.in_proj_a"), QuantizedWeight)


def _edited_copy(src, dst, edit_tensors=None, edit_quant=None):
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        save_file(edit_tensors(_tensors(dst)), str(dst / "model.safetensors"))
    if edit_quant is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_quant(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


M = "model.layers.0.mlp.down_proj"


def _permuted_g_idx(t):
    t = dict(t)
    t[M + ".g_idx"] = t[M + ".g_idx"].flip(0).contiguous()
    return t


def _zero_16(t):
    t = dict(t)
    t[M + ".qzeros"] = torch.full_like(t[M + ".qzeros"], -1)  # every stored nibble 15: zero point 16
    return t


@pytest.mark.parametrize(("case", "edit", "message"), [
    ("asym-gptq", lambda t: {k: v for k, v in t.items() if k != M + ".qzeros"}, f"GPTQ linear {M} lacks {M}.qzeros"),
    ("asym-gptq", _permuted_g_idx, f"{M}.g_idx is not the inputs' groups in order"),
    ("asym-gptq", _zero_16, f"{M}.qzeros stores a zero point of 16"),
    ("sym-gptq", lambda t: {**t, M + ".qzeros": torch.zeros_like(t[M + ".qzeros"])},
     f"{M}.qzeros holds zero points other than 8 \\(from 1 to 1\\) although sym is true"),
    ("asym-gptq", lambda t: {**t, M + ".scales": t[M + ".scales"][:-1].contiguous()},
     f"{M}.scales is \\[4, 48\\]; qweight \\[10, 48\\] with group 16 needs \\[5, 48\\]"),
])
def test_malformed_gptq_tensors_are_named(checkpoints, tmp_path, case, edit, message):
    broken = _edited_copy(checkpoints[case], tmp_path / "broken", edit_tensors=edit)
    with pytest.raises(WeightError, match=message):
        _runner(broken)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda q: q.update(bits=8), "bits is 8; only 4-bit GPTQ"),
    (lambda q: q.update(desc_act=True), "desc_act is true; act order"),
    (lambda q: q.update(group_size=-1), "group_size must be a positive multiple of 8, got -1"),
    (lambda q: q.update(checkpoint_format="marlin"), "checkpoint_format is 'marlin'"),
    (lambda q: q.update(dynamic={"-:.*down_proj": {}}), "dynamic is set"),
    (lambda q: q.update(zero_point_shift=1), "keys the engine does not support: zero_point_shift"),
])
def test_unsupported_gptq_config_names_the_key(checkpoints, tmp_path, edit, message):
    broken = _edited_copy(checkpoints["asym-gptq"], tmp_path / "broken", edit_quant=edit)
    with pytest.raises(ModelConfigError, match=message):
        _runner(broken)


def test_a_linear_split_between_two_shards_loads(checkpoints, tmp_path):
    """Shards split tensors wherever the size limit falls: one linear's qweight in the first file, its scales,
    qzeros and g_idx in the second."""
    src = checkpoints["asym-gptq"]
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded)
    stored = _tensors(src)
    (sharded / "model.safetensors").unlink()
    first = {k: v for k, v in stored.items() if k == M + ".qweight" or (k < M and not k.startswith(M))}
    save_file(first, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({k: v for k, v in stored.items() if k not in first}, str(sharded / "model-00002-of-00002.safetensors"))
    config = _runner(sharded).model_config
    weights = load_weights(sharded, torch.float32, torch.device("cpu"), config.weight_quant)
    assert torch.equal(naive_dequantize(linear_weight(config, weights, M)), gptq_dequantized(stored, M, "gptq"))
