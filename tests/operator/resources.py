"""InferenceServer manifests shared by the operator tests (a small Qwen3.5-style hybrid model)."""

from __future__ import annotations

import copy
from typing import Any

from headroom.engine.plan.presets import preset_config

NAMESPACE = "llm"

# A Qwen3.5-4B-shaped config.json (hybrid: 3 Gated DeltaNet layers per full-attention layer).
CONFIG_JSON: dict[str, Any] = preset_config("qwen3.5-4b")[0]

SPEC: dict[str, Any] = {
    "model": {"pvc": {"claimName": "models"}, "path": "qwen3.5-4b", "config": CONFIG_JSON},
    "gpu": {"count": 1, "memory": "24Gi"},
    "engine": {"kind": "builtin"},
    "kvCache": {"dtype": "bf16"},
    "targets": {"contextLength": 32768, "maxRunningRequests": 4, "maxNewTokens": 512},
    "smokeTest": {"enabled": True, "timeoutSeconds": 60},
    "rollout": {"autoRollback": True, "readyTimeoutSeconds": 600},
}


def inference_server(name: str = "qwen", **spec_changes: Any) -> dict[str, Any]:
    """A valid InferenceServer; spec_changes replace top-level spec keys (None removes one)."""
    spec = copy.deepcopy(SPEC)
    for key, value in spec_changes.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return {
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "InferenceServer",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }
