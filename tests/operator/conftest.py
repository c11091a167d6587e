"""Fixtures: the extended kmock emulator on a local port, the CRD installed, and the real operator.

The operator runs in-process (kopf.operator in a task of the test's event loop). Its sync handlers
run in kopf's threads and reach the emulator over HTTP, like in a cluster; the test side talks to
the emulator through aiohttp so that the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml
from headroom.operator.context import MEMO_KEY, OperatorContext, OperatorSettings, WebhookOptions
from headroom.operator.kube import KubeClient
from headroom.operator.registry import build_registry
from headroom.operator.smoke_gate import SmokeFn, SmokeRunner

from tests.operator.emulator import HeadroomEmulator
from tests.operator.resources import NAMESPACE

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferenceservers.headroom.dev.yaml"
ISVC = f"/apis/headroom.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservers"


class Api:
    """The test's own client for the emulator (async, so the loop keeps serving the operator)."""

    def __init__(self, server: kmock.Server):
        self.session = server.client
        self.url = str(server.url).rstrip("/")

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        async with self.session.request(method, path, json=body, headers={"Content-Type": content_type}) as rsp:
            data = await rsp.json(content_type=None)
            if rsp.status >= 300:
                raise AssertionError(f"{method} {path} -> {rsp.status}: {data}")
            return data

    async def get(self, path: str) -> dict[str, Any] | None:
        async with self.session.get(path) as rsp:
            return None if rsp.status == 404 else await rsp.json(content_type=None)

    async def create(self, path: str, body: dict[str, Any]) -> Any:
        return await self.call("POST", path, body)

    async def merge_patch(self, path: str, body: dict[str, Any]) -> Any:
        return await self.call("PATCH", path, body, "application/merge-patch+json")

    async def delete(self, path: str) -> Any:
        return await self.call("DELETE", path)

    async def wait_for(
        self, path: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30.0
    ) -> dict[str, Any]:
        """Poll until predicate(object) holds; fail with the last object seen."""
        last: dict[str, Any] | None = None
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            last = await self.get(path)
            if last is not None and predicate(last):
                return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting on {path}; last seen: {last}")

    async def mark_deployment_ready(self, name: str) -> None:
        """No kubelet here: report the latest template's pod as ready, as the controller would."""
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"
        deployment = await self.get(path)
        assert deployment is not None, f"Deployment {name} does not exist"
        generation = deployment["metadata"]["generation"]
        status = {"observedGeneration": generation, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
        await self.merge_patch(path + "/status", {"status": status})


@pytest.fixture
async def emulator() -> AsyncIterator[tuple[HeadroomEmulator, Api]]:
    async with HeadroomEmulator() as handler, kmock.Server(handler) as server:
        api = Api(server)
        await api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(CRD_PATH.read_text()))
        yield handler, api


class OperatorHarness:
    """Start and stop the real operator against the emulator, as often as a test needs."""

    def __init__(self, api: Api):
        self.api = api
        self._task: asyncio.Task[Any] | None = None
        self._stop: asyncio.Future[Any] | None = None

    async def start(
        self, smoke_fn: SmokeFn, *, engine_url: str = "http://127.0.0.1:1", webhook_port: int | None = None
    ) -> OperatorContext:
        url = self.api.url

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True)

        webhook = WebhookOptions(port=webhook_port, addr="127.0.0.1", host="127.0.0.1", insecure=True) if webhook_port else None
        ctx = OperatorContext(
            kube=KubeClient.from_url(url),
            settings=OperatorSettings(engine_image="headroom:test", engine_url_template=engine_url, tick_seconds=0.1),
            smoke=SmokeRunner(smoke_fn),
            webhook=webhook,
        )
        self._stop = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(kopf.operator(
            registry=build_registry(with_admission=webhook is not None, login=login),
            memo=kopf.Memo({MEMO_KEY: ctx}),
            standalone=True,
            # kmock cannot serve Namespace objects, which kopf lists for namespace-scoped runs.
            clusterwide=True,
            stop_flag=self._stop,
        ))
        return ctx

    async def stop(self) -> None:
        if self._task is None or self._stop is None:
            return
        # Cancel rather than set the stop flag: kopf would give every task created after its start
        # (the emulator's open watch streams included) 5 s to finish. A cancel is also closer to a crash.
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, timeout=15)
        self._task = None


@pytest.fixture
async def operator(emulator: tuple[HeadroomEmulator, Api]) -> AsyncIterator[OperatorHarness]:
    harness = OperatorHarness(emulator[1])
    yield harness
    await harness.stop()
