"""A small dict-in, dict-out Kubernetes client: GET, POST, merge/JSON PATCH, DELETE, nothing more.

Merge and JSON patches only: strategic merge is what the official client picks by default for
built-in kinds, and it silently differs between servers; the emulator used in tests lacks it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import kubernetes

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class KubeError(RuntimeError):
    """A non-2xx answer; `status` is the HTTP status code."""

    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]}")
        self.status = status


@dataclass(frozen=True)
class KubeClient:
    """Thin wrapper over kubernetes.client.ApiClient that speaks raw JSON."""

    api: kubernetes.client.ApiClient

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In-cluster service account first, then $KUBECONFIG / ~/.kube/config."""
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=configuration)
        return cls(kubernetes.client.ApiClient(configuration))

    @classmethod
    def from_url(cls, url: str) -> KubeClient:
        """An unauthenticated client for a local API server (tests' emulator)."""
        configuration = kubernetes.client.Configuration()
        configuration.host = url.rstrip("/")
        return cls(kubernetes.client.ApiClient(configuration))

    def _call(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        request = self.api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(*request, _request_timeout=30)
        raw = response.read()
        text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw or "")
        if not 200 <= response.status <= 299:
            raise KubeError(response.status, method, path, text)
        return json.loads(text) if text else None

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`, or None when it does not exist."""
        try:
            return self._call("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, collection_path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", collection_path, body, "application/json")

    def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", path, patch, MERGE_PATCH)

    def json_patch(self, path: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        return self._call("PATCH", path, ops, JSON_PATCH)

    def delete(self, path: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            self._call("DELETE", path)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def list_items(self, collection_path: str) -> list[dict[str, Any]]:
        return list((self._call("GET", collection_path) or {}).get("items", []))


def object_path(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
    """'/apis/apps/v1/namespaces/ns/deployments/x' (or /api/v1/... for the core group)."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")
