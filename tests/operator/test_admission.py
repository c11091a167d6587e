"""The validating webhook, served by the real operator: AdmissionReviews over HTTP, as the API server sends them."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import aiohttp
from headroom.operator.smoke_gate import SmokeOutcome, SmokeRequest

from tests.operator.conftest import Api, OperatorHarness
from tests.operator.resources import NAMESPACE, inference_server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def admission_review(obj: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "headroom.dev", "version": "v1alpha1", "kind": "InferenceServer"},
            "resource": {"group": "headroom.dev", "version": "v1alpha1", "resource": "inferenceservers"},
            "namespace": NAMESPACE,
            "name": obj["metadata"]["name"],
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
        },
    }


def never_smoke(request: SmokeRequest) -> SmokeOutcome:
    raise AssertionError("admission tests never reach a smoke test")


async def _review(port: int, obj: dict[str, Any]) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/validate_inferenceserver"
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.post(url, json=admission_review(obj)) as rsp:
                    assert rsp.status == 200, await rsp.text()
                    return dict((await rsp.json())["response"])
            except aiohttp.ClientConnectorError:
                import asyncio

                await asyncio.sleep(0.05)
    raise AssertionError(f"webhook at {url} never answered")


async def test_infeasible_spec_is_refused_with_the_planners_message(operator: OperatorHarness, emulator) -> None:
    port = _free_port()
    await operator.start(never_smoke, webhook_port=port)
    # 8 GiB cannot even hold this model's ~8.4 GB of bf16 weights.
    too_small = inference_server("tiny-gpu", gpu={"count": 1, "memory": "8Gi"})
    response = await _review(port, too_small)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "no feasible plan" in message and "binding constraint" in message, message
    assert response["status"]["code"] == 422


async def test_feasible_spec_is_admitted_with_the_plan_as_a_warning(operator: OperatorHarness, emulator) -> None:
    port = _free_port()
    await operator.start(never_smoke, webhook_port=port)
    response = await _review(port, inference_server("qwen"))
    assert response["allowed"] is True
    assert any("context 32768" in w for w in response.get("warnings", [])), response


async def test_spec_errors_name_the_field(operator: OperatorHarness, emulator) -> None:
    port = _free_port()
    await operator.start(never_smoke, webhook_port=port)
    bad = inference_server("bad", targets={"retainedSessions": 3})
    response = await _review(port, bad)
    assert response["allowed"] is False
    assert "sessionTokens" in response["status"]["message"]


async def test_missing_gpu_memory_without_discovery_labels_is_refused(operator: OperatorHarness, emulator) -> None:
    _, api = emulator
    assert isinstance(api, Api)
    port = _free_port()
    await operator.start(never_smoke, webhook_port=port)
    response = await _review(port, inference_server("nomem", gpu={"count": 1}))
    assert response["allowed"] is False
    assert "spec.gpu.memory is absent" in response["status"]["message"]
    # Once a node carries GPU feature discovery labels, the same spec plans from them.
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-0", "labels": {
        "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8"}}}
    await api.create("/api/v1/nodes", node)
    response = await _review(port, inference_server("nomem", gpu={"count": 1}))
    assert response["allowed"] is True, response


async def test_extra_args_that_override_planned_flags_are_admitted_with_a_warning(operator: OperatorHarness, emulator) -> None:
    port = _free_port()
    await operator.start(never_smoke, webhook_port=port)
    spec_engine = {"kind": "builtin", "extraArgs": ["--context-length=512", "--log-rejections"]}
    response = await _review(port, inference_server("qwen", engine=spec_engine))
    assert response["allowed"] is True
    warning = next(w for w in response["warnings"] if "extraArgs" in w)
    assert "['--context-length']" in warning, warning


async def test_an_engine_release_without_a_profile_and_int_kv_on_stock_sglang_are_refused(
    operator: OperatorHarness, emulator
) -> None:
    port = _free_port()
    await operator.start(never_smoke, webhook_port=port)
    old = inference_server("old", engine={"kind": "sglang", "image": "lmsysorg/sglang:v0.5.5-cu129"})
    response = await _review(port, old)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "no engine profile for sglang 0.5.5" in message and "sglang 0.5.23" in message, message
    stock_int = inference_server(
        "int", engine={"kind": "sglang", "image": "lmsysorg/sglang:v0.5.23"}, kvCache={"dtype": "int4"}
    )
    response = await _review(port, stock_int)
    assert response["allowed"] is False
    assert "no int4 KV cache" in response["status"]["message"] and "int-kv" in response["status"]["message"]
