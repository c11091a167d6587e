"""Names, labels and owner references shared by every child object of an InferenceServer."""

from __future__ import annotations

from typing import Any

GROUP = "headroom.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservers"
KIND = "InferenceServer"
REVISION_LABEL = "headroom.dev/revision"
INSTANCE_LABEL = "app.kubernetes.io/instance"
ENGINE_CONTAINER = "engine"


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """ownerReference to the InferenceServer body; the garbage collector deletes children with it."""
    meta = owner["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def common_labels(server_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "headroom-engine",
        INSTANCE_LABEL: server_name,
        "app.kubernetes.io/managed-by": "headroom-operator",
    }


def child_metadata(owner: dict[str, Any], name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    server_name = owner["metadata"]["name"]
    return {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": {**common_labels(server_name), **(extra_labels or {})},
        "ownerReferences": [owner_reference(owner)],
    }


def config_map_name(server_name: str, revision: str) -> str:
    return f"{server_name}-plan-{revision}"


def canary_service_name(server_name: str) -> str:
    """The Service that follows the revision under test; the smoke test goes through it."""
    return f"{server_name}-canary"
