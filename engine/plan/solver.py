"""The joint solver: price one candidate layout, then search chunk and context for the best plan.

A candidate is priced in the order the memory model dictates: what must stay outside the static
budget fixes the largest static fraction; the static budget minus weights and tables is shared by the
KV pool and the SSM slots; the targets then check the pool and the slots. Any failure raises
PlanRefused naming that constraint; make_plan adds the nearest feasible alternatives.
"""

from __future__ import annotations

import math

from headroom.engine.plan.engines import EngineModel, Layout, engine_model
from headroom.engine.plan.types import Plan, PlanRefused, PlanRequest
from headroom.engine.plan.units import format_bytes
from headroom.engine.plan.validate import validate_request

DEFAULT_RUNNING_REQUESTS = 8
# Preference order when the chunk is free: 8192 costs no prefill throughput on hybrid models
# (seeds 000 and 002); smaller ones only when memory forces them.
CHUNK_CANDIDATES = (8192, 4096, 16384, 2048, 1024)
AUTO_CONTEXT_CANDIDATES = (1048576, 524288, 262144, 131072, 65536, 32768, 16384, 8192, 4096, 2048)
_FRACTION_STEP = 1000
# How far pricing a candidate got before it failed, by the constraint it failed on.
_STAGE = {
    "context_room": 0, "model_max_position": 0, "non_static_headroom": 1, "dequant_transient": 1,
    "engine_limit": 1, "weights": 2, "kv_pool": 3, "ssm_slots": 3,
}


def _floor_fraction(value: float) -> float:
    return math.floor(value * _FRACTION_STEP) / _FRACTION_STEP


def _ceil_fraction(value: float) -> float:
    return math.ceil(value * _FRACTION_STEP) / _FRACTION_STEP


def _pool_tokens(model: EngineModel, request: PlanRequest, layout: Layout, avail: int, kvb: int, sb: int) -> int:
    """Largest token count T whose KV pool plus the SSM slots it implies fit in `avail` bytes."""
    g, t = request.geometry, request.targets
    if kvb <= 0:
        return 0
    # Slots never shrink as T grows, so feasibility is monotone in T: bisect for the largest T.
    low, high = 0, max(0, avail // kvb)
    while low < high:
        mid = (low + high + 1) // 2
        slots = model.ssm_slots_needed(g, layout, mid, t.retained_sessions, t.session_tokens)
        if mid * kvb + model.ssm_pool_bytes(slots, sb) <= avail:
            low = mid
        else:
            high = mid - 1
    tokens = low
    page = model.page_tokens(g, layout)
    return max(0, tokens // page * page)


def price(request: PlanRequest, model: EngineModel, layout: Layout) -> Plan:
    """Plan for one fixed (chunk, context, running) layout, or PlanRefused naming what fails."""
    g, t, pin, total = request.geometry, request.targets, request.pinned, request.gpu_memory_bytes
    ctx, chunk = layout.context_length, layout.chunk
    if ctx <= t.max_new_tokens:
        raise PlanRefused(
            f"context-length {ctx} leaves no room for a prompt once max_new_tokens {t.max_new_tokens} is reserved",
            "context_room",
        )
    if ctx > g.max_position_embeddings:
        raise PlanRefused(
            f"context-length {ctx} exceeds the model's max_position_embeddings {g.max_position_embeddings}",
            "model_max_position",
        )
    refusal = model.refuse_layout(g, layout, total)
    if refusal is not None:
        raise PlanRefused(refusal, "engine_limit")
    # The fraction applies to `base`: the total, or (SGLang) the free memory the engine measures at startup.
    outside_base = model.outside_base(g, layout, total)
    base = total - sum(outside_base.values())
    non_static = model.non_static(g, layout, total)
    need_outside = sum(non_static.values())
    fraction_max = _floor_fraction((base - need_outside) / base)
    fraction = pin.mem_fraction_static if pin.mem_fraction_static is not None else fraction_max
    # A pinned fraction is what the engine will use, to any precision: refused only if it truly leaves too little
    # outside (the three-decimal floor is for choosing one; it would refuse e.g. 0.92578 where 0.92585 fits).
    if fraction > (base - need_outside) / base:
        transient = non_static.get("dequant_transient", 0)
        squeezed = transient > 0 and need_outside - transient <= (1 - fraction) * base
        items = ", ".join(f"{k} {format_bytes(v)}" for k, v in non_static.items() if v)
        raise PlanRefused(
            f"mem-fraction-static {fraction:.3f} leaves {format_bytes((1 - fraction) * base)} outside the static "
            f"budget but {model.name} needs {format_bytes(need_outside)} there ({items}); "
            + (
                f"the {layout.kv_dtype} prefill dequantizes a {ctx}-token prefix to fp16 outside the static budget; "
                if squeezed else ""
            )
            + f"the largest fraction that fits is {fraction_max:.3f}",
            "dequant_transient" if squeezed else "non_static_headroom",
        )
    weights = -(-g.total_weight_bytes() // request.tp)
    extras = model.static_extras(g, layout)
    static_budget = int(fraction * base)
    avail = static_budget - weights - sum(extras.values())
    kvb = model.kv_bytes_per_token(g, layout)
    sb = model.ssm_slot_bytes(g, layout)
    if avail <= kvb * ctx:
        raise PlanRefused(
            f"weights {format_bytes(weights)} + tables {format_bytes(sum(extras.values()))} leave "
            f"{format_bytes(max(avail, 0))} of the static budget {format_bytes(static_budget)} "
            f"(mem-fraction-static {fraction:.3f} of {format_bytes(base)}), "
            f"less than one {ctx}-token context needs ({format_bytes(kvb * ctx)})",
            "weights" if avail <= 0 else "kv_pool",
        )
    pool_by_memory = _pool_tokens(model, request, layout, avail, kvb, sb)
    tokens = pool_by_memory
    if pin.max_total_tokens is not None:
        if model.token_cap_only:
            tokens = min(pool_by_memory, pin.max_total_tokens)
        else:
            page = model.page_tokens(g, layout)
            tokens = pin.max_total_tokens // page * page
            slots_then = model.ssm_slots_needed(g, layout, tokens, t.retained_sessions, t.session_tokens)
            if tokens * kvb + model.ssm_pool_bytes(slots_then, sb) > avail:
                raise PlanRefused(
                    f"max-total-tokens {pin.max_total_tokens} needs {format_bytes(tokens * kvb)} of KV pool plus "
                    f"{slots_then} SSM slots ({format_bytes(model.ssm_pool_bytes(slots_then, sb))}), "
                    f"but mem-fraction-static {fraction:.3f} "
                    f"leaves {format_bytes(avail)} after weights; it holds {pool_by_memory} tokens",
                    "kv_pool",
                )
    slots = model.ssm_slots_needed(g, layout, tokens, t.retained_sessions, t.session_tokens)
    sessions, session_tokens = model.retained(g, layout, tokens, t.retained_sessions, t.session_tokens)
    retained = t.retained_sessions * t.session_tokens
    required = max(ctx, retained)
    if tokens < required:
        raise _pool_refusal(request, model, layout, tokens, required, avail, kvb, sb, fraction, pool_by_memory)
    static_ledger = {"weights": weights, "kv_pool": tokens * kvb, "ssm_pool": model.ssm_pool_bytes(slots, sb), **extras}
    static_bytes = sum(static_ledger.values())
    ledger = {
        **static_ledger,
        **{k: v for k, v in non_static.items()},
        **outside_base,
        "static_total": static_bytes,
        "non_static_total": need_outside + sum(outside_base.values()),
        "unused": total - static_bytes - need_outside - sum(outside_base.values()),
    }
    slack = {
        "kv_pool": (tokens - required) / max(tokens, 1),
        "non_static_headroom": ((1 - fraction) * base - need_outside) / total,
        "static_budget": (static_budget - static_bytes) / total,
    }
    checks = {
        "kv_pool": f"ok: context {ctx} and retained {t.retained_sessions} x {t.session_tokens} = {retained} "
        f"<= pool {tokens} tokens",
        "ssm_slots": f"ok: {slots} slots cover {slots - layout.running * model.slots_per_running(layout)} checkpoints "
        f"+ {layout.running} running x {model.slots_per_running(layout)}",
        "prefix_reuse": f"ok: retains {sessions} sessions x {session_tokens} tokens"
        + (" (targets)" if t.retained_sessions else " (default: the pool's tokens reusable)"),
        "non_static_headroom": f"ok: {format_bytes(need_outside)} needed <= "
        f"{format_bytes((1 - fraction) * base)} outside the static budget",
        "context_room": f"ok: prompts up to {ctx - t.max_new_tokens} tokens with {t.max_new_tokens} new tokens",
    }
    if pin.max_total_tokens is not None and model.token_cap_only and pin.max_total_tokens > pool_by_memory:
        checks["max_total_tokens"] = (
            f"note: --max-total-tokens {pin.max_total_tokens} is only a cap; at mem-fraction-static {fraction:.3f} "
            f"the pool holds {pool_by_memory} tokens"
        )
    values = {
        "mem_fraction_static": fraction, "max_total_tokens": tokens, "chunked_prefill_size": chunk,
        "context_length": ctx, "max_running_requests": layout.running, "kv_dtype": layout.kv_dtype,
        "ssm_slots": slots, "ssm_dtype": layout.ssm_dtype, "tp": request.tp, "max_new_tokens": t.max_new_tokens,
        "kv_cache_memory_bytes": tokens * kvb + model.ssm_pool_bytes(slots, sb),
    }
    return Plan(
        engine=model.name, engine_profile=model.profile, kv_dtype=layout.kv_dtype, tp=request.tp, mem_fraction_static=fraction,
        max_total_tokens=tokens, chunked_prefill_size=chunk, context_length=ctx,
        max_running_requests=layout.running, max_new_tokens=t.max_new_tokens, ssm_slots=slots,
        ssm_dtype=layout.ssm_dtype, kv_bytes_per_token=kvb, ssm_slot_bytes=sb, gpu_memory_bytes=total,
        static_bytes=static_bytes, ledger=ledger, binding_constraint=min(slack, key=lambda k: slack[k]),
        checks=checks, engine_args=model.render(values), retained_sessions=sessions,
        session_tokens=session_tokens,
        reuse_interval_tokens=model.reuse_interval(layout) if g.is_hybrid else model.page_tokens(g, layout),
        weight_format=g.weight_format,
    )


def _pool_refusal(
    request: PlanRequest, model: EngineModel, layout: Layout, tokens: int, required: int,
    avail: int, kvb: int, sb: int, fraction: float, pool_by_memory: int,
) -> PlanRefused:
    """Say why the pool is short: the static fraction, the cap, or SSM slots eating the budget."""
    t = request.targets
    what = (
        f"{t.retained_sessions} retained sessions x {t.session_tokens} tokens = {required}"
        if t.retained_sessions * t.session_tokens >= layout.context_length
        else f"context-length {required}"
    )
    slots_for_required = model.ssm_slots_needed(
        request.geometry, layout, required, t.retained_sessions, t.session_tokens
    )
    slots_floor = model.ssm_slots_needed(request.geometry, layout, 0, 0, 0)
    cap = request.pinned.max_total_tokens
    if cap is not None and cap < required:
        return PlanRefused(
            f"{what} tokens do not fit the KV pool: --max-total-tokens {cap} caps it below that, and "
            f"mem-fraction-static {fraction:.3f} sizes it at {pool_by_memory} tokens",
            "kv_pool",
        )
    pool_bytes = model.ssm_pool_bytes
    if required * kvb + pool_bytes(slots_floor, sb) <= avail < required * kvb + pool_bytes(slots_for_required, sb):
        return PlanRefused(
            f"{what} tokens need {slots_for_required} SSM checkpoint slots at chunk {layout.chunk} "
            f"({format_bytes(pool_bytes(slots_for_required, sb))}); with them the static budget holds only {tokens} "
            "tokens; "
            "a larger chunked-prefill-size needs fewer checkpoints",
            "ssm_slots",
        )
    if tokens < pool_by_memory:
        return PlanRefused(
            f"{what} tokens do not fit the KV pool capped at --max-total-tokens {tokens}", "kv_pool"
        )
    need = required * kvb + pool_bytes(slots_for_required, sb) - avail
    fraction_needed = _ceil_fraction(fraction + need / request.gpu_memory_bytes)
    return PlanRefused(
        f"{what} tokens do not fit the KV pool: mem-fraction-static {fraction:.3f} holds {tokens} tokens "
        f"({kvb} bytes each); it would take mem-fraction-static {fraction_needed:.3f}",
        "kv_pool",
    )


def _search(request: PlanRequest) -> Plan:
    """Best plan over free chunk and context choices: the longest context, then the preferred chunk."""
    model = engine_model(request.engine, request.engine_version, request.engine_flavour)
    t, pin = request.targets, request.pinned
    ctx_fixed = pin.context_length or t.context_length
    contexts = (ctx_fixed,) if ctx_fixed else tuple(
        c for c in AUTO_CONTEXT_CANDIDATES if c <= request.geometry.max_position_embeddings
    ) or (request.geometry.max_position_embeddings,)
    chunks = (pin.chunked_prefill_size,) if pin.chunked_prefill_size else CHUNK_CANDIDATES
    running = t.max_running_requests or DEFAULT_RUNNING_REQUESTS
    ssm_dtype = request.ssm_dtype or model.default_ssm_dtype
    refusals: list[PlanRefused] = []
    for ctx in contexts:
        feasible: list[Plan] = []
        for chunk in chunks:
            layout = Layout(chunk, ctx, running, request.kv_dtype, request.tp, ssm_dtype)
            try:
                feasible.append(price(request, model, layout))
            except PlanRefused as refusal:
                refusals.append(refusal)
        if feasible:
            # The first feasible chunk in preference order: a bigger pool from a smaller chunk is not worth
            # the prefill throughput it costs (seed 002); every target is already met.
            return feasible[0]
    # Name what fails for the candidate that got furthest (the most lenient one): a chunk that
    # breaks the activation headroom is not the reason when a smaller chunk gets to the pool.
    furthest = max(_STAGE[r.binding_constraint] for r in refusals)
    raise [r for r in refusals if _STAGE[r.binding_constraint] == furthest][-1 if not ctx_fixed else 0]


def make_plan(request: PlanRequest, with_alternatives: bool = True) -> Plan:
    """A plan satisfying every constraint, or PlanRefused with the binding one and nearby feasible requests.

    Raises ValueError for malformed requests (a field out of range), naming the field.
    """
    try:
        validate_request(request)
        return _search(request)
    except PlanRefused as refusal:
        if with_alternatives:
            from headroom.engine.plan.alternatives import nearest_alternatives

            refusal.alternatives = nearest_alternatives(request, refusal.binding_constraint)
        raise
