"""Carry out one rollout step against the API and say what status and conditions follow from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from headroom.operator.api_key import ApiKeyUnavailable, read_api_key
from headroom.operator.build_service import build_canary_service, build_service
from headroom.operator.conditions import Condition
from headroom.operator.context import OperatorContext
from headroom.operator.desired import Desired
from headroom.operator.events import post_event
from headroom.operator.kube import KubeClient, object_path
from headroom.operator.labels import canary_service_name, config_map_name
from headroom.operator.revisions import (
    RevisionRecord,
    apply_deployment,
    ensure_revision_configmap,
    load_revision,
)
from headroom.operator.rollout import Action, Observed, Step
from headroom.operator.smoke_gate import SmokeOutcome, SmokeRequest


@dataclass(frozen=True)
class StepResult:
    status: dict[str, Any] = field(default_factory=dict)
    conditions: list[Condition] = field(default_factory=list)
    message: str = ""


def _record(ctx: OperatorContext, body: dict[str, Any], desired: Desired, revision: str) -> RevisionRecord:
    planned = desired.planned
    if planned is not None and planned.revision == revision:
        ensure_revision_configmap(ctx.kube, body, planned)
        return RevisionRecord(revision, planned.spec, planned.plan.to_dict())
    return load_revision(ctx.kube, body, revision)


def _apply_service(kube: KubeClient, desired_service: dict[str, Any]) -> None:
    meta = desired_service["metadata"]
    path = object_path("v1", "services", meta["namespace"], meta["name"])
    live = kube.get(path)
    if live is None:
        kube.create(object_path("v1", "services", meta["namespace"]), desired_service)
    elif (live.get("spec") or {}).get("selector") != desired_service["spec"]["selector"]:
        kube.merge_patch(path, {"spec": {"selector": desired_service["spec"]["selector"]}})


def _smoke_request(ctx: OperatorContext, body: dict[str, Any], record: RevisionRecord) -> SmokeRequest | None:
    """None while the template names {cluster_ip} and the canary Service has none yet."""
    meta = body["metadata"]
    fields = {"service": canary_service_name(meta["name"]), "namespace": meta["namespace"], "name": meta["name"],
              "port": record.spec.engine.port}
    if "{cluster_ip}" in ctx.settings.engine_url_template:
        service = ctx.kube.get(object_path("v1", "services", meta["namespace"], fields["service"])) or {}
        fields["cluster_ip"] = (service.get("spec") or {}).get("clusterIP") or ""
        if fields["cluster_ip"] in ("", "None"):
            return None
    url = ctx.settings.engine_url_template.format(**fields)
    return SmokeRequest(
        url=url,
        context_length=int(record.plan["context_length"]),
        max_new_tokens=int(record.plan["max_new_tokens"]),
        thresholds=record.spec.smoke_test.thresholds.model_dump(by_alias=True, exclude_none=True),
        timeout_s=float(record.spec.smoke_test.timeout_seconds),
        plan=record.plan,
        api_key=read_api_key(ctx.kube, meta["namespace"], record.spec),
    )


def _drop_stale_configmaps(kube: KubeClient, body: dict[str, Any], keep: set[str]) -> None:
    status = body.get("status") or {}
    meta = body["metadata"]
    for revision in {status.get("currentRevision"), status.get("lastGoodRevision"), status.get("failedRevision")}:
        if revision and revision not in keep:
            kube.delete(object_path("v1", "configmaps", meta["namespace"], config_map_name(meta["name"], revision)))


def apply_step(
    ctx: OperatorContext, body: dict[str, Any], step: Step, desired: Desired, observed: Observed,
    outcome: SmokeOutcome | None,
) -> StepResult:
    kube, meta, now = ctx.kube, body["metadata"], observed.now
    revision = step.revision
    if step.action == Action.HOLD or revision is None:
        return StepResult(conditions=[Condition("Ready", "False", step.reason, step.message)], message=step.message)
    record = _record(ctx, body, desired, revision)
    port = record.spec.engine.port
    if step.action == Action.DEPLOY:
        apply_deployment(kube, body, record, ctx.settings.engine_image)
        _apply_service(kube, build_canary_service(body, revision, port))
        return StepResult(
            status={"currentRevision": revision, "rollout": {"revision": revision, "startedAt": now}},
            conditions=[Condition("Deployed", "False", step.reason, f"rendering revision {revision}")],
        )
    if step.action == Action.WAIT:
        deployed = "True" if step.reason == "SmokeRunning" else "False"
        # A rollout found without a start time (status edited, older operator) starts its clock now.
        clock = {} if observed.rollout_started_at is not None else {"rollout": {"revision": revision, "startedAt": now}}
        return StepResult(status=clock, conditions=[Condition("Deployed", deployed, step.reason, f"revision {revision}")])
    if step.action == Action.START_SMOKE:
        try:
            request = _smoke_request(ctx, body, record)
        except ApiKeyUnavailable as exc:
            # The engine got its key from the same Secret; until the operator can read it, no gate runs.
            reason = f"revision {revision}: {exc}"
            return StepResult(conditions=[Condition("Validated", "Unknown", "ApiKeyUnavailable", reason)], message=reason)
        if request is None:
            waiting = f"Service {canary_service_name(meta['name'])} has no clusterIP yet"
            return StepResult(conditions=[Condition("Validated", "Unknown", "WaitingForService", waiting)])
        ctx.smoke.start((meta["namespace"], meta["name"], revision), request)
        return StepResult(
            # checks: None drops the previous run's verdicts (status is merge-patched).
            status={"lastSmoke": {"revision": revision, "result": "Running", "summary": "", "finishedAt": "",
                                  "checks": None}},
            conditions=[Condition("Deployed", "True", "Ready", f"revision {revision} is ready"),
                        Condition("Validated", "Unknown", "SmokeRunning", f"smoke test of revision {revision}")],
        )
    # checks: every probe's verdict and reason, for `kubectl get isvc -o jsonpath='{.status.lastSmoke.checks}'`.
    smoke = {"revision": revision, "result": "Passed" if step.action == Action.PROMOTE else "Failed",
             "summary": outcome.summary if outcome else step.reason, "finishedAt": now,
             "checks": outcome.checks if outcome else {}}
    if step.action == Action.PROMOTE:
        _apply_service(kube, build_service(body, revision, port))
        _drop_stale_configmaps(kube, body, keep={revision})
        post_event(kube, body, "Normal", "Validated", f"revision {revision} passed the smoke test; Service moved")
        return StepResult(
            status={"lastGoodRevision": revision, "lastSmoke": smoke if outcome else {**smoke, "result": "Skipped"}},
            conditions=[Condition("Deployed", "True", "Ready", f"revision {revision}"),
                        Condition("Validated", "True", step.reason, smoke["summary"]),
                        Condition("Ready", "True", "Serving", f"Service points at revision {revision}"),
                        Condition("Degraded", "False", "Validated", "")],
        )
    if step.action == Action.FAIL:
        message = step.message or f"revision {revision} failed the smoke test: {smoke['summary']}"
        can_roll_back = observed.auto_rollback and observed.last_good_revision not in (None, revision)
        then = f"; rolling back to {observed.last_good_revision}" if can_roll_back else ""
        post_event(kube, body, "Warning", step.reason, message + then)
        _drop_stale_configmaps(kube, body, keep={revision, observed.last_good_revision or ""})
        return StepResult(
            status={"failedRevision": revision, "lastSmoke": smoke},
            conditions=[Condition("Validated", "False", step.reason, message),
                        Condition("Degraded", "True", "RollingBack" if can_roll_back else step.reason, message + then),
                        *([] if can_roll_back else [Condition("Ready", "False", step.reason, message)])],
            message=message + then,
        )
    # STEADY: the last good revision is deployed and ready; make sure the Service points at it.
    _apply_service(kube, build_service(body, revision, port))
    degraded = step.reason == "RolledBack"
    return StepResult(
        conditions=[Condition("Deployed", "True", "Ready", f"revision {revision}"),
                    Condition("Ready", "True", "Serving", f"Service points at revision {revision}"),
                    Condition("Degraded", "True" if degraded else "False", step.reason, step.message)],
    )
