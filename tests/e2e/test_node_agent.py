"""The node agent against the emulator, with a stand-in container: rendered args run, probes drive status,
Recreate on a template change, Services follow their selectors, delete stops the process."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest

from tests.e2e.cluster import LocalCluster
from tests.e2e.containers import localize_listen, localize_path
from tests.e2e.node_agent import NodeAgent
from tests.operator.emulator import HeadroomEmulator

FAKE = Path(__file__).with_name("fake_container.py")
NS = "default"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/fake"


def test_paths_under_a_mount_are_rewritten_and_others_kept() -> None:
    mounts = {"/models": Path("/data/m"), "/etc/headroom": Path("/data/plan"), "/tmp": Path("/data/tmp")}
    assert localize_path("/models/qwen", mounts) == "/data/m/qwen"
    assert localize_path("--plan=/etc/headroom/plan.json", mounts) == "--plan=/data/plan/plan.json"
    assert localize_path("/modelsX/qwen", mounts) == "/modelsX/qwen"
    assert localize_path("/tmp", mounts) == "/data/tmp"
    assert localize_path("relative/models", mounts) == "relative/models"


def test_listen_flags_move_to_loopback_and_the_free_port() -> None:
    args = ["--host", "0.0.0.0", "--port", "8000", "--max-total-tokens", "8000", "--port=9000"]
    assert localize_listen(args, {8000: 41000}) == [
        "--host", "127.0.0.1", "--port", "41000", "--max-total-tokens", "8000", "--port=9000"]


class Cluster(LocalCluster):
    """The emulator and the node agent only: no operator, the test writes the objects itself."""

    def __enter__(self) -> Cluster:
        self._thread.start()
        self._call(self._start_async())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._stack.aclose(), timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def deployment(colour: str) -> dict[str, Any]:
    container = {
        "name": "app", "command": [Path(sys.executable).name, str(FAKE)],
        "args": ["--host", "0.0.0.0", "--port", "9000", "--data", "/etc/fake/greeting"],
        "ports": [{"name": "http", "containerPort": 9000}],
        "env": [{"name": "FAKE_COLOUR", "value": colour}, {"name": "HOME", "value": "/scratch"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3},
        "volumeMounts": [{"name": "cfg", "mountPath": "/etc/fake"}, {"name": "tmp", "mountPath": "/scratch"}],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "fake", "namespace": NS},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": {"app": "fake"}},
                     "template": {"metadata": {"labels": {"app": "fake"}},
                                  "spec": {"containers": [container], "volumes": [
                                      {"name": "cfg", "configMap": {"name": "fake-cfg"}}, {"name": "tmp", "emptyDir": {}}]}}}}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path, {}, namespace=NS) as local:
        yield local


def call(cluster: Cluster, method: str, path: str, body: Any = None, merge: bool = False) -> Any:
    headers = {"Content-Type": "application/merge-patch+json"} if merge else {}
    rsp = httpx.request(method, cluster.url + path, json=body, headers=headers, trust_env=False, timeout=30)
    assert rsp.status_code < 300, rsp.text
    return rsp.json()


def through_service(url: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return dict(httpx.get(url, timeout=5, trust_env=False).json())
        except httpx.HTTPError:
            assert time.monotonic() < deadline, f"nothing answered at {url}"
            time.sleep(0.1)


def test_deployment_runs_probes_recreates_and_stops(cluster: Cluster) -> None:
    call(cluster, "POST", f"/api/v1/namespaces/{NS}/configmaps",
         {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fake-cfg", "namespace": NS},
          "data": {"greeting": "hello from a ConfigMap"}})
    service = call(cluster, "POST", f"/api/v1/namespaces/{NS}/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "fake", "namespace": NS},
        "spec": {"selector": {"app": "fake"}, "ports": [{"port": 80, "targetPort": "http"}]}})
    url = f"http://{service['spec']['clusterIP']}:80/"
    assert service["spec"]["clusterIP"].startswith("127.")
    call(cluster, "POST", f"/apis/apps/v1/namespaces/{NS}/deployments", deployment("red"))

    # The pod is reported at once and ready once its readiness probe passes (after --ready-after).
    cluster.wait_for(DEPLOYMENT, lambda o: (o.get("status") or {}).get("replicas") == 1, timeout=30)
    status = cluster.wait_for(DEPLOYMENT, lambda o: o["status"].get("readyReplicas") == 1, timeout=30)["status"]
    assert status["observedGeneration"] == 1 and status["updatedReplicas"] == 1
    first = through_service(url)
    assert first["colour"] == "red" and first["data"] == "hello from a ConfigMap"
    pod = cluster.agent.pods[(NS, "fake")]
    local_port = pod.command.ports["http"]
    assert first["argv"] == ["--host", "127.0.0.1", "--port", str(local_port), "--data",
                             str(cluster.root / "node" / NS / pod.name / "volumes" / "cfg" / "greeting")]
    pods = call(cluster, "GET", f"/api/v1/namespaces/{NS}/pods")["items"]
    assert [p["metadata"]["name"] for p in pods] == [pod.name]

    # A template change: the old process ends before the new one starts, and the Service follows.
    call(cluster, "PATCH", DEPLOYMENT, {"spec": {"template": deployment("blue")["spec"]["template"]}}, merge=True)
    cluster.wait_for(DEPLOYMENT, lambda o: o["status"].get("observedGeneration") == 2
                     and o["status"].get("readyReplicas") == 1, timeout=30)
    second = through_service(url)
    assert second["colour"] == "blue" and second["pid"] != first["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(first["pid"], 0)

    call(cluster, "DELETE", DEPLOYMENT)
    cluster.wait_for(f"/api/v1/namespaces/{NS}/pods", lambda o: not o["items"], timeout=30)
    with pytest.raises(ProcessLookupError):
        os.kill(second["pid"], 0)
    # No ready pod behind the Service: the connection is dropped.
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=5, trust_env=False)


async def test_a_missing_claim_is_reported_not_started(tmp_path: Path) -> None:
    async with HeadroomEmulator() as handler, kmock.Server(handler) as server:
        agent = NodeAgent(str(server.url), tmp_path, claims={})
        body = deployment("red")
        body["spec"]["template"]["spec"]["volumes"][0] = {"name": "cfg", "persistentVolumeClaim": {"claimName": "models"}}
        await agent.api.post(f"/apis/apps/v1/namespaces/{NS}/deployments", json=body)
        await agent.sync_once()
        assert agent.pods == {}
        assert "PersistentVolumeClaim 'models' is not bound" in agent.errors[(NS, "fake")]
        status = (await agent.api.get(DEPLOYMENT)).json()["status"]
        assert status["readyReplicas"] == 0 and "models" in status["conditions"][1]["message"]
        await agent.close()
