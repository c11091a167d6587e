"""Spec -> plan -> revision: the one path both the admission webhook and the handlers take.

A revision is the hash of everything the engine pod is built from (plan flags, image, model,
GPUs), so an unchanged spec maps to the same revision and a rollout starts only on a real change.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from headroom.engine.plan import GeometryError, Plan, make_plan, parse_size
from headroom.operator.gpu_discovery import discover_gpu_memory
from headroom.operator.kube import KubeClient, object_path
from headroom.operator.spec import InferenceServerSpec, SpecError, model_geometry, plan_request


class InputsUnavailable(RuntimeError):
    """A referenced object (the geometry ConfigMap) is missing; retry later, the spec may be fine."""


@dataclass(frozen=True)
class PlannedRevision:
    """A plan and the revision it defines. `spec` is the spec snapshot the pod is built from."""

    spec: InferenceServerSpec
    plan: Plan
    revision: str
    gpu_memory_bytes: int


def revision_hash(spec: InferenceServerSpec, plan: Plan) -> str:
    """10 hex characters of sha256 over what the pod is built from."""
    material = {
        "engine_args": plan.engine_args,
        "engine": spec.engine.model_dump(by_alias=True),
        "model": spec.model.model_dump(by_alias=True, exclude={"config", "config_map", "weight_bytes"}),
        "gpu": {"count": spec.gpu.count, "product": spec.gpu.product},
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return digest[:10]


def plan_revision(spec: InferenceServerSpec, config_json: dict[str, Any], gpu_memory_bytes: int) -> PlannedRevision:
    """Pure: run the planner. Raises PlanRefused (infeasible) or SpecError (unusable geometry)."""
    try:
        geometry = model_geometry(spec, config_json)
    except GeometryError as exc:
        raise SpecError(f"spec.model geometry: {exc}") from exc
    plan = make_plan(plan_request(spec, geometry, gpu_memory_bytes))
    return PlannedRevision(spec=spec, plan=plan, revision=revision_hash(spec, plan), gpu_memory_bytes=gpu_memory_bytes)


def read_config_json(spec: InferenceServerSpec, namespace: str, kube: KubeClient) -> dict[str, Any]:
    """The model's config.json: inline, or from the ConfigMap named in spec.model.configMap."""
    if spec.model.config is not None:
        return dict(spec.model.config)
    ref = spec.model.config_map
    assert ref is not None  # the spec model guarantees exactly one geometry source
    config_map = kube.get(object_path("v1", "configmaps", namespace, ref.name))
    if config_map is None:
        raise InputsUnavailable(f"spec.model.configMap: ConfigMap {namespace}/{ref.name} not found")
    text = (config_map.get("data") or {}).get(ref.key)
    if text is None:
        raise SpecError(f"spec.model.configMap: ConfigMap {namespace}/{ref.name} has no key {ref.key!r}")
    try:
        return dict(json.loads(text))
    except json.JSONDecodeError as exc:
        raise SpecError(f"spec.model.configMap: {ref.name}[{ref.key}] is not valid JSON: {exc}") from exc


def gpu_memory_bytes(spec: InferenceServerSpec, kube: KubeClient) -> int:
    """spec.gpu.memory when given, else the GPU feature discovery labels of the nodes."""
    if spec.gpu.memory is not None:
        try:
            return parse_size(spec.gpu.memory, field="spec.gpu.memory")
        except ValueError as exc:
            raise SpecError(str(exc)) from exc
    nodes = kube.list_items(object_path("v1", "nodes", None))
    return discover_gpu_memory(nodes, product=spec.gpu.product, count=spec.gpu.count).memory_bytes


def plan_for(spec: InferenceServerSpec, namespace: str, kube: KubeClient) -> PlannedRevision:
    """Gather inputs through the API, then plan."""
    return plan_revision(spec, read_config_json(spec, namespace, kube), gpu_memory_bytes(spec, kube))


def status_plan(planned: PlannedRevision) -> dict[str, Any]:
    """What status.plan shows: the four flags, slots, ledger, binding constraint, hash."""
    plan = planned.plan
    return {
        "hash": planned.revision,
        "memFractionStatic": plan.mem_fraction_static,
        "maxTotalTokens": plan.max_total_tokens,
        "chunkedPrefillSize": plan.chunked_prefill_size,
        "contextLength": plan.context_length,
        "maxRunningRequests": plan.max_running_requests,
        "ssmSlots": plan.ssm_slots,
        "kvCacheDtype": plan.kv_dtype,
        "bindingConstraint": plan.binding_constraint,
        "gpuMemoryBytes": planned.gpu_memory_bytes,
        "ledger": dict(plan.ledger),
        "engineArgs": list(plan.engine_args),
    }
