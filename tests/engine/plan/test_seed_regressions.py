"""The failures of field report 004 as regression tests: each must be refused, with the right constraint."""

from __future__ import annotations

import pytest
from headroom.engine.plan import PlanRefused, make_plan

from tests.engine.plan.conftest import seed_request


def test_three_66k_chains_do_not_fit_the_original_pool_and_the_joint_fix_is_found():
    with pytest.raises(PlanRefused) as refused:
        make_plan(seed_request(mem_fraction_static=0.78, max_total_tokens=150000, chunked_prefill_size=4096))
    assert refused.value.binding_constraint == "kv_pool"
    assert "198000" in refused.value.message and "150000" in refused.value.message
    joint = [a for a in refused.value.alternatives if a.change.startswith("derive mem_fraction_static")]
    assert joint, refused.value.alternatives
    fix = joint[0]
    assert fix.max_total_tokens >= 3 * 66000
    assert fix.mem_fraction_static > 0.78
    assert fix.chunked_prefill_size > 4096


def test_max_total_tokens_is_only_a_cap_for_sglang():
    plan = make_plan(seed_request(max_total_tokens=10_000_000, chunked_prefill_size=8192))
    assert plan.max_total_tokens < 10_000_000
    assert "only a cap" in plan.checks["max_total_tokens"]


def test_enlarged_pool_at_chunk_4096_is_refused_for_ssm_slots():
    with pytest.raises(PlanRefused) as refused:
        make_plan(seed_request(mem_fraction_static=0.85, max_total_tokens=210000, chunked_prefill_size=4096))
    assert refused.value.binding_constraint == "ssm_slots"
    assert "4096" in refused.value.message
    assert any(a.chunked_prefill_size >= 8192 for a in refused.value.alternatives)


def test_enlarged_pool_at_chunk_8192_is_accepted():
    plan = make_plan(seed_request(mem_fraction_static=0.85, max_total_tokens=210000, chunked_prefill_size=8192))
    assert plan.max_total_tokens == 210000
    assert plan.mem_fraction_static == 0.85
    assert plan.ssm_slots >= -(-210000 // 8192) + 4
    assert plan.max_total_tokens >= 3 * 66000


def test_static_fraction_that_squeezes_the_int2_dequant_transient_at_128k_is_refused():
    with pytest.raises(PlanRefused) as refused:
        make_plan(seed_request(context_length=131072, mem_fraction_static=0.90, chunked_prefill_size=8192))
    assert refused.value.binding_constraint == "dequant_transient"
    assert "131072" in refused.value.message
    derived = make_plan(seed_request(context_length=131072, chunked_prefill_size=8192))
    assert derived.ledger["dequant_transient"] >= 131072 * 2 * 2 * 256 * 2
    assert derived.mem_fraction_static < 0.90


def test_the_transient_grows_with_context_for_sglang_but_not_for_builtin():
    short = make_plan(seed_request(context_length=32768))
    long = make_plan(seed_request(context_length=131072))
    assert long.ledger["dequant_transient"] == 4 * short.ledger["dequant_transient"]
    from dataclasses import replace

    on_builtin = dict(engine="builtin", engine_flavour=None, ssm_dtype="fp32", gpu_memory_bytes=48 * 1024**3)
    builtin_short = make_plan(replace(seed_request(context_length=32768), **on_builtin))
    builtin_long = make_plan(replace(seed_request(context_length=131072), **on_builtin))
    assert builtin_short.ledger["dequant_transient"] == builtin_long.ledger["dequant_transient"]


def test_context_with_no_room_for_max_new_tokens_is_refused_with_a_reduction_offered():
    with pytest.raises(PlanRefused) as refused:
        make_plan(seed_request(context_length=4096, max_new_tokens=4096, retained_sessions=0, session_tokens=0))
    assert refused.value.binding_constraint == "context_room"
    assert refused.value.alternatives
    assert all(a.context_length > 0 for a in refused.value.alternatives)


def test_auto_context_leaves_room_for_max_new_tokens():
    plan = make_plan(seed_request(context_length=None, max_new_tokens=2048))
    assert plan.context_length > plan.max_new_tokens
    assert plan.context_length <= plan.max_total_tokens
