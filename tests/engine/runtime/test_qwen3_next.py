"""Qwen3-Next (fused GDN projections, sparse MoE + shared expert) against transformers: fp32, CPU, tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from headroom.engine.config import EngineConfig
from headroom.engine.layers.moe import SparseMoE
from headroom.engine.models.config import ModelConfigError, model_config_from_hf
from headroom.engine.plan.geometry import load_geometry
from headroom.engine.plan.kv_format import kv_bytes_per_token, ssm_slot_bytes
from headroom.engine.runtime.loader import WeightError
from headroom.engine.runtime.model_runner import ModelRunner

from tests.engine.helpers import (
    assert_hit_then_rest_equals_cold_run,
    chunked_logits,
    new_sequence,
    perturb_hybrid,
    random_prompt,
    reference_logits,
)

CONFIGS = [
    # Odd sizes; expert count, top-k, norm_topk_prob, shared expert size, sparse layers and key/value head
    # grouping all differ between configs.
    dict(vocab_size=101, hidden_size=48, intermediate_size=72, num_hidden_layers=4, num_attention_heads=3,
         num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
         linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
         num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=24,
         mlp_only_layers=[1]),
    dict(vocab_size=77, hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=5,
         num_key_value_heads=5, head_dim=12, linear_num_key_heads=1, linear_num_value_heads=3,
         linear_key_head_dim=6, linear_value_head_dim=10, linear_conv_kernel_dim=3,
         layer_types=["linear_attention", "full_attention", "linear_attention"],
         num_experts=7, num_experts_per_tok=3, moe_intermediate_size=18, shared_expert_intermediate_size=10,
         norm_topk_prob=False, decoder_sparse_step=2),
    dict(vocab_size=131, hidden_size=64, intermediate_size=40, num_hidden_layers=5, num_attention_heads=4,
         num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
         layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
         tie_word_embeddings=True, partial_rotary_factor=0.5, attention_bias=True,
         num_experts=3, num_experts_per_tok=1, moe_intermediate_size=12, shared_expert_intermediate_size=0,
         mlp_only_layers=[0, 4]),
]
# Config 2's zero-size shared expert makes transformers warn while it initialises the empty tensors.
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
# Which layers each config makes sparse, worked out by hand from decoder_sparse_step and mlp_only_layers.
MOE_LAYERS = [(0, 2, 3), (1,), (1, 2, 3)]


def _build(index: int, out_dir):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(index)
    params = dict(CONFIGS[index])
    partial = params.pop("partial_rotary_factor", 0.25)
    config = Qwen3NextConfig(**params, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": partial})
    model = Qwen3NextForCausalLM(config)
    # The per-expert loop is the reference semantics; the default grouped_mm path refuses odd sizes on CPU.
    model.set_experts_implementation("eager")
    # transformers starts norms at 0 and the router at 0 (uniform routing); randomise every parameter so
    # that (1 + w) versus w, a swapped tensor or a wrong expert cannot go unnoticed.
    perturb_hybrid(model, 100 + index)
    model = model.float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """index -> (model_dir, transformers model), each built once per module."""
    built: dict[int, tuple] = {}

    def get(index: int):
        if index not in built:
            out = tmp_path_factory.mktemp(f"qwen3_next_{index}")
            built[index] = (out, _build(index, out))
        return built[index]

    return get


def _runner(model_dir, **settings) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), **{"max_total_tokens": 128, "ssm_slots": 8, **settings}))


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_full_forward_matches_transformers(qwen3_next, index):
    model_dir, reference = qwen3_next(index)
    runner = _runner(model_dir)
    assert runner.model_config.moe_layers == MOE_LAYERS[index]
    ids = random_prompt(reference.config.vocab_size, 41, seed=index)
    got = chunked_logits(runner, new_sequence(runner, "a", ids), chunk=len(ids))
    torch.testing.assert_close(got, reference_logits(reference, ids), atol=1e-4, rtol=0)


def test_routing_spreads_over_experts(qwen3_next):
    """Guards the test set-up: a router that sent every token to one expert would not test the dispatch."""
    model_dir, reference = qwen3_next(0)
    runner = _runner(model_dir)
    hidden = torch.randn(41, reference.config.hidden_size, generator=torch.Generator().manual_seed(3))
    moe = runner.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    expert_ids, weights = moe.route(hidden)
    assert expert_ids.shape == (41, 2) and len(torch.unique(expert_ids)) == 5
    torch.testing.assert_close(weights.sum(-1), torch.ones(41))


@pytest.mark.parametrize(("index", "chunk"), [(0, 1), (0, 5), (1, 13), (2, 7)])
def test_chunked_prefill_equals_unchunked(qwen3_next, index, chunk):
    model_dir, reference = qwen3_next(index)
    runner = _runner(model_dir)
    ids = random_prompt(reference.config.vocab_size, 30, seed=7)
    whole = chunked_logits(runner, new_sequence(runner, "whole", ids), chunk=len(ids))
    pieces = chunked_logits(runner, new_sequence(runner, "pieces", ids), chunk=chunk)
    torch.testing.assert_close(pieces, whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("index", [0, 2])
def test_greedy_generation_matches_transformers_generate(qwen3_next, index):
    from headroom.engine.llm import LLM

    model_dir, reference = qwen3_next(index)
    ids = random_prompt(reference.config.vocab_size, 19, seed=11 + index)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    want = out[0, len(ids):].tolist()
    llm = LLM(str(model_dir), max_total_tokens=256, ssm_slots=32, chunked_prefill_size=6)
    assert llm.generate([ids], max_new_tokens=12)[0].token_ids == want


def test_mixed_batch_and_prefix_hit_equal_cold_runs(qwen3_next):
    """A prefill chunk and a decode in one pass (the router sees both) each match transformers; a prefix-cache
    hit restored from an SSM checkpoint, followed by the rest of the prompt, matches a cold run."""
    from headroom.engine.runtime.forward_batch import BatchItem

    model_dir, reference = qwen3_next(1)
    vocab = reference.config.vocab_size
    runner = _runner(model_dir)
    long_ids, short_ids = random_prompt(vocab, 23, seed=1), random_prompt(vocab, 9, seed=2)
    long_seq, short_seq = new_sequence(runner, "long", long_ids), new_sequence(runner, "short", short_ids)
    runner.forward([BatchItem(short_seq, short_ids[:8])])
    runner.forward([BatchItem(long_seq, long_ids[:11])])
    mixed = runner.forward([BatchItem(long_seq, long_ids[11:]), BatchItem(short_seq, short_ids[8:])])
    want = torch.stack([reference_logits(reference, long_ids)[-1], reference_logits(reference, short_ids)[-1]])
    torch.testing.assert_close(mixed, want, atol=1e-4, rtol=0)

    assert_hit_then_rest_equals_cold_run(model_dir, vocab)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int8", "int4", "int2"])
def test_pool_bytes_equal_the_planner_ledger(qwen3_next, kv_dtype):
    model_dir, _ = qwen3_next(2)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), kv_dtype=kv_dtype, max_total_tokens=96, ssm_slots=5,
                                      max_running_requests=5))
    geometry = load_geometry(model_dir)
    assert geometry.model_type == "qwen3_next" and geometry.num_experts == 3
    assert runner.kv_pool.nbytes() == kv_bytes_per_token(geometry, kv_dtype) * 96
    assert runner.ssm_pool is not None
    assert runner.ssm_pool.nbytes() == ssm_slot_bytes(geometry) * 5


def _copy_without(model_dir, out_dir, name: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / "model.safetensors"))
    del weights[name]
    save_file(weights, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text((model_dir / "config.json").read_text())


@pytest.mark.parametrize("name", [
    "model.layers.2.mlp.experts.4.up_proj.weight",
    "model.layers.0.mlp.shared_expert_gate.weight",
    "model.layers.1.linear_attn.in_proj_qkvz.weight",
])
def test_missing_tensor_is_named(qwen3_next, tmp_path, name):
    model_dir, _ = qwen3_next(0)
    _copy_without(model_dir, tmp_path, name)
    with pytest.raises(WeightError, match=r"Qwen3NextForCausalLM checkpoint .* 1 missing tensors: " + name.replace(".", r"\.")):
        ModelRunner(EngineConfig(model_path=str(tmp_path), max_total_tokens=32, ssm_slots=8))


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 6}, "num_experts_per_tok=6 exceeds num_experts=5"),
    ({"mlp_only_layers": [1, 4]}, r"mlp_only_layers has \[4\], outside 0..3"),
    ({"moe_intermediate_size": None}, "'moe_intermediate_size' must be a positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"linear_num_key_heads": 3}, "linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "bits": 8}},
     r"keys the engine does not support: bits"),
])
def test_malformed_config_is_named(qwen3_next, change, message):
    model_dir, _ = qwen3_next(0)
    cfg = {**json.loads((model_dir / "config.json").read_text()), **change}
    with pytest.raises(ModelConfigError, match=message):
        model_config_from_hf(cfg)


def test_dense_when_no_experts(qwen3_next):
    """num_experts=0 is a dense Qwen3-Next: every layer is a SwiGLU of intermediate_size."""
    model_dir, _ = qwen3_next(0)
    cfg = {**json.loads((model_dir / "config.json").read_text()), "num_experts": 0}
    config = model_config_from_hf(cfg)
    assert config.moe_layers == () and config.family == "qwen3_next" and config.is_hybrid


def test_decode_graphs_are_refused_for_moe(qwen3_next):
    with pytest.raises(ValueError, match="cannot record a sparse MoE model"):
        _runner(qwen3_next(0)[0], cuda_graph_max_batch=2)
