"""The desired revision of an InferenceServer, or the condition that says why there is none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headroom.engine.plan import PlanRefused
from headroom.operator.conditions import Condition
from headroom.operator.gpu_discovery import GpuMemoryUnknown
from headroom.operator.kube import KubeClient
from headroom.operator.planning import InputsUnavailable, PlannedRevision, plan_for, status_plan
from headroom.operator.spec import InferenceServerSpec, SpecError, parse_spec


@dataclass(frozen=True)
class Desired:
    """planned is None when the spec does not plan; `planned_condition` says why (or that it did)."""

    spec: InferenceServerSpec | None
    planned: PlannedRevision | None
    planned_condition: Condition
    status_plan: dict[str, Any] | None


def refusal_message(refused: PlanRefused) -> str:
    """The planner's message plus its nearest feasible alternatives, one per line."""
    lines = [f"{refused.message} (binding constraint: {refused.binding_constraint})"]
    for alt in refused.alternatives:
        lines.append(
            f"  alternative: {alt.change} -> context {alt.context_length}, KV tokens {alt.max_total_tokens}, "
            f"chunk {alt.chunked_prefill_size}, kv {alt.kv_dtype}, sessions {alt.retained_sessions}, "
            f"mem-fraction {alt.mem_fraction_static:.3f}"
        )
    return "\n".join(lines)


def desired_revision(raw_spec: dict[str, Any], namespace: str, kube: KubeClient) -> Desired:
    try:
        spec = parse_spec(raw_spec)
    except SpecError as exc:
        return Desired(None, None, Condition("Planned", "False", "InvalidSpec", str(exc)), None)
    try:
        planned = plan_for(spec, namespace, kube)
    except PlanRefused as exc:
        return Desired(spec, None, Condition("Planned", "False", "PlanRefused", refusal_message(exc)), None)
    except GpuMemoryUnknown as exc:
        return Desired(spec, None, Condition("Planned", "False", "GpuMemoryUnknown", str(exc)), None)
    except InputsUnavailable as exc:
        return Desired(spec, None, Condition("Planned", "False", "InputsUnavailable", str(exc)), None)
    except SpecError as exc:
        return Desired(spec, None, Condition("Planned", "False", "InvalidSpec", str(exc)), None)
    message = f"revision {planned.revision}; binding constraint: {planned.plan.binding_constraint}"
    return Desired(spec, planned, Condition("Planned", "True", "Planned", message), status_plan(planned))
