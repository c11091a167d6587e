"""A one-node kubelet, Deployment controller and kube-proxy for the emulator (tests and `make demo` only).

It talks to the API over HTTP like the real ones, and every `poll_s` seconds:
- runs one pod per Deployment (replicas 0 runs none) as a local process built from the pod template
  (tests/e2e/containers.py), with the template's probes (pod_process.py);
- Recreate: when the template changes, the old pod is stopped before the new one starts; a deleted
  Deployment's pod is stopped;
- writes the Deployment's status (observedGeneration, replicas, updatedReplicas, readyReplicas,
  availableReplicas, Available/Progressing conditions) and a Pod object per pod, for `kubectl get pods`;
- listens on each Service's clusterIP:port and forwards to the ready pods its selector picks.
Volumes: persistentVolumeClaim -> the folder `claims` binds it to, hostPath -> under `host_root`,
configMap -> its keys written as files, emptyDir -> a fresh folder per pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import uuid
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.containers import local_command
from tests.e2e.pod_process import PodProcess
from tests.e2e.service_proxy import ServiceProxy

log = logging.getLogger("node-agent")
MERGE = {"Content-Type": "application/merge-patch+json"}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class NodeAgent:
    def __init__(self, api_url: str, root: Path, claims: dict[str, Path], host_root: Path | None = None,
                 poll_s: float = 0.2):
        self.api = httpx.AsyncClient(base_url=api_url.rstrip("/"), trust_env=False, timeout=30)
        self.root, self.claims, self.host_root, self.poll_s = root, claims, host_root or root / "host", poll_s
        self.pods: dict[tuple[str, str], PodProcess] = {}
        self.proxies: dict[tuple[str, int], ServiceProxy] = {}
        self.errors: dict[tuple[str, str], str] = {}
        self._pod_status: dict[str, dict[str, Any]] = {}

    async def run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except (httpx.HTTPError, OSError) as exc:
                log.warning(f"node agent pass failed: {exc}")
            await asyncio.sleep(self.poll_s)

    async def sync_once(self) -> None:
        deployments = (await self.api.get("/apis/apps/v1/deployments")).json().get("items", [])
        seen = set()
        for deployment in deployments:
            key = (deployment["metadata"]["namespace"], deployment["metadata"]["name"])
            seen.add(key)
            await self._sync_deployment(key, deployment)
        for key in [k for k in self.pods if k not in seen]:
            await self._stop_pod(key)
        await self._sync_services((await self.api.get("/api/v1/services")).json().get("items", []))

    async def _sync_deployment(self, key: tuple[str, str], deployment: dict[str, Any]) -> None:
        template = deployment["spec"]["template"]
        wanted = int(deployment["spec"].get("replicas", 1)) > 0
        current = template_hash(template)
        pod = self.pods.get(key)
        if pod is not None and (pod.template_hash != current or not wanted):
            await self._stop_pod(key)
            pod = None
        if pod is None and wanted:
            try:
                pod = await self._start_pod(key, template, current)
                self.errors.pop(key, None)
            except (ValueError, KeyError, LookupError) as exc:
                self.errors[key] = str(exc)
                log.warning(f"pod of {key[0]}/{key[1]} cannot start: {exc}")
        await self._write_status(key, deployment, pod)

    async def _volumes(self, namespace: str, pod_dir: Path, pod_spec: dict[str, Any]) -> dict[str, Path]:
        """volume name -> local folder, populated as the kubelet would."""
        folders: dict[str, Path] = {}
        for volume in pod_spec.get("volumes") or []:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if claim not in self.claims:
                    raise LookupError(f"PersistentVolumeClaim {claim!r} is not bound on this node (known: {sorted(self.claims)})")
                folders[name] = self.claims[claim]
            elif "hostPath" in volume:
                folders[name] = self.host_root / volume["hostPath"]["path"].lstrip("/")
            elif "configMap" in volume:
                cm_name = volume["configMap"]["name"]
                rsp = await self.api.get(f"/api/v1/namespaces/{namespace}/configmaps/{cm_name}")
                if rsp.status_code != 200:
                    raise LookupError(f"ConfigMap {namespace}/{cm_name} of volume {name!r} is missing")
                folders[name] = pod_dir / "volumes" / name
                folders[name].mkdir(parents=True, exist_ok=True)
                for file_name, text in (rsp.json().get("data") or {}).items():
                    (folders[name] / file_name).write_text(text)
            else:
                folders[name] = pod_dir / "volumes" / name
                folders[name].mkdir(parents=True, exist_ok=True)
        return folders

    async def _start_pod(self, key: tuple[str, str], template: dict[str, Any], current: str) -> PodProcess:
        namespace, name = key
        pod_name = f"{name}-{current}-{uuid.uuid4().hex[:5]}"
        pod_dir = self.root / namespace / pod_name
        pod_dir.mkdir(parents=True)
        pod_spec = template["spec"]
        folders = await self._volumes(namespace, pod_dir, pod_spec)
        if len(pod_spec["containers"]) != 1:
            raise ValueError(f"the node agent runs one container a pod, got {len(pod_spec['containers'])}")
        (container,) = pod_spec["containers"]
        mounts = {m["mountPath"]: folders[m["name"]] for m in container.get("volumeMounts") or []}
        command = local_command(container, mounts, free_ports(len(container.get("ports") or [])))
        labels = {**(template.get("metadata") or {}).get("labels", {}), "pod-template-hash": current}
        pod = PodProcess(pod_name, labels, current, command, container, pod_dir / "container.log")
        pod.start()
        self.pods[key] = pod
        log.info(f"started pod {namespace}/{pod_name}: {' '.join(command.argv)}")
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "namespace": namespace,
                "labels": labels}, "spec": {"containers": [container], "nodeName": "local"},
                "status": {"phase": "Pending"}}
        await self.api.post(f"/api/v1/namespaces/{namespace}/pods", json=body)
        return pod

    async def _stop_pod(self, key: tuple[str, str]) -> None:
        pod = self.pods.pop(key)
        self._pod_status.pop(pod.name, None)
        await pod.stop()
        with contextlib.suppress(httpx.HTTPError):
            await self.api.delete(f"/api/v1/namespaces/{key[0]}/pods/{pod.name}")
        log.info(f"stopped pod {key[0]}/{pod.name}")

    async def _write_status(self, key: tuple[str, str], deployment: dict[str, Any], pod: PodProcess | None) -> None:
        ready = int(pod is not None and pod.ready)
        running = int(pod is not None)
        waiting = self.errors.get(key) or (pod.last_exit if pod is not None and pod.last_exit else "")
        status = {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            "replicas": running, "updatedReplicas": running, "readyReplicas": ready, "availableReplicas": ready,
            "conditions": [
                {"type": "Available", "status": "True" if ready else "False",
                 "reason": "MinimumReplicasAvailable" if ready else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable" if ready else "ReplicaSetUpdated",
                 "message": waiting},
            ],
        }
        namespace, name = key
        if (deployment.get("status") or {}) != status:
            await self.api.patch(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/status",
                                 json={"status": status}, headers=MERGE)
        if pod is not None:
            phase = "Running" if pod.process is not None and pod.process.returncode is None else "Pending"
            pod_status = {"phase": phase, "podIP": "127.0.0.1", "containerStatuses": [
                {"name": pod.container["name"], "ready": pod.ready, "restartCount": pod.restarts}]}
            if pod_status != self._pod_status.get(pod.name):
                await self.api.patch(f"/api/v1/namespaces/{namespace}/pods/{pod.name}/status",
                                     json={"status": pod_status}, headers=MERGE)
                self._pod_status[pod.name] = pod_status

    def endpoints(self, selector: dict[str, str], target_port: str) -> list[int]:
        return [pod.command.ports[target_port] for pod in self.pods.values()
                if pod.ready and selects(selector, pod.labels) and target_port in pod.command.ports]

    async def _sync_services(self, services: list[dict[str, Any]]) -> None:
        wanted: set[tuple[str, int]] = set()
        for service in services:
            spec = service.get("spec") or {}
            address = spec.get("clusterIP")
            if not address or address == "None":
                continue
            for port in spec.get("ports") or []:
                key = (address, int(port["port"]))
                wanted.add(key)
                if key not in self.proxies:
                    proxy = ServiceProxy(address, key[1], self.endpoints)
                    try:
                        await proxy.start()
                    except OSError as exc:
                        log.warning(f"cannot listen on {address}:{key[1]} for Service {service['metadata']['name']}: {exc}")
                        continue
                    self.proxies[key] = proxy
                self.proxies[key].route(spec.get("selector") or {}, str(port.get("targetPort", port["port"])))
        for key in [k for k in self.proxies if k not in wanted]:
            await self.proxies.pop(key).close()

    async def close(self) -> None:
        for key in list(self.pods):
            await self._stop_pod(key)
        for proxy in self.proxies.values():
            await proxy.close()
        self.proxies.clear()
        await self.api.aclose()
