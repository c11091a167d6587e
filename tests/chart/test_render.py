"""helm lint --strict and helm template with default and non-default values; every built-in manifest
passes kubernetes-validate --strict; values.schema.json rejects what it does not know."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from kubernetes_validate import SchemaNotFoundError, ValidationError
from kubernetes_validate import validate as validate_builtin

from tests.chart.chart_tools import CHART_DIR, RELEASE_NAMESPACE, Renderer, by_kind, run_helm

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")
# Kinds that are not built into Kubernetes: the validator has no schema for them (checked elsewhere).
CUSTOM_KINDS = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate"),
                ("kopf.dev/v1", "ClusterKopfPeering"), ("kopf.dev/v1", "KopfPeering")}

VALUE_SETS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "cert-manager": ("certManager.enabled=true",),
    "cert-manager-existing-issuer": ("certManager.enabled=true", "certManager.issuerRef.name=corp-ca",
                                     "certManager.issuerRef.kind=ClusterIssuer"),
    "no-crds-no-webhook": ("crds.enabled=false", "webhook.enabled=false"),
    "crds-not-kept": ("crds.keep=false",),
    "namespaced-peering": ("operator.watchNamespaces={team-a,team-b}", "operator.peering.enabled=true",
                           "operator.replicas=2"),
    "cluster-peering": ("operator.peering.enabled=true", "operator.replicas=2"),
    "network-policy": ("networkPolicy.enabled=true",),
    "network-policy-namespaced": ("networkPolicy.enabled=true", "operator.watchNamespaces={team-a,team-b}",
                                  "networkPolicy.engineClients[0].namespaceSelector.matchLabels.team=apps",
                                  "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/8", "webhook.port=10443"),
    "no-secret-reading": ("rbac.readApiKeySecrets=false",),
    "custom-resources": ("operator.resources.requests.cpu=250m", "operator.resources.requests.memory=1Gi",
                         "operator.resources.limits.memory=2Gi", "image.tag=dev", "image.pullPolicy=Never",
                         "operator.logLevel=DEBUG", "webhook.failurePolicy=Ignore", "webhook.port=10443",
                         "serviceAccount.name=headroom-op", "imagePullSecrets[0].name=regcred"),
}


def _short(exc: Exception) -> str:
    return str(exc).split("\n", 1)[0]


def test_lint_strict_defaults(helm_binary: Path) -> None:
    result = run_helm(helm_binary, "lint", "--strict", str(CHART_DIR))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict_with_values(helm_binary: Path, name: str) -> None:
    args = [arg for item in VALUE_SETS[name] for arg in ("--set", item)]
    result = run_helm(helm_binary, "lint", "--strict", str(CHART_DIR), "--namespace", RELEASE_NAMESPACE, *args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_builtin_manifest_validates_strictly(render: Renderer, name: str) -> None:
    manifests = render(*VALUE_SETS[name])
    assert by_kind(manifests, "Deployment"), "the operator Deployment is always rendered"
    skipped: set[tuple[str, str]] = set()
    for manifest in manifests:
        identity = (manifest["apiVersion"], manifest["kind"])
        for version in KUBERNETES_VERSIONS:
            try:
                validate_builtin(manifest, version, strict=True)
            except SchemaNotFoundError:
                skipped.add(identity)
            except ValidationError as exc:
                pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']} invalid for {version}: {_short(exc)}")
    assert skipped <= CUSTOM_KINDS, f"no schema for built-in kinds {sorted(skipped - CUSTOM_KINDS)}"


def test_non_default_values_reach_the_manifests(render: Renderer) -> None:
    manifests = render(*VALUE_SETS["custom-resources"])
    container = by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert container["image"].endswith(":dev") and container["imagePullPolicy"] == "Never"
    assert "--log-level=DEBUG" in container["args"] and "--webhook-port=10443" in container["args"]
    webhook = by_kind(manifests, "ValidatingWebhookConfiguration")[0]["webhooks"][0]
    assert webhook["failurePolicy"] == "Ignore"
    assert by_kind(manifests, "ServiceAccount")[0]["metadata"]["name"] == "headroom-op"


def test_custom_namespaces_scope_rbac_webhook_and_args(render: Renderer) -> None:
    manifests = render(*VALUE_SETS["namespaced-peering"])
    args = by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert "--peering=headroom" in args
    bound = {(rb["metadata"]["namespace"], rb["roleRef"]["name"]) for rb in by_kind(manifests, "RoleBinding")}
    assert {ns for ns, _ in bound} == {"team-a", "team-b"}
    # Cluster-wide bindings only for cluster-scoped rights (CRDs, namespaces, nodes).
    for binding in by_kind(manifests, "ClusterRoleBinding"):
        assert binding["roleRef"]["name"].endswith("-cluster"), binding["metadata"]["name"]
    selector = by_kind(manifests, "ValidatingWebhookConfiguration")[0]["webhooks"][0]["namespaceSelector"]
    assert selector["matchExpressions"][0]["values"] == ["team-a", "team-b"]
    assert {p["metadata"]["namespace"] for p in by_kind(manifests, "KopfPeering")} == {"team-a", "team-b"}


@pytest.mark.parametrize(
    "bad_value, field",
    [
        ("operator.replica=2", "replica"),  # misspelt key (replicas)
        ("webhok.enabled=false", "webhok"),  # misspelt top-level key
        ("certManager.enable=true", "enable"),  # misspelt nested key
        ("operator.logLevel=loud", "logLevel"),  # value outside the enum
        ("webhook.timeoutSeconds=60", "timeoutSeconds"),  # above the API server's 30 s limit
        ("operator.watchNamespaces={Team_A}", "watchNamespaces"),  # not a namespace name
    ],
)
def test_schema_rejects_unknown_keys_and_bad_values(helm_binary: Path, bad_value: str, field: str) -> None:
    for command in (["lint", "--strict", str(CHART_DIR)], ["template", "demo", str(CHART_DIR)]):
        result = run_helm(helm_binary, *command, "--set", bad_value)
        assert result.returncode != 0, f"helm {command[0]} accepted --set {bad_value}"
        assert field in result.stdout + result.stderr, result.stdout + result.stderr


def test_replicas_without_peering_fail_with_a_reason(helm_binary: Path) -> None:
    result = run_helm(helm_binary, "template", "demo", str(CHART_DIR), "--set", "operator.replicas=2")
    assert result.returncode != 0 and "peering" in result.stderr


def test_every_values_key_has_a_comment() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line):
            previous = next((p for p in reversed(lines[:index]) if p.strip()), "")
            if not previous.strip().startswith("#"):
                undocumented.append(line.strip())
    assert not undocumented, f"values.yaml keys without a comment above them: {undocumented}"


def _objects(schema: dict[str, Any]) -> list[dict[str, Any]]:
    found = [schema] if schema.get("type") == "object" and "properties" in schema else []
    children = list(schema.get("properties", {}).values())
    if isinstance(schema.get("items"), dict):
        children.append(schema["items"])
    for child in children:
        if isinstance(child, dict):
            found += _objects(child)
    return found


def test_schema_closes_every_object_with_known_keys() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    objects = _objects(schema)
    assert len(objects) > 10
    assert all(obj.get("additionalProperties") is False for obj in objects)
