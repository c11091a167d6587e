"""Least privilege and hardening of the rendered chart: RBAC, security contexts, webhook certificates."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from headroom.operator.admission import WEBHOOK_ID

from tests.chart.chart_tools import RELEASE_NAMESPACE, Renderer, by_kind

ALL_VARIANTS = [(), ("operator.watchNamespaces={team-a}", "operator.peering.enabled=true", "operator.replicas=2"),
                ("certManager.enabled=true",), ("operator.peering.enabled=true",), ("rbac.readApiKeySecrets=false",)]
# Verbs that write; the operator may write only its own resource, its status and its children.
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
WRITABLE = {("headroom.dev", "inferenceservers"), ("headroom.dev", "inferenceservers/status"),
            ("", "configmaps"), ("", "services"), ("apps", "deployments"), ("", "events"),
            ("kopf.dev", "clusterkopfpeerings"), ("kopf.dev", "kopfpeerings")}


def _rules(manifests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(role["metadata"]["name"], rule) for role in by_kind(manifests, "ClusterRole") + by_kind(manifests, "Role")
            for rule in role["rules"]]


@pytest.mark.parametrize("values", ALL_VARIANTS, ids=lambda v: ",".join(v) or "defaults")
def test_rbac_has_no_wildcards_and_writes_only_its_own_objects(render: Renderer, values: tuple[str, ...]) -> None:
    rules = _rules(render(*values))
    assert rules
    for role, rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(key, []), f"{role}: wildcard in {key}: {rule}"
        assert "nonResourceURLs" not in rule, f"{role}: the operator calls no non-resource URLs"
        if WRITE_VERBS & set(rule["verbs"]):
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    assert (group, resource) in WRITABLE, f"{role} may write {group}/{resource}"
    secret_verbs = {v for _, rule in rules if "" in rule["apiGroups"] and "secrets" in rule["resources"]
                    for v in rule["verbs"]}
    # Only the API-key Secret an InferenceServer names, fetched by name: never listed, watched or written.
    assert secret_verbs == ({"get"} if "rbac.readApiKeySecrets=false" not in values else set())


def test_rbac_is_split_into_framework_and_application(render: Renderer) -> None:
    names = {role["metadata"]["name"] for role in by_kind(render(), "ClusterRole")}
    assert names == {f"demo-headroom-{part}" for part in
                     ("framework", "framework-cluster", "application", "application-cluster")}
    rules = _rules(render())
    framework = {r for name, rule in rules if "framework" in name for r in rule["resources"]}
    application = {r for name, rule in rules if "application" in name for r in rule["resources"]}
    assert "customresourcedefinitions" in framework and "events" in framework
    assert {"inferenceservers", "inferenceservers/status", "deployments", "nodes"} <= application
    assert not framework & application, "a right belongs to kopf or to headroom, not both"


def test_every_role_is_bound_to_the_operator_service_account(render: Renderer) -> None:
    manifests = render("operator.watchNamespaces={team-a,team-b}")
    roles = {role["metadata"]["name"] for role in by_kind(manifests, "ClusterRole")}
    bindings = by_kind(manifests, "ClusterRoleBinding") + by_kind(manifests, "RoleBinding")
    assert {b["roleRef"]["name"] for b in bindings} == roles
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-headroom",
                                        "namespace": RELEASE_NAMESPACE}]


@pytest.mark.parametrize("values", ALL_VARIANTS, ids=lambda v: ",".join(v) or "defaults")
def test_containers_are_non_root_with_read_only_root(render: Renderer, values: tuple[str, ...]) -> None:
    for deployment in by_kind(render(*values), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        mounts: set[str] = set()
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
            mounts |= {m["mountPath"] for m in container.get("volumeMounts", [])}
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("HOME") == "/tmp", "HOME must be writable with a read-only root"
        assert "/tmp" in mounts, "a writable /tmp (emptyDir) is needed with a read-only root"


def test_webhook_points_at_the_operators_handler(render: Renderer) -> None:
    manifests = render()
    hook = by_kind(manifests, "ValidatingWebhookConfiguration")[0]["webhooks"][0]
    service = by_kind(manifests, "Service")[0]
    assert hook["clientConfig"]["service"]["path"] == f"/{WEBHOOK_ID}"
    assert hook["clientConfig"]["service"]["name"] == service["metadata"]["name"]
    assert hook["clientConfig"]["service"]["port"] == service["spec"]["ports"][0]["port"]
    container = by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    webhook_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "webhook")
    assert f"--webhook-port={webhook_port}" in container["args"]
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"


def _openssl(*args: str, stdin: bytes | None = None) -> str:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not on PATH: it is needed to check the chart's self-managed certificates")
    result = subprocess.run([openssl, *args], input=stdin, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


def test_self_managed_certificate_is_valid_for_the_service(render: Renderer, tmp_path: Path) -> None:
    manifests = render()
    secret = by_kind(manifests, "Secret")[0]
    hook = by_kind(manifests, "ValidatingWebhookConfiguration")[0]["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"], "caBundle must be the Secret's CA"
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    assert "OK" in _openssl("verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt"))
    sans = _openssl("x509", "-in", str(tmp_path / "tls.crt"), "-noout", "-ext", "subjectAltName")
    service = hook["clientConfig"]["service"]
    assert f"DNS:{service['name']}.{service['namespace']}.svc" in sans, sans
    modulus_cert = _openssl("x509", "-in", str(tmp_path / "tls.crt"), "-noout", "-modulus")
    modulus_key = _openssl("rsa", "-in", str(tmp_path / "tls.key"), "-noout", "-modulus")
    assert modulus_cert == modulus_key, "tls.key does not belong to tls.crt"


def test_cert_manager_path_injects_the_ca_and_writes_the_mounted_secret(render: Renderer) -> None:
    manifests = render("certManager.enabled=true")
    assert not by_kind(manifests, "Secret"), "cert-manager writes the Secret, the chart must not"
    certificate = by_kind(manifests, "Certificate")[0]
    hook_config = by_kind(manifests, "ValidatingWebhookConfiguration")[0]
    assert hook_config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{RELEASE_NAMESPACE}/{certificate['metadata']['name']}"
    )
    assert "caBundle" not in hook_config["webhooks"][0]["clientConfig"]
    pod = by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]
    mounted = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert mounted == {certificate["spec"]["secretName"]}
    assert by_kind(manifests, "Issuer")[0]["metadata"]["name"] == certificate["spec"]["issuerRef"]["name"]


def test_network_policies_are_off_by_default(render: Renderer) -> None:
    assert not by_kind(render(), "NetworkPolicy")


def test_engine_network_policy_admits_only_the_operator_and_the_named_clients(render: Renderer) -> None:
    manifests = render("networkPolicy.enabled=true", "operator.watchNamespaces={team-a,team-b}",
                       "networkPolicy.engineClients[0].namespaceSelector.matchLabels.team=apps")
    policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in by_kind(manifests, "NetworkPolicy")}
    assert set(policies) == {("team-a", "demo-headroom-engines"), ("team-b", "demo-headroom-engines"),
                             (RELEASE_NAMESPACE, "demo-headroom-operator")}
    engines = policies[("team-a", "demo-headroom-engines")]["spec"]
    assert engines["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "headroom-engine"}}
    assert engines["policyTypes"] == ["Ingress"] and len(engines["ingress"]) == 1
    operator_peer, client_peer = engines["ingress"][0]["from"]
    operator_pod = by_kind(manifests, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert operator_peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}}
    assert operator_peer["podSelector"]["matchLabels"].items() <= operator_pod.items()
    assert client_peer == {"namespaceSelector": {"matchLabels": {"team": "apps"}}}


def test_engine_network_policy_namespaces_default_to_the_release_namespace(render: Renderer) -> None:
    policies = by_kind(render("networkPolicy.enabled=true"), "NetworkPolicy")
    assert {p["metadata"]["namespace"] for p in policies} == {RELEASE_NAMESPACE}
    listed = by_kind(render("networkPolicy.enabled=true", "networkPolicy.engineNamespaces={ml}"), "NetworkPolicy")
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in listed} == {
        ("ml", "demo-headroom-engines"), (RELEASE_NAMESPACE, "demo-headroom-operator")}


def test_operator_network_policy_opens_only_the_webhook_and_liveness_ports(render: Renderer) -> None:
    manifests = render("networkPolicy.enabled=true", "webhook.port=10443",
                       "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/8")
    policy = next(p for p in by_kind(manifests, "NetworkPolicy") if p["metadata"]["name"].endswith("-operator"))
    ports = [(rule["ports"][0]["port"], rule.get("from")) for rule in policy["spec"]["ingress"]]
    assert ports == [(8080, None), (10443, [{"ipBlock": {"cidr": "10.0.0.0/8"}}])]
    without_webhook = render("networkPolicy.enabled=true", "webhook.enabled=false")
    policy = next(p for p in by_kind(without_webhook, "NetworkPolicy") if p["metadata"]["name"].endswith("-operator"))
    assert [rule["ports"][0]["port"] for rule in policy["spec"]["ingress"]] == [8080]
