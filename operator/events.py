"""Kubernetes Events about an InferenceServer (what `kubectl describe` shows)."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from headroom.operator.kube import KubeClient, KubeError, object_path
from headroom.operator.labels import GROUP, KIND, VERSION


def post_event(kube: KubeClient, body: dict[str, Any], event_type: str, reason: str, message: str) -> None:
    """Best effort: a lost Event must never fail a rollout step, so API errors are swallowed."""
    meta = body["metadata"]
    now = datetime.now(tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    # Names must be unique; the API server's generateName is not used so that any server accepts it.
    name = f"{meta['name']}.{reason.lower()}.{time.time_ns():x}"
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
            "namespace": meta["namespace"], "uid": meta.get("uid", ""),
        },
        "type": event_type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "headroom-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        kube.create(object_path("v1", "events", meta["namespace"]), event)
    except KubeError:
        pass
