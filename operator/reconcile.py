"""One level-based pass over an InferenceServer: read everything, take the one next step, write status.

Called from the create/update/resume handlers and from the per-object daemon, under a per-object
lock, always on a freshly read object (never on a possibly stale event body).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

from headroom.operator.conditions import merge_conditions
from headroom.operator.context import OperatorContext
from headroom.operator.desired import desired_revision
from headroom.operator.kube import object_path
from headroom.operator.labels import GROUP, PLURAL, VERSION
from headroom.operator.revisions import deployment_ready, deployment_revision
from headroom.operator.rollout import Observed, SmokeState, Step, next_step, target_revision
from headroom.operator.steps import apply_step


def server_path(namespace: str, name: str) -> str:
    return object_path(f"{GROUP}/{VERSION}", PLURAL, namespace, name)


def iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(ctx: OperatorContext, namespace: str, name: str, logger: logging.Logger | None = None) -> Step | None:
    """Returns the step taken, or None when the object is gone or being deleted."""
    kube = ctx.kube
    body = kube.get(server_path(namespace, name))
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status: dict[str, Any] = dict(body.get("status") or {})
    now = ctx.clock()
    desired = desired_revision(body.get("spec") or {}, namespace, kube)
    deployment = kube.get(object_path("apps/v1", "deployments", namespace, name))
    spec = desired.spec
    observed = Observed(
        desired_revision=desired.planned.revision if desired.planned else None,
        last_good_revision=status.get("lastGoodRevision"),
        failed_revision=status.get("failedRevision"),
        deployment_revision=deployment_revision(deployment),
        deployment_ready=deployment_ready(deployment),
        rollout_started_at=(status.get("rollout") or {}).get("startedAt"),
        smoke=SmokeState.NONE,
        smoke_enabled=spec.smoke_test.enabled if spec else True,
        auto_rollback=spec.rollout.auto_rollback if spec else True,
        ready_timeout_s=float(spec.rollout.ready_timeout_seconds if spec else 1800),
        now=now,
    )
    target = target_revision(observed)
    outcome = None
    if target is not None:
        smoke_state, outcome = ctx.smoke.state((namespace, name, target))
        observed = Observed(**{**observed.__dict__, "smoke": smoke_state})
    step = next_step(observed)
    result = apply_step(ctx, body, step, desired, observed, outcome)
    if logger is not None and step.action.value not in ("wait", "steady"):
        logger.info(f"{namespace}/{name}: {step.action.value} revision {step.revision} ({step.reason})")

    new_status: dict[str, Any] = {
        "phase": step.phase,
        "message": result.message or step.message or desired.planned_condition.message,
        "observedGeneration": (body.get("metadata") or {}).get("generation"),
        **result.status,
    }
    if desired.status_plan is not None:
        new_status["plan"] = desired.status_plan
    new_status["conditions"] = merge_conditions(
        list(status.get("conditions") or []),
        [desired.planned_condition, *result.conditions],
        now=iso(now),
        generation=new_status["observedGeneration"],
    )
    changed = {k: v for k, v in new_status.items() if status.get(k) != v}
    if changed:
        kube.merge_patch(server_path(namespace, name) + "/status", {"status": changed})
    return step
