"""spec.auth.apiKeySecret: the engine reads its key from the Secret, and so does the operator's smoke test.

The key reaches the engine as an environment variable from a secretKeyRef (never in the pod spec):
HEADROOM_API_KEY for `headroom serve`, VLLM_API_KEY for `vllm serve`; SGLang reads no variable, so its
--api-key argument refers to the variable and the kubelet expands it. The operator needs `get` on that
Secret only to send the same key with its smoke test.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from headroom.operator.kube import KubeClient, object_path
from headroom.operator.spec import InferenceServerSpec

ENGINE_KEY_ENV = {"builtin": "HEADROOM_API_KEY", "vllm": "VLLM_API_KEY", "sglang": "HEADROOM_API_KEY"}


class ApiKeyUnavailable(RuntimeError):
    """The Secret or its key is missing or unreadable; the message names both."""


def api_key_env(spec: InferenceServerSpec) -> list[dict[str, Any]]:
    ref = spec.auth.api_key_secret
    if ref is None:
        return []
    return [{"name": ENGINE_KEY_ENV[spec.engine.kind],
             "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def api_key_args(spec: InferenceServerSpec) -> list[str]:
    if spec.auth.api_key_secret is None or spec.engine.kind != "sglang":
        return []
    return ["--api-key", f"$({ENGINE_KEY_ENV['sglang']})"]


def read_api_key(kube: KubeClient, namespace: str, spec: InferenceServerSpec) -> str | None:
    """The key the engine was given, or None when spec.auth sets none."""
    ref = spec.auth.api_key_secret
    if ref is None:
        return None
    where = f"Secret {namespace}/{ref.name} key {ref.key!r} (spec.auth.apiKeySecret)"
    secret = kube.get(object_path("v1", "secrets", namespace, ref.name))
    if secret is None:
        raise ApiKeyUnavailable(f"{where}: the Secret does not exist")
    encoded = (secret.get("data") or {}).get(ref.key)
    if encoded is None:
        raise ApiKeyUnavailable(f"{where}: the Secret has no such key")
    try:
        key = base64.b64decode(encoded, validate=True).decode("utf-8").strip()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ApiKeyUnavailable(f"{where}: not base64-encoded UTF-8 ({exc})") from exc
    if not key:
        raise ApiKeyUnavailable(f"{where}: the key is empty")
    return key
