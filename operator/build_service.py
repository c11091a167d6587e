"""build_service: the stable Service (validated revision) and the canary Service (revision under test).

Both select by revision label, so moving traffic is a selector change, never a pod restart.
"""

from __future__ import annotations

from typing import Any

from headroom.operator.labels import INSTANCE_LABEL, REVISION_LABEL, canary_service_name, child_metadata


def _service(owner: dict[str, Any], name: str, revision: str, port: int) -> dict[str, Any]:
    server_name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, name),
        "spec": {
            "type": "ClusterIP",
            "selector": {INSTANCE_LABEL: server_name, REVISION_LABEL: revision},
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_service(owner: dict[str, Any], validated_revision: str, port: int) -> dict[str, Any]:
    """Service `<server>`: clients' entry point; selects only a revision that passed the smoke test."""
    return _service(owner, owner["metadata"]["name"], validated_revision, port)


def build_canary_service(owner: dict[str, Any], revision: str, port: int) -> dict[str, Any]:
    """Service `<server>-canary`: the smoke test's entry point to the revision being rolled out."""
    return _service(owner, canary_service_name(owner["metadata"]["name"]), revision, port)
