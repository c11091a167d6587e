"""EngineConfig from a plan; the engine refuses to start with numbers when the plan's pools do not fit."""

from __future__ import annotations

import json

import pytest
from headroom.engine.config import EngineConfig
from headroom.engine.models.config import ModelConfigError
from headroom.engine.plan.types import Plan
from headroom.engine.runtime.loader import WeightError
from headroom.engine.runtime.model_runner import CapacityError, ModelRunner


def make_plan(**changes) -> Plan:
    fields = dict(
        engine="builtin", kv_dtype="int4", tp=1, mem_fraction_static=0.8, max_total_tokens=4096,
        chunked_prefill_size=512, context_length=2048, max_running_requests=4, max_new_tokens=256,
        ssm_slots=12, ssm_dtype="fp32", kv_bytes_per_token=100, ssm_slot_bytes=1000,
        gpu_memory_bytes=10_000_000, static_bytes=1, ledger={}, binding_constraint="memory", checks={},
        engine_args=[],
    )
    fields.update(changes)
    return Plan(**fields)


def test_from_plan_takes_every_size():
    config = EngineConfig.from_plan(make_plan(), "/models/x", device="cpu")
    assert (config.kv_dtype, config.max_total_tokens, config.ssm_slots, config.chunked_prefill_size) == ("int4", 4096, 12, 512)
    assert (config.context_length, config.max_running_requests, config.device) == (2048, 4, "cpu")
    assert config.static_budget_bytes == 8_000_000


def test_from_plan_rejects_other_engines():
    with pytest.raises(ValueError, match="engine 'sglang'"):
        EngineConfig.from_plan(make_plan(engine="sglang"), "/m")


def test_refuses_fewer_ssm_slots_than_running_requests(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    with pytest.raises(CapacityError, match="ssm_slots=3 < max_running_requests=4"):
        ModelRunner(EngineConfig(model_path=str(model_dir), ssm_slots=3, max_running_requests=4))


def test_refuses_pools_over_the_static_budget(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    with pytest.raises(CapacityError, match=r"exceed the plan's static budget of 1000 bytes"):
        ModelRunner(EngineConfig(model_path=str(model_dir), static_budget_bytes=1000))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelConfigError, match="LlamaForCausalLM"):
        ModelRunner(EngineConfig(model_path=str(tmp_path)))


def test_missing_tensor_is_named(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.layers.1.linear_attn.A_log"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(WeightError, match="model.layers.1.linear_attn.A_log"):
        ModelRunner(EngineConfig(model_path=str(tmp_path)))
