"""build_deployment: the engine Deployment of one revision, rendered from the plan's flags.

One Deployment per InferenceServer with strategy Recreate: on a single GPU node the new pod
cannot get the GPU while the old one holds it. The pod template carries the revision label, so
the Services decide which revision receives traffic.
"""

from __future__ import annotations

from typing import Any

from headroom.operator.api_key import api_key_args, api_key_env
from headroom.operator.labels import (
    ENGINE_CONTAINER,
    INSTANCE_LABEL,
    REVISION_LABEL,
    child_metadata,
    common_labels,
    config_map_name,
)
from headroom.operator.spec import InferenceServerSpec

MODEL_MOUNT = "/models"
PLAN_MOUNT = "/etc/headroom"
# (liveness path, readiness path): headroom's own engine is ready only after warm-up.
_PROBE_PATHS = {"builtin": ("/health", "/ready"), "sglang": ("/health", "/health"), "vllm": ("/health", "/health")}


def engine_command(spec: InferenceServerSpec, engine_args: list[str]) -> tuple[list[str], list[str]]:
    """(command, args) for the engine kind; the plan's flags come first, extraArgs last."""
    model = f"{MODEL_MOUNT}/{spec.model.path}"
    listen = ["--host", "0.0.0.0", "--port", str(spec.engine.port)]
    extra = list(spec.engine.extra_args)
    if spec.engine.kind == "sglang":
        return ["python3", "-m", "sglang.launch_server"], ["--model-path", model, *engine_args, *listen, *extra]
    if spec.engine.kind == "vllm":
        return ["vllm", "serve", model], [*engine_args, *listen, *extra]
    return ["headroom", "serve"], ["--model", model, *engine_args, *listen, *extra]


def _volumes(owner_name: str, spec: InferenceServerSpec, revision: str) -> list[dict[str, Any]]:
    if spec.model.pvc is not None:
        model_volume: dict[str, Any] = {
            "persistentVolumeClaim": {"claimName": spec.model.pvc.claim_name, "readOnly": True}
        }
    else:
        model_volume = {"hostPath": {"path": spec.model.host_path, "type": "Directory"}}
    return [
        {"name": "model", **model_volume},
        {"name": "plan", "configMap": {"name": config_map_name(owner_name, revision)}},
        # Writable scratch for compilers' caches; the root filesystem is read-only.
        {"name": "tmp", "emptyDir": {}},
        # NCCL and the engines' shared-memory IPC need more than the default 64 MiB /dev/shm.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "failureThreshold": failures}


def build_deployment(
    owner: dict[str, Any], spec: InferenceServerSpec, engine_args: list[str], revision: str, default_image: str
) -> dict[str, Any]:
    """Deployment `<server>` running `revision`; GPUs via nvidia.com/gpu, non-root, read-only root."""
    server_name = owner["metadata"]["name"]
    command, args = engine_command(spec, engine_args)
    args += api_key_args(spec)
    live_path, ready_path = _PROBE_PATHS[spec.engine.kind]
    pod_labels = {**common_labels(server_name), REVISION_LABEL: revision}
    annotations = {REVISION_LABEL: revision, "headroom.dev/plan-hash": revision}
    gpus = str(spec.gpu.count)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image or default_image,
        "command": command,
        "args": args,
        "ports": [{"name": "http", "containerPort": spec.engine.port, "protocol": "TCP"}],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
            {"name": "HEADROOM_REVISION", "value": revision},
            *api_key_env(spec),
        ],
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
        # Loading weights and warming kernels can take many minutes; the startup probe covers it.
        "startupProbe": _probe(live_path, 10, 180),
        "livenessProbe": _probe(live_path, 10, 6),
        "readinessProbe": _probe(ready_path, 5, 3),
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
            {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
        "containers": [container],
        "volumes": _volumes(server_name, spec, revision),
    }
    if spec.gpu.product:
        pod_spec["nodeSelector"] = {"nvidia.com/gpu.product": spec.gpu.product}
    metadata = child_metadata(owner, server_name)
    metadata["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {INSTANCE_LABEL: server_name, "app.kubernetes.io/name": "headroom-engine"}},
            "template": {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec},
        },
    }
