"""Children of one revision: ensure its ConfigMap exists, read it back, render its Deployment.

A rollback needs the last good revision's spec and flags after the user changed the spec; the
revision's ConfigMap (build_configmap) keeps both, so a revision is rebuildable from it alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from headroom.operator.build_configmap import build_configmap
from headroom.operator.build_deployment import build_deployment
from headroom.operator.kube import KubeClient, object_path
from headroom.operator.labels import REVISION_LABEL, config_map_name
from headroom.operator.planning import PlannedRevision
from headroom.operator.spec import InferenceServerSpec, parse_spec


class RevisionMissing(RuntimeError):
    """The ConfigMap of a revision is gone: it cannot be re-deployed."""


@dataclass(frozen=True)
class RevisionRecord:
    """What a Deployment is rendered from. plan is Plan.to_dict()."""

    revision: str
    spec: InferenceServerSpec
    plan: dict[str, Any]


def ensure_revision_configmap(kube: KubeClient, owner: dict[str, Any], planned: PlannedRevision) -> None:
    namespace = owner["metadata"]["namespace"]
    path = object_path("v1", "configmaps", namespace, config_map_name(owner["metadata"]["name"], planned.revision))
    if kube.get(path) is None:
        kube.create(object_path("v1", "configmaps", namespace), build_configmap(owner, planned))


def load_revision(kube: KubeClient, owner: dict[str, Any], revision: str) -> RevisionRecord:
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    config_map = kube.get(object_path("v1", "configmaps", namespace, config_map_name(name, revision)))
    if config_map is None:
        raise RevisionMissing(f"ConfigMap {namespace}/{config_map_name(name, revision)} of revision {revision} is gone")
    data = config_map.get("data") or {}
    return RevisionRecord(revision, parse_spec(json.loads(data["spec.json"])), json.loads(data["plan.json"]))


def apply_deployment(kube: KubeClient, owner: dict[str, Any], record: RevisionRecord, default_image: str) -> None:
    """Create the Deployment, or replace its spec, labels and annotations with JSON patches."""
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    desired = build_deployment(owner, record.spec, list(record.plan["engine_args"]), record.revision, default_image)
    path = object_path("apps/v1", "deployments", namespace, name)
    if kube.get(path) is None:
        kube.create(object_path("apps/v1", "deployments", namespace), desired)
        return
    # Whole-field replacement: a merge patch would keep keys the new revision dropped (e.g. a nodeSelector).
    kube.json_patch(path, [
        {"op": "add", "path": "/metadata/labels", "value": desired["metadata"]["labels"]},
        {"op": "add", "path": "/metadata/annotations", "value": desired["metadata"]["annotations"]},
        {"op": "replace", "path": "/spec", "value": desired["spec"]},
    ])


def deployment_revision(deployment: dict[str, Any] | None) -> str | None:
    if deployment is None:
        return None
    return ((deployment.get("metadata") or {}).get("annotations") or {}).get(REVISION_LABEL)


def deployment_ready(deployment: dict[str, Any] | None) -> bool:
    """Ready only when the controller has seen the latest template and a pod of it is ready."""
    if deployment is None:
        return False
    generation = (deployment.get("metadata") or {}).get("generation")
    status = deployment.get("status") or {}
    if generation is not None and int(status.get("observedGeneration") or 0) < int(generation):
        return False
    return int(status.get("updatedReplicas") or 0) >= 1 and int(status.get("readyReplicas") or 0) >= 1
