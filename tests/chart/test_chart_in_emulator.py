"""The rendered chart, applied with a real kubectl into the kmock emulator, and the operator it describes
(`headroom operator` with the Deployment's own arguments and the chart's webhook certificate) planning an
example and answering admission over TLS verified against the chart's caBundle.

No kubelet runs here: the operator is started as a local process with the container's args, the
Secret's certificate files and a kubeconfig for the emulator, which is what the pod would run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml

from tests.chart.chart_tools import RELEASE_NAMESPACE, REPO_ROOT, Renderer, by_kind
from tests.operator.conftest import Api
from tests.operator.emulator import HeadroomEmulator

EXAMPLE = REPO_ROOT / "examples" / "rtx4070-qwen3.5-4b.yaml"
NAMESPACE = "llm"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found next to {sys.executable} nor on PATH")
    return found


async def _run(*args: str, env: dict[str, str]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode or 0, output.decode()


def _operator_command(deployment: dict[str, Any], certs: Path, liveness: int, webhook: int) -> list[str]:
    """The container's args, with the pod's mount paths and ports moved to this machine."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = []
    for arg in container["args"]:
        if arg.startswith("--liveness="):
            arg = f"--liveness=http://127.0.0.1:{liveness}/healthz"
        elif arg.startswith("--webhook-port="):
            arg = f"--webhook-port={webhook}"
        elif arg.startswith(("--webhook-cert=", "--webhook-key=")):
            flag, path = arg.split("=", 1)
            arg = f"{flag}={certs / Path(path).name}"
        args.append(arg)
    return [_tool("headroom"), *args]


async def _wait_http(session: aiohttp.ClientSession, url: str, process: asyncio.subprocess.Process) -> None:
    for _ in range(200):
        if process.returncode is not None:
            raise AssertionError(f"operator exited with {process.returncode}")
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never answered")


async def test_chart_applies_and_its_operator_plans_an_example(render: Renderer, tmp_path: Path) -> None:
    manifests = render()
    (tmp_path / "chart.yaml").write_text(yaml.safe_dump_all(manifests))
    secret = by_kind(manifests, "Secret")[0]
    certs = tmp_path / "webhook-tls"
    certs.mkdir()
    for key, value in secret["data"].items():
        (certs / key).write_bytes(base64.b64decode(value))
    hook = by_kind(manifests, "ValidatingWebhookConfiguration")[0]["webhooks"][0]

    async with HeadroomEmulator() as handler, kmock.Server(handler) as server:
        api = Api(server)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": api.url}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "nobody"}}],
            "users": [{"name": "nobody", "user": {}}],
        }))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}
        kubectl = _tool("kubectl")
        # No /openapi in the emulator, so client-side schema validation is off (kubernetes-validate did it).
        code, output = await _run(kubectl, "apply", "--validate=false", "-f", str(tmp_path / "chart.yaml"), env=env)
        assert code == 0, output
        assert output.count("created") == len(manifests), output
        deployment = await api.get(f"/apis/apps/v1/namespaces/{RELEASE_NAMESPACE}/deployments/demo-headroom")
        assert deployment is not None

        liveness, webhook = _free_port(), _free_port()
        process = await asyncio.create_subprocess_exec(
            *_operator_command(deployment, certs, liveness, webhook), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with aiohttp.ClientSession() as session:
                await _wait_http(session, f"http://127.0.0.1:{liveness}/healthz", process)
                code, output = await _run(kubectl, "apply", "--validate=false", "-n", NAMESPACE, "-f", str(EXAMPLE), env=env)
                assert code == 0, output
                body = await api.wait_for(
                    f"/apis/headroom.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservers/qwen35-4b-rtx4070",
                    lambda o: "plan" in (o.get("status") or {}), timeout=20,
                )
                assert body["status"]["plan"]["contextLength"] == 32768
                await api.wait_for(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen35-4b-rtx4070", lambda o: True)
                await _check_admission_over_tls(session, hook, certs, webhook)
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), timeout=20)
                except asyncio.TimeoutError:
                    # kopf's graceful stop can outlast 20 s on a loaded 2-core runner (as the kubelet's
                    # grace period would, it ends in a kill); the assertions above are the test.
                    process.kill()
                    await process.wait()


async def _check_admission_over_tls(
    session: aiohttp.ClientSession, hook: dict[str, Any], certs: Path, port: int
) -> None:
    """An AdmissionReview, as the API server sends it: TLS checked against caBundle for the Service's DNS name."""
    context = ssl.create_default_context(cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode())
    service = hook["clientConfig"]["service"]
    server_name = f"{service['name']}.{service['namespace']}.svc"
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    server = next(d for d in docs if d["kind"] == "InferenceServer")
    infeasible = json.loads(json.dumps(server))
    # Within the model's window, but its bf16 KV (32 KiB/token) cannot fit beside 8 GB of weights in 12 GB.
    infeasible["spec"]["targets"]["contextLength"] = 200_000
    for obj, allowed in ((server, True), (infeasible, False)):
        obj["metadata"]["namespace"] = NAMESPACE
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "0000", "kind": {"group": "headroom.dev", "version": "v1alpha1", "kind": "InferenceServer"},
            "resource": {"group": "headroom.dev", "version": "v1alpha1", "resource": "inferenceservers"},
            "namespace": NAMESPACE, "name": obj["metadata"]["name"], "operation": "CREATE", "object": obj,
            "userInfo": {"username": "test"}, "dryRun": False,
        }}
        url = f"https://127.0.0.1:{port}{service['path']}"
        async with session.post(url, json=review, ssl=context, server_hostname=server_name) as response:
            answer = await response.json()
        assert answer["response"]["allowed"] is allowed, answer
        if not allowed:
            assert "binding constraint" in answer["response"]["status"]["message"], answer
