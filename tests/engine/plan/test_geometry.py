"""Geometry from config.json for every supported architecture, and clear errors for the rest."""

from __future__ import annotations

import json
import struct

import pytest
from headroom.engine.plan import GeometryError, geometry_from_config, load_geometry
from headroom.engine.plan.presets import PRESETS, preset_config


def test_qwen3_is_all_full_attention():
    g = geometry_from_config({
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 96,
    })
    assert (g.num_full_attention_layers, g.num_linear_attention_layers, g.head_dim) == (3, 0, 16)
    assert not g.is_hybrid


def test_qwen3_5_layer_types_and_wrapper():
    text = dict(preset_config("qwen3.5-4b")[0])
    g = geometry_from_config(text)
    assert g.num_full_attention_layers == 8 and g.num_linear_attention_layers == 24
    wrapped = geometry_from_config({"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"}})
    assert wrapped == g


def test_explicit_layer_types_are_honoured():
    cfg = dict(preset_config("qwen3.5-4b")[0], num_hidden_layers=3,
               layer_types=["linear_attention", "full_attention", "full_attention"])
    g = geometry_from_config(cfg)
    assert (g.num_full_attention_layers, g.num_linear_attention_layers) == (2, 1)


def test_qwen3_next_has_experts():
    g = geometry_from_config(preset_config("qwen3-next-80b-a3b")[0])
    assert g.num_experts == 512 and g.is_hybrid
    # An 80B MoE: the shape estimate lands within 10% of 80B parameters.
    assert 72e9 < g.estimated_parameter_count() < 88e9


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_parse(name):
    config, _ = preset_config(name)
    assert geometry_from_config(config).num_layers > 0


def test_unknown_architecture_is_named():
    with pytest.raises(GeometryError, match="unsupported model_type 'llama'.*LlamaForCausalLM"):
        geometry_from_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_missing_field_is_named():
    cfg = dict(preset_config("qwen3.5-4b")[0])
    del cfg["linear_num_value_heads"]
    with pytest.raises(GeometryError, match="linear_num_value_heads"):
        geometry_from_config(cfg)


def test_layer_types_length_mismatch_is_named():
    cfg = dict(preset_config("qwen3.5-4b")[0], layer_types=["full_attention"])
    with pytest.raises(GeometryError, match="layer_types has 1 entries but num_hidden_layers is 32"):
        geometry_from_config(cfg)


def _write_safetensors(path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    header, offset = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_weight_bytes_come_from_safetensors_headers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("qwen3.5-4b")[0]))
    _write_safetensors(tmp_path / "a.safetensors", {"x": ("BF16", [4, 8], 64), "y": ("F32", [2], 8)})
    _write_safetensors(tmp_path / "b.safetensors", {"z": ("I8", [10], 10)})
    assert load_geometry(tmp_path).weight_bytes == 82
    assert load_geometry(tmp_path, weight_bytes=1000).weight_bytes == 1000


def test_without_weights_the_estimate_is_used(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("qwen3.5-4b")[0]))
    g = load_geometry(tmp_path)
    assert g.weight_bytes is None
    # Qwen3.5-4B: about 4-5B parameters in bf16.
    assert 7e9 < g.total_weight_bytes() < 11e9


def test_bad_json_and_missing_file_are_clear(tmp_path):
    with pytest.raises(GeometryError, match="no config.json"):
        load_geometry(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(GeometryError, match="not valid JSON"):
        load_geometry(tmp_path)
