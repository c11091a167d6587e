"""Server-side Table rendering, so that `kubectl get` prints the columns a real API server would (tests only).

kubectl asks for `application/json;as=Table;...`: the server renders the columns, kubectl only prints them.
Custom resources get their CRD's additionalPrinterColumns (dotted jsonPaths, which is all the headroom CRD
uses); the built-in kinds the operator creates get the columns a real server shows for them.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

Row = Callable[[dict[str, Any]], list[Any]]


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def _dig(obj: Any, json_path: str) -> Any:
    """Value at a dotted jsonPath like `.status.plan.contextLength`, or None."""
    for key in json_path.strip().lstrip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def age(obj: dict[str, Any]) -> str:
    """kubectl's short duration since metadata.creationTimestamp: 7s, 3m, 2h, 4d."""
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return "<unknown>"
    created = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(datetime.UTC) - created).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _deployment(obj: dict[str, Any]) -> list[Any]:
    status = obj.get("status") or {}
    wanted = (obj.get("spec") or {}).get("replicas", 1)
    return [f"{status.get('readyReplicas', 0)}/{wanted}", status.get("updatedReplicas", 0),
            status.get("availableReplicas", 0)]


def _service(obj: dict[str, Any]) -> list[Any]:
    spec = obj.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
    return [spec.get("type", "ClusterIP"), spec.get("clusterIP", "<none>"), ports or "<none>"]


def _pod(obj: dict[str, Any]) -> list[Any]:
    statuses = (obj.get("status") or {}).get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    total = len(((obj.get("spec") or {}).get("containers")) or [])
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    return [f"{ready}/{total}", (obj.get("status") or {}).get("phase", "Pending"), restarts]


BUILTIN_COLUMNS: dict[str, tuple[list[str], Row]] = {
    "Deployment": (["Ready", "Up-to-date", "Available"], _deployment),
    "Service": (["Type", "Cluster-IP", "Port(s)"], _service),
    "Pod": (["Ready", "Status", "Restarts"], _pod),
}


def render_table(kind: str | None, printer_columns: list[dict[str, Any]] | None, objects: list[dict[str, Any]]) -> dict:
    """A meta.k8s.io/v1 Table: Name, the kind's columns, Age (a CRD declares its own Age column)."""
    names: list[str] = ["Name"]
    if printer_columns:
        names += [c["name"] for c in printer_columns]

        def row(obj: dict[str, Any]) -> list[Any]:
            return [age(obj) if c.get("type") == "date" else _dig(obj, c["jsonPath"]) for c in printer_columns]
    else:
        extra, builtin_row = BUILTIN_COLUMNS.get(kind or "", ([], lambda obj: []))
        names += [*extra, "Age"]

        def row(obj: dict[str, Any]) -> list[Any]:
            return [*builtin_row(obj), age(obj)]

    columns = [{"name": n, "type": "string", "format": "name" if n == "Name" else "", "description": "", "priority": 0}
               for n in names]
    rows = [{
        "cells": [(obj.get("metadata") or {}).get("name"), *row(obj)],
        "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata")},
    } for obj in objects]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": "1"},
            "columnDefinitions": columns, "rows": rows}
