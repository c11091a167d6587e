"""Nearest feasible requests for a refused one: lower context, fewer sessions, larger chunk, lower KV precision."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from headroom.engine.plan.engines import engine_model
from headroom.engine.plan.types import Alternative, Plan, PlanRefused, PlanRequest

# Lower precision after each dtype, in the order a user would accept it.
_LOWER_PRECISION = {"bf16": ("fp8", "int8", "int4", "int2"), "fp8": ("int8", "int4", "int2"),
                    "int8": ("int4", "int2"), "int4": ("int2",), "int2": ()}
_MAX_ALTERNATIVES = 5


def _variants(request: PlanRequest) -> Iterator[tuple[str, PlanRequest]]:
    t, pin = request.targets, request.pinned
    pinned_levers = [v for v in (pin.mem_fraction_static, pin.max_total_tokens, pin.chunked_prefill_size) if v]
    if len(pinned_levers) >= 2:
        # The seed-004 lesson: these three only work when they move together.
        yield "derive mem_fraction_static, max_total_tokens and chunked_prefill_size together", replace(
            request,
            pinned=replace(pin, mem_fraction_static=None, max_total_tokens=None, chunked_prefill_size=None),
        )
    ctx = pin.context_length or t.context_length
    if ctx:
        lower = ctx
        for _ in range(8):
            lower //= 2
            if lower <= t.max_new_tokens:
                break
            yield f"context_length {ctx} -> {lower}", replace(
                request, targets=replace(t, context_length=lower), pinned=replace(pin, context_length=None)
            )
    for sessions in range(t.retained_sessions - 1, 0, -1):
        yield f"retained_sessions {t.retained_sessions} -> {sessions}", replace(
            request, targets=replace(t, retained_sessions=sessions)
        )
    chunk = pin.chunked_prefill_size
    if chunk:
        for factor in (2, 4):
            yield f"chunked_prefill_size {chunk} -> {chunk * factor}", replace(
                request, pinned=replace(pin, chunked_prefill_size=chunk * factor)
            )
    if pin.mem_fraction_static is not None:
        yield f"mem_fraction_static {pin.mem_fraction_static} -> derived", replace(
            request, pinned=replace(pin, mem_fraction_static=None)
        )
    if pin.max_total_tokens is not None:
        yield f"max_total_tokens {pin.max_total_tokens} -> derived", replace(
            request, pinned=replace(pin, max_total_tokens=None)
        )
    # Only dtypes the chosen profile has: never suggest what the engine would reject.
    offered = engine_model(request.engine, request.engine_version, request.engine_flavour).kv_dtypes
    lower = [d for d in _LOWER_PRECISION[request.kv_dtype] if d in offered]
    # A dtype the profile lacks: its own dtypes, the narrowest first.
    candidates = lower if request.kv_dtype in offered else list(reversed(offered))
    for dtype in candidates:
        yield f"kv_dtype {request.kv_dtype} -> {dtype}", replace(request, kv_dtype=dtype)
    if t.max_new_tokens > 1 and ctx and ctx <= t.max_new_tokens:
        yield f"max_new_tokens {t.max_new_tokens} -> {ctx // 4}", replace(
            request, targets=replace(t, max_new_tokens=max(1, ctx // 4))
        )


def _summary(change: str, plan: Plan) -> Alternative:
    return Alternative(
        change=change, context_length=plan.context_length, max_total_tokens=plan.max_total_tokens,
        chunked_prefill_size=plan.chunked_prefill_size, kv_dtype=plan.kv_dtype,
        retained_sessions=plan.retained_sessions, mem_fraction_static=plan.mem_fraction_static,
    )


def nearest_alternatives(request: PlanRequest, binding: str) -> list[Alternative]:
    """Up to five single changes that make the request feasible, the smallest change of each kind first."""
    from headroom.engine.plan.solver import make_plan

    found: list[Alternative] = []
    kinds_seen: set[str] = set()
    for change, variant in _variants(request):
        kind = change.split(" ", 1)[0] if " -> " in change else change
        if kind in kinds_seen:
            continue
        try:
            plan = make_plan(variant, with_alternatives=False)
        except (PlanRefused, ValueError):
            continue
        kinds_seen.add(kind)
        found.append(_summary(change, plan))
        if len(found) == _MAX_ALTERNATIVES:
            break
    return found
