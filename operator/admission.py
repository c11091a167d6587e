"""Validating admission: the planner runs at `kubectl apply` time and refuses infeasible specs.

The webhook path is /validate_inferenceserver (the handler id), as the Helm chart's
ValidatingWebhookConfiguration expects. What needs no planner is already refused by the CRD.
"""

from __future__ import annotations

from typing import Any

import kopf
from headroom.engine.plan import PlanRefused
from headroom.operator.context import MEMO_KEY, OperatorContext
from headroom.operator.desired import refusal_message
from headroom.operator.gpu_discovery import GpuMemoryUnknown
from headroom.operator.planning import InputsUnavailable, plan_for
from headroom.operator.spec import SpecError, parse_spec

WEBHOOK_ID = "validate_inferenceserver"


def inferenceserver_validate(
    spec: Any, namespace: str, memo: Any, warnings: list[str], **_: Any
) -> None:
    """Reject (HTTP 422 in the review) with the planner's message and its nearest alternatives."""
    ctx: OperatorContext = memo[MEMO_KEY]
    try:
        parsed = parse_spec(dict(spec))
        planned = plan_for(parsed, namespace, ctx.kube)
    except SpecError as exc:
        raise kopf.AdmissionError(f"invalid InferenceServer: {exc}", code=422) from exc
    except PlanRefused as exc:
        raise kopf.AdmissionError(f"no feasible plan: {refusal_message(exc)}", code=422) from exc
    except GpuMemoryUnknown as exc:
        raise kopf.AdmissionError(str(exc), code=422) from exc
    except InputsUnavailable as exc:
        # Applied together with its ConfigMap, the object may arrive first: admit it, plan later.
        warnings.append(f"not planned at admission: {exc}; the operator will plan when it appears")
        return
    warnings.append(
        f"plan {planned.revision}: context {planned.plan.context_length}, KV tokens {planned.plan.max_total_tokens}, "
        f"chunk {planned.plan.chunked_prefill_size}, slots {planned.plan.ssm_slots}"
    )
    overridden = overridden_flags(parsed.engine.extra_args, planned.plan.engine_args)
    if overridden:
        # extraArgs come last, so the engine takes them over the plan's: admitted, but said out loud.
        warnings.append(
            f"engine.extraArgs override planned flags {overridden}: the engine will not run this plan, "
            "and the smoke test judges it against the plan"
        )


def overridden_flags(extra_args: list[str], engine_args: list[str]) -> list[str]:
    """Flags (`--x` or `--x=v`) that extraArgs repeat from the planned flags."""

    def flags(args: list[str]) -> set[str]:
        return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}

    return sorted(flags(extra_args) & flags(engine_args))
