"""Property tests: every plan satisfies the memory model of DESIGN.md; every refusal is truly infeasible.

The inequalities are written here from the ledger, independently of the solver's code path.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from headroom.engine.plan import (
    ModelGeometry,
    Pinned,
    PlanRefused,
    PlanRequest,
    Targets,
    geometry_from_config,
    make_plan,
)
from headroom.engine.plan.engines import Layout, engine_model
from headroom.engine.plan.engines.builtin import CHECKPOINT_STOPS_PER_REQUEST, CHECKPOINTS_PER_SESSION
from headroom.engine.plan.report import OUTSIDE_STATIC
from headroom.engine.plan.solver import AUTO_CONTEXT_CANDIDATES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GiB = 1024**3
# (engine, flavour): every profile, the int-kv fork only when named.
_PROFILES = [("builtin", None), ("sglang", None), ("sglang", "int-kv"), ("vllm", None)]


@st.composite
def geometries(draw) -> ModelGeometry:
    hybrid = draw(st.booleans())
    layers = draw(st.sampled_from([8, 16, 24, 32, 48, 64]))
    config = {
        "model_type": "qwen3_5_text" if hybrid else "qwen3",
        "hidden_size": draw(st.sampled_from([1024, 2048, 2560, 4096, 5120])),
        "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": draw(st.sampled_from([1, 2, 4, 8])),
        "head_dim": draw(st.sampled_from([64, 128, 256])),
        "intermediate_size": draw(st.sampled_from([3072, 9216, 17408])), "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "linear_num_key_heads": 16, "linear_num_value_heads": draw(st.sampled_from([16, 32, 48])),
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    }
    geometry = geometry_from_config(config)
    weight_gib = draw(st.floats(min_value=0.5, max_value=60))
    return geometry.with_weight_bytes(int(weight_gib * GiB))


@st.composite
def requests(draw) -> PlanRequest:
    engine, flavour = draw(st.sampled_from(_PROFILES))
    kv = draw(st.sampled_from(engine_model(engine, None, flavour).kv_dtypes))
    sessions = draw(st.integers(0, 4))
    return PlanRequest(
        geometry=draw(geometries()),
        gpu_memory_bytes=draw(st.sampled_from([12, 16, 24, 48, 80, 141])) * GiB,
        kv_dtype=kv, engine=engine, engine_flavour=flavour, tp=draw(st.sampled_from([1, 2, 4])),
        targets=Targets(
            context_length=draw(st.one_of(st.none(), st.sampled_from([4096, 32768, 131072]))),
            retained_sessions=sessions,
            session_tokens=draw(st.integers(1000, 80000)) if sessions else 0,
            max_running_requests=draw(st.one_of(st.none(), st.integers(1, 32))),
            max_new_tokens=draw(st.sampled_from([256, 1024, 4096])),
        ),
        pinned=Pinned(
            mem_fraction_static=draw(st.one_of(st.none(), st.floats(0.5, 0.95))),
            chunked_prefill_size=draw(st.one_of(st.none(), st.sampled_from([1024, 2048, 4096, 8192]))),
        ),
    )


def _check_plan(request: PlanRequest, plan) -> None:
    model = engine_model(request.engine, None, request.engine_flavour)
    ledger, total = plan.ledger, request.gpu_memory_bytes
    layout = Layout(plan.chunked_prefill_size, plan.context_length, plan.max_running_requests, plan.kv_dtype,
                    plan.tp, plan.ssm_dtype)
    # The fraction applies to the total, or to what the engine finds free at startup (SGLang).
    base = total - sum(model.outside_base(request.geometry, layout, total).values())
    static = plan.static_bytes
    outside = sum(ledger.get(k, 0) for k in OUTSIDE_STATIC) - (total - base)
    # static = weights + KV pool + SSM pool + tables <= f * base
    assert ledger["kv_pool"] == plan.max_total_tokens * plan.kv_bytes_per_token
    assert ledger["ssm_pool"] == model.ssm_pool_bytes(plan.ssm_slots, plan.ssm_slot_bytes)
    assert ledger["weights"] >= request.geometry.total_weight_bytes() // request.tp
    assert static <= plan.mem_fraction_static * base + 1
    # the non-static remainder holds everything that lives outside the static budget
    assert outside <= (1 - plan.mem_fraction_static) * base
    # targets: one full context and the retained sessions fit the pool; prompts have room
    assert plan.context_length <= plan.max_total_tokens
    assert plan.retained_sessions * plan.session_tokens <= plan.max_total_tokens
    assert plan.context_length > plan.max_new_tokens
    # SSM slots cover one working slot per running request plus the retained sessions' checkpoints: one per
    # chunk for the peers, the checkpoint policy's per session and per prefill for the builtin engine
    if request.geometry.is_hybrid and request.engine == "builtin":
        checkpoints = plan.retained_sessions * CHECKPOINTS_PER_SESSION + CHECKPOINT_STOPS_PER_REQUEST
        assert plan.ssm_slots >= plan.max_running_requests + checkpoints
    elif request.geometry.is_hybrid:
        checkpoints = plan.retained_sessions * -(-plan.session_tokens // plan.chunked_prefill_size)
        assert plan.ssm_slots >= plan.max_running_requests * model.slots_per_running(layout) + checkpoints
    if request.engine == "builtin" and request.targets.retained_sessions:
        # Targets are honoured exactly: the plan promises what was asked, no more.
        assert (plan.retained_sessions, plan.session_tokens) == (
            request.targets.retained_sessions, request.targets.session_tokens)
    if request.pinned.mem_fraction_static is not None:
        assert plan.mem_fraction_static == request.pinned.mem_fraction_static
    if request.pinned.chunked_prefill_size is not None:
        assert plan.chunked_prefill_size == request.pinned.chunked_prefill_size


def _check_refusal(request: PlanRequest, refusal: PlanRefused) -> None:
    """The named constraint fails even at the most generous setting of every free lever."""
    model = engine_model(request.engine, None, request.engine_flavour)
    g, t, total = request.geometry, request.targets, request.gpu_memory_bytes
    ctx = t.context_length
    name = refusal.binding_constraint
    assert refusal.message
    if name == "context_room":
        assert ctx is not None and ctx <= t.max_new_tokens
        return
    if name in ("kv_dtype", "model_max_position", "engine_limit"):
        return
    # For the remaining constraints, check the smallest context tried and every chunk candidate:
    # even the cheapest layout cannot satisfy the named constraint.
    # auto: the smallest context of the ladder that leaves room for max_new_tokens (smaller ones fail context_room).
    contexts = [ctx] if ctx else [min(c for c in AUTO_CONTEXT_CANDIDATES if c > t.max_new_tokens)]
    chunks = [request.pinned.chunked_prefill_size] if request.pinned.chunked_prefill_size else [1024, 2048, 4096, 8192, 16384]
    running = t.max_running_requests or 8
    for context in contexts:
        for chunk in chunks:
            layout = Layout(chunk, context, running, request.kv_dtype, request.tp, request.ssm_dtype or "fp32")
            base = total - sum(model.outside_base(g, layout, total).values())
            outside = sum(model.non_static(g, layout, total).values())
            # The solver floors a free mem-fraction-static to the flag's three decimals.
            fraction = request.pinned.mem_fraction_static or math.floor((base - outside) / base * 1000) / 1000
            if name in ("non_static_headroom", "dequant_transient"):
                assert outside > (1 - fraction) * base
                continue
            avail = fraction * base - g.total_weight_bytes() / request.tp - sum(model.static_extras(g, layout).values())
            kvb = model.kv_bytes_per_token(g, layout)
            sb = model.ssm_slot_bytes(g, layout)
            required = max(context, t.retained_sessions * t.session_tokens)
            slots = model.ssm_slots_needed(g, layout, required, t.retained_sessions, t.session_tokens)
            if outside > (1 - fraction) * base:
                continue
            assert required * kvb + model.ssm_pool_bytes(slots, sb) > avail, (name, chunk, context)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_every_plan_satisfies_every_constraint_and_every_refusal_is_infeasible(request: PlanRequest):
    try:
        plan = make_plan(request, with_alternatives=False)
    except PlanRefused as refusal:
        _check_refusal(request, refusal)
    else:
        _check_plan(request, plan)


@settings(max_examples=60, deadline=None)
@given(requests())
def test_alternatives_are_feasible(request: PlanRequest):
    try:
        make_plan(request)
    except PlanRefused as refusal:
        for alternative in refusal.alternatives:
            assert alternative.max_total_tokens >= alternative.context_length


def test_pinned_fraction_refusal_names_it():
    from tests.engine.plan.conftest import seed_request

    request = replace(seed_request(mem_fraction_static=0.99), kv_dtype="bf16")
    try:
        make_plan(request)
    except PlanRefused as refusal:
        assert refusal.binding_constraint == "non_static_headroom"
        assert "0.990" in refusal.message
    else:
        raise AssertionError("a 0.99 static fraction cannot leave room for activations on 12 GB")


@pytest.mark.parametrize("engine", ["builtin", "sglang", "vllm"])
def test_the_rendered_fraction_is_the_validated_one(engine):
    """A pinned fraction with more than three decimals reaches the engine as pinned: rounded to 0.862, a pinned
    0.861524 that fits would have become one the solver never checked (and `headroom serve`'s re-plan refuses)."""
    from headroom.engine.plan import Pinned, Targets, geometry_from_config
    from headroom.engine.plan.presets import preset_config

    request = PlanRequest(geometry=geometry_from_config(preset_config("qwen3.5-4b")[0]), gpu_memory_bytes=24 * 1024**3,
                          kv_dtype="fp8", engine=engine,
                          targets=Targets(context_length=32768, max_running_requests=4, max_new_tokens=256))
    free = make_plan(request, with_alternatives=False)
    for fraction in (free.mem_fraction_static, free.mem_fraction_static - 0.000476):
        plan = make_plan(replace(request, pinned=Pinned(mem_fraction_static=fraction)), with_alternatives=False)
        flag = plan.engine_args[plan.engine_args.index(
            "--gpu-memory-utilization" if engine == "vllm" else "--mem-fraction-static") + 1]
        assert float(flag) == plan.mem_fraction_static == fraction
