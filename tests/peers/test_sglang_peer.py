"""Every SGLang plan parses with SGLang 0.5.23's own ServerArgs and is what that engine will do."""

from __future__ import annotations

import argparse

import pytest
from headroom.engine.plan import PlanRefused, make_plan
from headroom.engine.plan.engines import Layout, engine_model
from headroom.engine.plan.engines.sglang import CUDA_CONTEXT_BYTES, TP_COMMUNICATOR_BYTES, SGLangEngine
from hypothesis import HealthCheck, given, settings

from tests.peers.conftest import PEERS_SITE
from tests.peers.grid import Case, random_cases
from tests.peers.sglang_rules import BASE_RATIO, outcome

SRT = PEERS_SITE / "sglang" / "srt"


def test_the_installed_release_is_the_profiles() -> None:
    import importlib.metadata

    assert importlib.metadata.version("sglang") == SGLangEngine.version


def parse(parser, argv: list[str]):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "/models/m", *argv]))


def _source(relative: str) -> str:
    return (SRT / relative).read_text()


def test_transcriptions_match_their_source_lines() -> None:
    configurator = _source("mem_cache/kv_cache_configurator.py")
    assert f"MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = {BASE_RATIO}" in configurator
    assert "mamba_cap = get_schedule().max_mamba_cache_size // ratio" in configurator
    assert "(get_schedule().max_mamba_cache_size + 1) * (stage_per_req + extra_per_slot)" in configurator
    assert "slack_gb = pre_model_load_memory * (1 - get_schedule().mem_fraction_static)" in configurator
    assert "max_num_reqs = min(requested_per_worker, token_capacity // 2)" in configurator
    pool = _source("mem_cache/memory_pool.py")
    assert "mid = self.mamba_allocator.alloc(1)" in pool and "self._alloc_ping_pong_buffer(req)" in pool
    assert "reserved_mem = 512" in _source("arg_groups/memory_hook.py")


def check_sglang_plan(parser, case: Case) -> str:
    """'refused: <constraint>' or 'ok', after asserting the plan against SGLang's parser and sizing."""
    request = case.request()
    try:
        plan = make_plan(request)
    except PlanRefused as refusal:
        if case.kv_dtype not in SGLangEngine.kv_dtypes:
            assert refusal.binding_constraint == "kv_dtype" and "int-kv" in refusal.message
        # Alternatives never suggest a dtype stock SGLang rejects.
        assert all(a.kv_dtype in SGLangEngine.kv_dtypes for a in refusal.alternatives)
        return f"refused: {refusal.binding_constraint}"
    args = parse(parser, plan.engine_args)
    model = engine_model("sglang")
    geometry = request.geometry
    in_use = CUDA_CONTEXT_BYTES + (TP_COMMUNICATOR_BYTES if plan.tp > 1 else 0)
    seen = outcome(args, geometry, request.gpu_memory_bytes, in_use)
    layout = Layout(plan.chunked_prefill_size, plan.context_length, plan.max_running_requests, plan.kv_dtype,
                    plan.tp, plan.ssm_dtype)
    promised = model.checkpoints_needed(geometry, layout, plan.max_total_tokens, plan.retained_sessions,
                                        plan.session_tokens)
    assert seen.pool_tokens >= plan.context_length, (seen, plan.engine_args)
    assert seen.pool_tokens >= plan.retained_sessions * plan.session_tokens
    assert seen.running_cap >= plan.max_running_requests, (seen, plan.engine_args)
    assert seen.checkpoint_room >= promised, (seen, promised, plan.engine_args)
    # The strategy and the SSM width are the ones priced, not left to SGLang's defaults.
    if geometry.is_hybrid:
        assert args.mamba_radix_cache_strategy == "extra_buffer" and not args.disable_overlap_schedule
        assert args.mamba_ssm_dtype == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[plan.ssm_dtype]
    return "ok"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases("sglang"))
def test_every_sglang_plan_parses_and_sizes_as_promised(sglang_parser, case: Case) -> None:
    check_sglang_plan(sglang_parser, case)


def test_the_issue_case_runs_every_planned_request(sglang_parser) -> None:
    # qwen3.5-4b on 12 GiB, fp8, 8 running: before the profile SGLang ran 5 of 8 (K // 5 with K = 25).
    case = Case("qwen3.5-4b", 12, "fp8", 1, 0, 0, "sglang", running=8)
    assert check_sglang_plan(sglang_parser, case) == "ok"


def test_int_kv_is_refused_for_stock_sglang_and_planned_for_the_fork() -> None:
    case = Case("seed-27b-int2", 12, "int2", 2, 0, 0, "sglang")
    with pytest.raises(PlanRefused, match="int-kv"):
        make_plan(case.request())
    fork = make_plan(Case("seed-27b-int2", 12, "int2", 2, 0, 0, "sglang", flavour="int-kv").request())
    assert fork.engine_profile == "sglang 0.5.19 int-kv"
    assert "int2" in fork.engine_args


def test_a_dtype_stock_sglang_rejects_fails_its_parser(sglang_parser) -> None:
    # The parser is strict: had a plan rendered int2, SGLang would not have started.
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parse(sglang_parser, ["--kv-cache-dtype", "int2"])
