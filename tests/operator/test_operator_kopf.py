"""The real operator (kopf) against the emulator: plan, rollout gated by a (fake) smoke test, rollback, restart, delete."""

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


def condition(body: dict, type_: str) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


DEPLOYMENT = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen"
SERVICE = f"/api/v1/namespaces/{NAMESPACE}/services/qwen"


async def rollout_to_validated(api: Api) -> str:
    """Apply, let the pod become ready, wait for the smoke test to validate; returns the revision."""
    await api.create(ISVC, inference_server("qwen"))
    body = await api.wait_for(f"{ISVC}/qwen", lambda o: (o.get("status") or {}).get("currentRevision"))
    revision = body["status"]["currentRevision"]
    assert body["status"]["phase"] in ("Deploying", "Validating")
    await api.wait_for(DEPLOYMENT, lambda o: True)
    await api.mark_deployment_ready("qwen")
    body = await api.wait_for(f"{ISVC}/qwen", lambda o: o.get("status", {}).get("phase") == "Ready")
    assert condition(body, "Validated")["status"] == "True"
    assert body["status"]["lastGoodRevision"] == revision
    return revision


async def test_passing_rollout_is_validated_and_service_follows(operator: OperatorHarness, emulator) -> None:
    _, api = emulator
    await operator.start(passing_smoke)
    revision = await rollout_to_validated(api)
    deployment = await api.get(DEPLOYMENT)
    assert deployment["metadata"]["annotations"]["headroom.dev/revision"] == revision
    assert deployment["spec"]["template"]["metadata"]["labels"]["headroom.dev/revision"] == revision
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--context-length") + 1] == "32768"
    service = await api.get(SERVICE)
    assert service["spec"]["selector"]["headroom.dev/revision"] == revision
    config_map = await api.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/qwen-plan-{revision}")
    assert "--max-total-tokens" in config_map["data"]["engine-args"]
    body = await api.get(f"{ISVC}/qwen")
    assert body["status"]["lastSmoke"]["result"] == "Passed"
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]


async def test_failed_smoke_rolls_back_to_last_good(operator: OperatorHarness, emulator) -> None:
    _, api = emulator

    def smoke_fails_for_short_context(request: SmokeRequest) -> SmokeOutcome:
        if request.context_length == 16384:
            return SmokeOutcome(False, "long_prefill: empty completion at 16000 prompt tokens")
        return SmokeOutcome(True, "ok")

    await operator.start(smoke_fails_for_short_context)
    good = await rollout_to_validated(api)
    targets = {"contextLength": 16384, "maxRunningRequests": 4, "maxNewTokens": 512}
    await api.merge_patch(f"{ISVC}/qwen", {"spec": {"targets": targets}})
    body = await api.wait_for(f"{ISVC}/qwen", lambda o: o.get("status", {}).get("currentRevision") != good)
    bad = body["status"]["currentRevision"]
    await api.wait_for(DEPLOYMENT, lambda o: o["metadata"]["annotations"]["headroom.dev/revision"] == bad)
    await api.mark_deployment_ready("qwen")
    body = await api.wait_for(f"{ISVC}/qwen", lambda o: o.get("status", {}).get("failedRevision") == bad)
    validated = condition(body, "Validated")
    assert validated["status"] == "False" and validated["reason"] == "SmokeFailed"
    assert "empty completion" in validated["message"]
    # The last good plan comes back: the Deployment is re-rendered from its revision's ConfigMap.
    deployment = await api.wait_for(DEPLOYMENT, lambda o: o["metadata"]["annotations"]["headroom.dev/revision"] == good)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--context-length") + 1] == "32768"
    await api.mark_deployment_ready("qwen")
    body = await api.wait_for(f"{ISVC}/qwen", lambda o: o.get("status", {}).get("phase") == "Degraded")
    assert condition(body, "Degraded")["reason"] == "RolledBack"
    assert condition(body, "Ready")["status"] == "True"
    assert (await api.get(SERVICE))["spec"]["selector"]["headroom.dev/revision"] == good
    events = await api.get(f"/api/v1/namespaces/{NAMESPACE}/events")
    warnings = [e for e in events["items"] if e["type"] == "Warning" and e["reason"] == "SmokeFailed"]
    assert warnings and f"rolling back to {good}" in warnings[0]["message"]


async def test_restart_mid_smoke_resumes_and_validates(operator: OperatorHarness, emulator) -> None:
    _, api = emulator
    import threading

    release = threading.Event()

    def blocked_smoke(request: SmokeRequest) -> SmokeOutcome:
        release.wait(timeout=20)
        return SmokeOutcome(False, "the first operator's smoke result must never be used")

    await operator.start(blocked_smoke)
    await api.create(ISVC, inference_server("qwen"))
    await api.wait_for(DEPLOYMENT, lambda o: True)
    await api.mark_deployment_ready("qwen")
    await api.wait_for(f"{ISVC}/qwen", lambda o: o.get("status", {}).get("phase") == "Validating")
    await operator.stop()
    # The first operator's smoke stays blocked until the second has validated: a pass of the first
    # already in its worker thread when the operator was cancelled runs to its end, and were the
    # smoke released now, that pass could still record the first result (a real result in a real
    # cluster, but this test's is a marker that must not win).
    try:
        await operator.start(passing_smoke)
        body = await api.wait_for(f"{ISVC}/qwen", lambda o: o.get("status", {}).get("phase") == "Ready")
    finally:
        release.set()
    assert condition(body, "Validated")["status"] == "True"
    assert body["status"]["lastSmoke"]["summary"].startswith("fake smoke passed")


async def test_delete_removes_children(operator: OperatorHarness, emulator) -> None:
    _, api = emulator
    await operator.start(passing_smoke)
    revision = await rollout_to_validated(api)
    children = [
        DEPLOYMENT, SERVICE, f"/api/v1/namespaces/{NAMESPACE}/services/qwen-canary",
        f"/api/v1/namespaces/{NAMESPACE}/configmaps/qwen-plan-{revision}",
    ]
    for path in children:
        assert await api.get(path) is not None, path
    await api.delete(f"{ISVC}/qwen")
    for path in [*children, f"{ISVC}/qwen"]:
        deadline = asyncio.get_running_loop().time() + 30
        while await api.get(path) is not None:
            assert asyncio.get_running_loop().time() < deadline, f"{path} still exists"
            await asyncio.sleep(0.05)
