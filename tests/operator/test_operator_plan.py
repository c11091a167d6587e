"""The real operator (kopf) against the emulator: apply -> status.plan -> children; delete cleans up."""

from __future__ import annotations

import asyncio
import time

from headroom.operator.smoke_gate import SmokeOutcome, SmokeRequest

from tests.operator.conftest import ISVC, Api, OperatorHarness
from tests.operator.resources import NAMESPACE, inference_server


def passing_smoke(request: SmokeRequest) -> SmokeOutcome:
    return SmokeOutcome(True, f"fake smoke passed at {request.url}")


async def test_apply_gets_a_plan_within_a_second(operator: OperatorHarness, emulator: tuple[object, Api]) -> None:
    _, api = emulator
    await operator.start(passing_smoke)
    started = time.monotonic()
    await api.create(ISVC, inference_server("qwen"))
    body = await api.wait_for(f"{ISVC}/qwen", lambda o: "plan" in (o.get("status") or {}), timeout=5)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0, f"status.plan appeared after {elapsed:.2f} s"
    plan = body["status"]["plan"]
    assert plan["contextLength"] == 32768
    assert plan["maxTotalTokens"] >= 32768
    assert 0 < plan["memFractionStatic"] < 1
    assert plan["ssmSlots"] >= 4
    planned = [c for c in body["status"]["conditions"] if c["type"] == "Planned"][0]
    assert planned["status"] == "True", planned
    await asyncio.sleep(0)
