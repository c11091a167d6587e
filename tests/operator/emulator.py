"""kmock's Kubernetes emulator, extended with what kopf and kubectl need (tests only).

Stock kmock 0.8 lacks resourceVersion, uid, generation and creationTimestamp, registers no
CRDs into discovery, and answers a failed JSON-patch `test` with HTTP 500; kopf's finalizer
patch tests /metadata/resourceVersion, so with stock kmock no handler ever runs. This subclass
stamps the metadata, registers CRDs on creation, and answers 422 where the API server would.
Lists also get kind/apiVersion, which kubectl requires.
Still absent (and unused by the operator): label selectors, PUT, protobuf, garbage collection.
"""

from __future__ import annotations

import datetime
import itertools
import uuid
from typing import Any

import attrs
import jsonpatch
import kmock
from kmock._internal import dicts
from kmock._internal.k8s import KubernetesError

CRD_RESOURCE = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")


@attrs.define(kw_only=True)
class HeadroomEmulator(kmock.KubernetesEmulator):
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

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

    async def _serve_list(self, request: kmock.Request) -> Any:
        """kubectl needs kind and apiVersion on lists, which stock kmock leaves out."""
        listing = dict(await super()._serve_list(request))
        resource = request.resource
        info = self.resources[resource] if resource in self.resources else None
        kind = info.kind if info is not None and info.kind else "List"
        group = f"{resource.group}/" if resource.group else ""
        return {"apiVersion": f"{group}{resource.version}", "kind": f"{kind}List", **listing}

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
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
        return await super()._handle(request)
