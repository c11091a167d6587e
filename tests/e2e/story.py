"""The user's path on one machine, in steps the end-to-end tests and `make demo` share.

The example is examples/cpu-tiny-hybrid.yaml: the embedded tiny model, bound to a local folder as the
PVC `models`. A user's views are kubectl's; a client reaches the engine at the Service's clusterIP.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.e2e.cluster import REPO, LocalCluster

EXAMPLE = REPO / "examples" / "cpu-tiny-hybrid.yaml"
NAME = "tiny"
MODEL_FOLDER = "headroom-tiny-hybrid"


def models_folder(root: Path) -> Path:
    """The folder the PVC `models` is bound to, holding the embedded model (generated on first use)."""
    from headroom.engine.default_model import ensure_default_model

    ensure_default_model(root / MODEL_FOLDER)
    return root


def example_docs() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(EXAMPLE.read_text()) if doc]


def server_path(cluster: LocalCluster, name: str = NAME) -> str:
    return f"/apis/headroom.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservers/{name}"


def child_path(cluster: LocalCluster, kind: str, name: str) -> str:
    group = "/apis/apps/v1" if kind == "deployments" else "/api/v1"
    return f"{group}/namespaces/{cluster.namespace}/{kind}/{name}"


def status(body: dict[str, Any]) -> dict[str, Any]:
    return body.get("status") or {}


def condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status(body).get("conditions") or [] if c["type"] == kind), {})


def table(text: str) -> list[dict[str, str]]:
    """kubectl's table output as rows of {header: cell}; cells are separated by 2+ spaces."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    headers = re.split(r"\s{2,}", lines[0].strip())
    return [dict(zip(headers, re.split(r"\s{2,}", line.strip()), strict=False)) for line in lines[1:]]


def service_url(cluster: LocalCluster, service: str = NAME) -> str:
    """http://<clusterIP>:<port> of a Service, read with kubectl as a user would."""
    out = cluster.kubectl("get", "service", service, "-o", "jsonpath={.spec.clusterIP}:{.spec.ports[0].port}").stdout
    return f"http://{out.strip()}"


def _settled(send: Callable[[], httpx.Response], retry_on: type[Exception], settle_s: float) -> httpx.Response:
    """send(), retried on retry_on for up to settle_s. A Service the operator has just created (or whose selector
    it has just moved to another revision) is routed by the node agent, as by kube-proxy, on its next sync: until
    then its clusterIP refuses connections, or resets them for want of a ready endpoint. An HTTP error status is
    an answer and is not retried."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            rsp = send()
            break
        except retry_on:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)
    rsp.raise_for_status()
    return rsp


def complete(url: str, prompt: str, max_tokens: int = 8, settle_s: float = 15.0) -> dict[str, Any]:
    """One /v1/completions answer through the Service; raises on any HTTP error. Only a refused connection is
    retried (nothing was sent; a reset one might have been answered), seen once on a clean clone right after the
    Service was created."""
    body = {"model": MODEL_FOLDER, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return dict(_settled(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60, trust_env=False),
                         httpx.ConnectError, settle_s).json())


def served_plan(url: str, settle_s: float = 15.0) -> dict[str, Any]:
    """The plan the engine behind `url` runs (its /plan endpoint); refused or reset connections are retried (a
    reset seen once in four clean-clone runs right after a rollback)."""
    return dict(_settled(lambda: httpx.get(f"{url}/plan", timeout=30, trust_env=False), httpx.TransportError,
                         settle_s).json())


def shorter_context_args(spec: dict[str, Any], context_length: int) -> list[str]:
    """engine.extraArgs that run the engine of `spec` (a raw spec) at a shorter context than its plan promises.

    The SSM slots follow from the context, and `headroom serve` refuses --ssm-slots that disagree with its
    own re-plan, so the matching slot count (from the planner) goes with it: the engine starts, turns
    ready, and answers the plan's long prefill with HTTP 400, which the smoke test must catch.
    """
    from headroom.engine.plan import parse_size
    from headroom.operator.planning import plan_revision
    from headroom.operator.spec import parse_spec

    geometry, _ = example_docs()
    raw = json.loads(json.dumps(spec))
    raw.setdefault("overrides", {})["contextLength"] = context_length
    raw.setdefault("targets", {})["contextLength"] = context_length
    parsed = parse_spec(raw)
    planned = plan_revision(parsed, json.loads(geometry["data"]["config.json"]), parse_size(parsed.gpu.memory or ""))
    return ["--context-length", str(context_length), "--ssm-slots", str(planned.plan.ssm_slots)]
