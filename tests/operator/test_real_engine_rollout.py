"""Rollouts gated by the real smoke test against the real engine (`headroom serve`, tiny model, CPU).

The operator's engine URL points at a local TCP forwarder whose upstream the test switches
between a well-configured engine and one started with bad flags (a shorter context than the plan
promises), standing in for the canary Service of each revision.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from headroom.operator.smoke_gate import run_engine_smoke

from tests.operator.conftest import ISVC, Api, OperatorHarness
from tests.operator.resources import NAMESPACE, inference_server

engine_process = pytest.importorskip("tests.client.engine_process", reason="the CPU engine is not in this tree")
pytest.importorskip("headroom.engine.server.cli", reason="`headroom serve` is not in this tree")

DEPLOYMENT = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen"
GOOD_FLAGS = ["--context-length", "1024", "--max-new-tokens", "64", "--chunked-prefill-size", "64"]
# Bad flags: the engine runs a shorter context than the plan promises, so the long prefill fails.
BAD_FLAGS = ["--context-length", "512", "--max-new-tokens", "64"]
# CPU on a shared 2-core machine: generous TTFT; the retention probe runs with its default threshold against
# the sessions the revision's plan retains.
CPU_SMOKE = {"timeoutSeconds": 120, "thresholds": {"maxShortTtftSeconds": 10}}
TARGETS = {"contextLength": 1024, "maxNewTokens": 64, "maxRunningRequests": 4}


class Forwarder:
    """127.0.0.1:<port> -> upstream host:port, switchable between connections."""

    def __init__(self) -> None:
        self.upstream: tuple[str, int] = ("127.0.0.1", 1)
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def point_at(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.upstream = (host, int(port))


def _status(body: dict) -> dict:
    return body.get("status") or {}


async def _engine(flags: list[str], root: Path) -> contextlib.AbstractContextManager:
    process = engine_process.EngineProcess(flags, root / "cache", root / f"serve{len(flags)}.log")
    url = await asyncio.to_thread(process.__enter__)
    return process, url


@pytest.mark.slow
async def test_real_smoke_validates_then_bad_flags_roll_back(operator: OperatorHarness, emulator, tmp_path: Path) -> None:
    _, api = emulator
    assert isinstance(api, Api)
    forwarder = Forwarder()
    url = await forwarder.start()
    await operator.start(run_engine_smoke, engine_url=url)

    good, good_url = await _engine(GOOD_FLAGS, tmp_path)
    try:
        forwarder.point_at(good_url)
        await api.create(ISVC, inference_server("qwen", targets=TARGETS, smokeTest=CPU_SMOKE))
        await api.wait_for(DEPLOYMENT, lambda o: True)
        await api.mark_deployment_ready("qwen")
        body = await api.wait_for(f"{ISVC}/qwen", lambda o: _status(o).get("phase") in ("Ready", "Failed"), timeout=120)
        assert body["status"]["phase"] == "Ready", body["status"]
        first = body["status"]["lastGoodRevision"]
        assert body["status"]["lastSmoke"]["result"] == "Passed"
    finally:
        await asyncio.to_thread(good.__exit__, None, None, None)

    bad, bad_url = await _engine(BAD_FLAGS, tmp_path)
    try:
        forwarder.point_at(bad_url)
        await api.merge_patch(f"{ISVC}/qwen", {"spec": {"targets": {**TARGETS, "maxRunningRequests": 2}}})
        await api.wait_for(DEPLOYMENT, lambda o: o["metadata"]["annotations"]["headroom.dev/revision"] != first)
        await api.mark_deployment_ready("qwen")
        body = await api.wait_for(f"{ISVC}/qwen", lambda o: _status(o).get("failedRevision"), timeout=120)
    finally:
        await asyncio.to_thread(bad.__exit__, None, None, None)
    validated = next(c for c in body["status"]["conditions"] if c["type"] == "Validated")
    assert validated["status"] == "False" and validated["reason"] == "SmokeFailed"
    assert "long_prefill" in validated["message"], validated["message"]
    # Rollback: the Deployment runs the first revision's plan again.
    await api.wait_for(DEPLOYMENT, lambda o: o["metadata"]["annotations"]["headroom.dev/revision"] == first)
    await api.mark_deployment_ready("qwen")
    body = await api.wait_for(f"{ISVC}/qwen", lambda o: _status(o).get("phase") == "Degraded")
    assert body["status"]["lastGoodRevision"] == first
