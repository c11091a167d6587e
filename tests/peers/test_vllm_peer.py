"""Every vLLM plan parses with vLLM 0.33.0's `vllm serve` and fits that engine's startup gate and block pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from headroom.engine.plan import PlanRefused, make_plan
from headroom.engine.plan.engines import Layout, engine_model
from headroom.engine.plan.engines.vllm import STARTUP_OVERHEAD_BYTES, TP_COMMUNICATOR_BYTES, VLLMEngine
from hypothesis import HealthCheck, given, settings

from tests.peers.conftest import PEERS_SITE
from tests.peers.grid import Case, random_cases

_TORCH_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def test_the_installed_release_is_the_profiles() -> None:
    import importlib.metadata

    assert importlib.metadata.version("vllm") == VLLMEngine.version


def parse(vllm_serve, argv: list[str]):
    parser, command = vllm_serve
    args = parser.parse_args(["serve", "/models/m", *argv])
    command.validate(args)
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs.from_cli_args(args)


def test_transcriptions_match_their_source_lines() -> None:
    interface = (PEERS_SITE / "vllm" / "platforms" / "interface.py").read_text()
    assert "attn_block_size = kernel_block_alignment_size * cdiv(" in interface
    planning = (PEERS_SITE / "vllm" / "v1" / "core" / "kv_cache_planning.py").read_text()
    assert "if max_num_layers < min_num_layers * 1.5:" in planning
    assert "num_blocks = available_memory // bytes_per_block" in planning
    utils = (PEERS_SITE / "vllm" / "v1" / "worker" / "utils.py").read_text()
    assert "if init_snapshot.free_memory < requested_memory:" in utils


def block_pool(args, geometry, tp: int):
    """(block_size, bytes per block, attention groups, state groups, states per running request) from vLLM's
    own spec classes; the block-size and grouping rules are transcribed (sources checked above)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kv = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    heads = max(1, geometry.num_kv_heads // tp)
    attn_1tok = FullAttentionSpec(block_size=1, num_kv_heads=heads, head_size=geometry.head_dim, dtype=kv)
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, geometry.linear_num_key_heads, geometry.linear_num_value_heads, geometry.linear_key_head_dim,
        geometry.linear_value_head_dim, geometry.linear_conv_kernel_dim)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", args.mamba_ssm_cache_dtype)
    state = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1)
    # _align_hybrid_block_size: kernel alignment 16, FlashInfer's GDN checkpoint grid 64 in align mode.
    alignment = 64
    block_size = alignment * -(-state.page_size_bytes // (alignment * attn_1tok.page_size_bytes))
    page = block_size * attn_1tok.page_size_bytes
    padded = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=block_size, page_size_padded=page,
                       mamba_cache_mode="align", num_prefill_checkpoint_blocks=1)
    config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="align"))
    states_per_running = padded.max_memory_usage_bytes(config) // padded.page_size_bytes
    n_attn, n_state = geometry.num_full_attention_layers, geometry.num_linear_attention_layers
    smallest, largest = min(n_attn, n_state), max(n_attn, n_state)
    group = largest if largest < smallest * 1.5 else smallest
    return block_size, group * page, -(-n_attn // group), -(-n_state // group), states_per_running


def check_vllm_plan(vllm_serve, case: Case) -> str:
    request = case.request()
    try:
        plan = make_plan(request)
    except PlanRefused as refusal:
        if case.kv_dtype not in VLLMEngine.kv_dtypes:
            assert refusal.binding_constraint == "kv_dtype" and "per_token_head" in refusal.message
        assert all(a.kv_dtype in VLLMEngine.kv_dtypes for a in refusal.alternatives)
        return f"refused: {refusal.binding_constraint}"
    args = parse(vllm_serve, plan.engine_args)
    geometry, total = request.geometry, request.gpu_memory_bytes
    # v1/worker/utils.request_memory: free at the snapshot >= ceil(u x total).
    in_use = STARTUP_OVERHEAD_BYTES + (TP_COMMUNICATOR_BYTES if plan.tp > 1 else 0)
    assert -(-int(total * args.gpu_memory_utilization) // 1) <= total - in_use, plan.engine_args
    assert args.gpu_memory_utilization <= 1 - in_use / total
    assert args.max_num_seqs >= plan.max_running_requests
    assert args.max_model_len == plan.context_length and args.enable_prefix_caching
    if not geometry.is_hybrid:
        return "ok"
    assert args.mamba_ssm_cache_dtype == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[plan.ssm_dtype]
    block_size, block_bytes, attn_groups, state_groups, per_running = block_pool(args, geometry, plan.tp)
    model = engine_model("vllm")
    layout = Layout(plan.chunked_prefill_size, plan.context_length, plan.max_running_requests, plan.kv_dtype,
                    plan.tp, plan.ssm_dtype)
    promised = model.checkpoints_needed(geometry, layout, plan.max_total_tokens, plan.retained_sessions,
                                        plan.session_tokens)
    # get_kv_cache_config_from_groups: num_blocks = memory // bytes_per_block; BlockPool keeps a null block.
    blocks = args.kv_cache_memory_bytes // block_bytes - 1
    state_blocks = state_groups * (plan.max_running_requests * per_running + promised)
    tokens = (blocks - state_blocks) // attn_groups * block_size
    assert tokens >= plan.context_length, (tokens, plan.engine_args)
    assert tokens >= plan.retained_sessions * plan.session_tokens
    return "ok"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases("vllm"))
def test_every_vllm_plan_parses_and_fits_its_pool(vllm_serve, case: Case) -> None:
    check_vllm_plan(vllm_serve, case)


def test_utilization_on_12_and_24_gib_passes_the_startup_gate(vllm_serve) -> None:
    for gib in (12, 24):
        assert check_vllm_plan(vllm_serve, Case("qwen3.5-4b", gib, "fp8", 1, 0, 0, "vllm")) == "ok"


def test_vllm_utilization_is_below_the_gate_and_its_int_kv_is_named(vllm_serve) -> None:
    plan = make_plan(Case("qwen3.5-4b", 12, "bf16", 1, 0, 0, "vllm").request())
    assert plan.mem_fraction_static < 0.99
    with pytest.raises(PlanRefused, match="int8_per_token_head"):
        make_plan(Case("qwen3.5-4b", 12, "int8", 1, 0, 0, "vllm").request())
