"""kmock's Kubernetes emulator, extended with what kopf and kubectl need (tests only).

Stock kmock 0.8 lacks resourceVersion, uid, generation and creationTimestamp, registers no
CRDs into discovery, and answers a failed JSON-patch `test` with HTTP 500; kopf's finalizer
patch tests /metadata/resourceVersion, so with stock kmock no handler ever runs. This subclass
stamps the metadata, registers CRDs on creation, and answers 422 where the API server would.
Lists also get kind/apiVersion, which kubectl requires. Like kube-apiserver it also renders Tables for
`kubectl get` (emulator_tables), calls validating webhooks (emulator_admission), and gives each ClusterIP
Service a clusterIP: a random loopback address, which tests' node agent listens on (kube-proxy's job).
Still absent (and unused by the operator): label selectors, PUT, protobuf, garbage collection.
"""

from __future__ import annotations

import datetime
import itertools
import random
import uuid
from typing import Any

import attrs
import jsonpatch
import kmock
from kmock._internal import dicts
from kmock._internal.k8s import KubernetesError

from tests.operator.emulator_admission import WEBHOOKS_PATH, Verdict, call_webhooks, matching_webhooks, review
from tests.operator.emulator_tables import render_table, wants_table

CRD_RESOURCE = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
SERVICE_RESOURCE = kmock.resource("", "v1", "services")
WEBHOOK_RESOURCE = kmock.resource(*WEBHOOKS_PATH)
REQUEST_LOG_SIZE = 16


@attrs.define(kw_only=True)
class HeadroomEmulator(kmock.KubernetesEmulator):
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _printer_columns: dict[Any, list[dict[str, Any]]] = attrs.field(factory=dict, init=False)
    _random: random.Random = attrs.field(factory=random.Random, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for version in spec.get("versions") or []:
            key = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[key] = kmock.ResourceInfo(
                kind=names.get("kind"),
                singular=names.get("singular"),
                shortnames=set(names.get("shortNames") or []),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                subresources=set((version.get("subresources") or {}).keys()),
            )
            self._printer_columns[key] = list(version.get("additionalPrinterColumns") or [])

    def _stamp_create(self, body: dict[str, Any]) -> None:
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._versions))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def _stamp_update(self, current: dict[str, Any], patch: Any) -> None:
        """Reject a failed `test` with 422; bump resourceVersion, and generation on spec changes."""
        try:
            patched = dicts.patch_dict(current, patch)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise KubernetesError(status=422, reason="Invalid", message=f"JSON patch failed: {exc}") from exc
        meta = current.get("metadata") or {}
        generation = int(meta.get("generation") or 1)
        if patched.get("spec") != current.get("spec"):
            generation += 1
        stamps = {"resourceVersion": str(next(self._versions)), "generation": generation}
        if isinstance(patch, dict):
            patch.setdefault("metadata", {})
            if patch["metadata"] is None:
                raise KubernetesError(status=422, reason="Invalid", message="metadata cannot be removed")
            patch["metadata"].update(stamps)
        else:
            patch.extend({"op": "add", "path": f"/metadata/{key}", "value": value} for key, value in stamps.items())

    async def _serve_version(self, request: kmock.Request) -> Any:
        """kmock 0.8 answers /api/v1 with groupVersion "/v1"; kubectl then maps no core kind (Service, ConfigMap)."""
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and str(payload.get("groupVersion", "")).startswith("/"):
            payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        return payload

    def _kind(self, resource: Any) -> str | None:
        info = self.resources[resource] if resource in self.resources else None
        return info.kind if info is not None else None

    def _table_requested(self, request: kmock.Request) -> bool:
        return wants_table(next((v for k, v in request.headers.items() if k.lower() == "accept"), ""))

    async def _serve_list(self, request: kmock.Request) -> Any:
        """kubectl needs kind and apiVersion on lists, which stock kmock leaves out."""
        listing = dict(await super()._serve_list(request))
        resource = request.resource
        if self._table_requested(request):
            return render_table(self._kind(resource), self._printer_columns.get(resource), listing["items"])
        kind = self._kind(resource) or "List"
        group = f"{resource.group}/" if resource.group else ""
        return {"apiVersion": f"{group}{resource.version}", "kind": f"{kind}List", **listing}

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = await super()._serve_fetch(request)
        if self._table_requested(request) and request.subresource is None:
            return render_table(self._kind(request.resource), self._printer_columns.get(request.resource), [obj])
        return obj

    def _assign_cluster_ip(self, service: dict[str, Any]) -> None:
        """A random loopback address, so parallel test runs on one machine rarely meet (kube-proxy retries)."""
        spec = service.setdefault("spec", {})
        if spec.get("type", "ClusterIP") == "ClusterIP" and not spec.get("clusterIP"):
            address = f"127.{self._random.randint(128, 254)}.{self._random.randint(0, 255)}.{self._random.randint(1, 254)}"
            spec["clusterIP"], spec["clusterIPs"] = address, [address]

    async def _admit(self, request: kmock.Request) -> Verdict:
        """Run the validating webhooks that match this create or update (never a subresource's)."""
        resource = request.resource
        if request.subresource is not None or not isinstance(request.data, (dict, list)):
            return Verdict(True)
        configurations = [obj.raw for key, obj in self.objects.items() if key[0] == WEBHOOK_RESOURCE and not obj.deleted]
        operation = "CREATE" if request.action == kmock.action.CREATE else "UPDATE"
        hooks = matching_webhooks(configurations, resource.group, resource.version, resource.plural, operation)
        if not hooks:
            return Verdict(True)
        old = None
        obj = request.data
        if operation == "UPDATE":
            key = (resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                return Verdict(True)
            old = dict(self.objects[key].raw)
            try:
                obj = dicts.patch_dict(old, request.data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
                return Verdict(True)
        return await call_webhooks(hooks, review(obj, old, resource.group, resource.version, resource.plural, operation))

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock logs every request (and each reaction the ones it served) and matches each new one against that whole log (a scan per request), so
        # a long run slowed down steadily (1 ms -> 500 ms a GET within a minute of node-agent polling). Only the
        # recent requests are kept; no test asserts on older ones.
        del self._requests[:-REQUEST_LOG_SIZE]
        for reaction in self._payloads:
            del reaction._requests[:-REQUEST_LOG_SIZE]
        verdict = Verdict(True)
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            verdict = await self._admit(request)
            if not verdict.allowed:
                return self._with_warnings(await self._render_error(
                    KubernetesError(status=verdict.code, reason="Forbidden" if verdict.code == 403 else "Invalid",
                                    message=verdict.message)), verdict.warnings)
        if request.resource is not None:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                if request.resource == SERVICE_RESOURCE:
                    self._assign_cluster_ip(request.data)
                self._stamp_create(request.data)
                if request.resource == CRD_RESOURCE:
                    self._register_crd(request.data)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    try:
                        self._stamp_update(dict(self.objects[key].raw), request.data)
                    except KubernetesError as exc:
                        return await self._render_error(exc)
        return self._with_warnings(await super()._handle(request), verdict.warnings)

    @staticmethod
    def _with_warnings(response: Any, warnings: list[str]) -> Any:
        """Admission warnings travel as Warning headers; kubectl prints them as `Warning: ...`."""
        for warning in warnings:
            response.headers.add("Warning", f'299 - "{warning}"')
        return response
