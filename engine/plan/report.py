"""Human-readable rendering of a plan or a refusal (the default `headroom plan` output)."""

from __future__ import annotations

from headroom.engine.plan.types import Plan, PlanRefused
from headroom.engine.plan.units import format_bytes

# Ledger entries that live outside the static budget (every engine model names them so).
OUTSIDE_STATIC = (
    "cuda_context", "activations", "dequant_transient", "weight_dequant_transient", "graph_reserve", "fragmentation", "backend_metadata",
    "req_to_token_outside", "startup_in_use", "tp_communicator",
)
_TOTAL_KEYS = ("static_total", "non_static_total", "unused")


def render_plan(plan: Plan) -> str:
    settings = [
        ("engine", plan.engine),
        ("mem-fraction-static", f"{plan.mem_fraction_static:.3f}"),
        ("max-total-tokens", f"{plan.max_total_tokens:,}"),
        ("chunked-prefill-size", f"{plan.chunked_prefill_size:,}"),
        ("context-length", f"{plan.context_length:,}"),
        ("max-running-requests", str(plan.max_running_requests)),
        ("ssm slots", f"{plan.ssm_slots} ({plan.ssm_dtype}, {format_bytes(plan.ssm_slot_bytes)} each)"),
        ("weights", f"{plan.weight_format}, {format_bytes(plan.ledger.get('weights', 0))} per GPU"),
        ("kv cache", f"{plan.kv_dtype}, {plan.kv_bytes_per_token:,} bytes/token/GPU"),
        ("gpu memory", f"{format_bytes(plan.gpu_memory_bytes)} per GPU, tp {plan.tp}"),
        ("binding constraint", plan.binding_constraint),
    ]
    width = max(len(k) for k, _ in settings)
    lines = ["Plan", *(f"  {k:<{width}}  {v}" for k, v in settings), "", "Ledger (per GPU)"]
    outside = [k for k in plan.ledger if k in OUTSIDE_STATIC]
    static = [k for k in plan.ledger if k not in OUTSIDE_STATIC and k not in _TOTAL_KEYS]
    for title, keys in (("static", static), ("outside static", outside)):
        lines.append(f"  {title}:")
        lines += [f"    {k:<24} {format_bytes(plan.ledger[k]):>12}" for k in keys]
    lines += [f"  {k:<26} {format_bytes(plan.ledger[k]):>12}" for k in _TOTAL_KEYS]
    lines += ["", "Checks", *(f"  {k}: {v}" for k, v in plan.checks.items())]
    lines += ["", "Engine args", "  " + " ".join(plan.engine_args)]
    return "\n".join(lines)


def render_refusal(refusal: PlanRefused) -> str:
    lines = [f"No feasible plan: {refusal.message}", f"binding constraint: {refusal.binding_constraint}"]
    if refusal.alternatives:
        lines.append("nearest feasible alternatives:")
        for alt in refusal.alternatives:
            lines.append(
                f"  - {alt.change}: context {alt.context_length:,}, pool {alt.max_total_tokens:,} tokens, "
                f"chunk {alt.chunked_prefill_size:,}, kv {alt.kv_dtype}, sessions {alt.retained_sessions}, "
                f"mem-fraction-static {alt.mem_fraction_static:.3f}"
            )
    else:
        lines.append("no single change found a feasible plan; a larger GPU or more tensor parallelism is needed")
    return "\n".join(lines)
