"""Validating admission as the API server does it: AdmissionReviews POSTed to the webhooks (tests only).

Each ValidatingWebhookConfiguration stored in the emulator is consulted on CREATE and UPDATE of the
resources its rules name. Only webhooks with `clientConfig.url` are called (no CA checks); one that names a
Service is skipped, since nothing here routes to cluster Services (the chart's own configuration is such a
one: its test calls the webhook directly). failurePolicy decides what an unreachable webhook means.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

WEBHOOKS_PATH = ("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations")


@dataclass(frozen=True)
class Verdict:
    """allowed; when not, the HTTP code and the message the API server returns; warnings either way."""

    allowed: bool
    code: int = 200
    message: str = ""
    warnings: list[str] = field(default_factory=list)


def _matches(rule: dict[str, Any], group: str, version: str, plural: str, operation: str) -> bool:
    def has(values: list[str] | None, value: str) -> bool:
        return bool(values) and ("*" in values or value in values)

    return (has(rule.get("apiGroups"), group) and has(rule.get("apiVersions"), version)
            and has(rule.get("resources"), plural) and has(rule.get("operations"), operation))


def matching_webhooks(
    configurations: list[dict[str, Any]], group: str, version: str, plural: str, operation: str
) -> list[dict[str, Any]]:
    return [hook for config in configurations for hook in config.get("webhooks") or []
            if any(_matches(rule, group, version, plural, operation) for rule in hook.get("rules") or [])]


def review(obj: dict[str, Any], old: dict[str, Any] | None, group: str, version: str, plural: str,
           operation: str) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()),
        "kind": {"group": group, "version": version, "kind": obj.get("kind", "")},
        "resource": {"group": group, "version": version, "resource": plural},
        "namespace": meta.get("namespace"), "name": meta.get("name"), "operation": operation,
        "userInfo": {"username": "kubectl-user", "groups": ["system:authenticated"]},
        "object": obj, "oldObject": old, "dryRun": False,
    }}


async def call_webhooks(hooks: list[dict[str, Any]], body: dict[str, Any]) -> Verdict:
    """Ask every matching webhook in turn; the first denial wins, as in kube-apiserver."""
    warnings: list[str] = []
    async with aiohttp.ClientSession() as session:
        for hook in hooks:
            name, url = hook.get("name", "?"), (hook.get("clientConfig") or {}).get("url")
            if not url:
                continue
            try:
                timeout = aiohttp.ClientTimeout(total=float(hook.get("timeoutSeconds", 10)))
                async with session.post(url, json=body, timeout=timeout) as rsp:
                    answer = (await rsp.json(content_type=None))["response"]
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                if hook.get("failurePolicy", "Fail") == "Ignore":
                    continue
                return Verdict(False, 500, f'failed calling webhook "{name}": {type(exc).__name__}: {exc}')
            warnings += list(answer.get("warnings") or [])
            if not answer.get("allowed"):
                status = answer.get("status") or {}
                message = f'admission webhook "{name}" denied the request: {status.get("message", "")}'
                return Verdict(False, int(status.get("code") or 400), message, warnings)
    return Verdict(True, warnings=warnings)
