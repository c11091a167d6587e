"""The user's whole path on one machine, with a real kubectl, the real `headroom operator` and real engines.

`kubectl apply -f examples/cpu-tiny-hybrid.yaml` -> admission runs the planner -> status.plan within a
second -> Deployment -> the node agent runs the rendered `headroom serve` command -> the container's
readiness probe -> the real smoke test with default thresholds -> Validated=True -> a completion through
the Service. Then a spec change rolls and is promoted while the operator is killed mid smoke test; an
engine that fails the smoke test is rolled back; an infeasible spec is refused; delete removes all.

The stages share one cluster and run in file order: each starts from the state the previous one left,
as a user's session does (an engine start costs seconds on a CPU, so they are not repeated).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import LocalCluster
from tests.e2e.pod_process import PodProcess
from tests.e2e.story import (
    EXAMPLE,
    MODEL_FOLDER,
    NAME,
    child_path,
    complete,
    condition,
    example_docs,
    models_folder,
    served_plan,
    server_path,
    service_url,
    shorter_context_args,
    status,
    table,
)

pytestmark = pytest.mark.slow
PLAN_KEYS = ("context_length", "max_total_tokens", "chunked_prefill_size", "max_running_requests", "ssm_slots",
             "max_new_tokens", "kv_dtype", "mem_fraction_static")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("cluster")
    with LocalCluster(root, {"models": models_folder(root / "models")}) as local:
        yield local


@pytest.fixture(scope="module")
def seen() -> dict[str, str]:
    """Revisions the stages hand on to the next ones."""
    return {}


def columns(cluster: LocalCluster) -> dict[str, str]:
    (row,) = table(cluster.kubectl("get", "inferenceservers", NAME).stdout)
    return row


def wait_pod(cluster: LocalCluster, predicate=lambda pod: True, timeout: float = 60) -> PodProcess:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = cluster.agent.pods.get((cluster.namespace, NAME))
        if pod is not None and pod.process is not None and predicate(pod):
            return pod
        time.sleep(0.05)
    raise AssertionError(f"no matching pod of {NAME} after {timeout} s\n{cluster.diagnostics()}")


def running_args(pod: PodProcess) -> list[str]:
    """What the kernel says the engine process runs, after `serve`."""
    assert pod.process is not None
    words = [w.decode() for w in Path(f"/proc/{pod.process.pid}/cmdline").read_bytes().split(b"\0") if w]
    return words[words.index("serve") + 1:]


def test_example_smoke_uses_default_thresholds() -> None:
    _, server = example_docs()
    assert "thresholds" not in server["spec"]["smokeTest"], "the path must pass the gate users get by default"


def test_apply_plans_deploys_validates_and_serves(cluster: LocalCluster, seen: dict[str, str]) -> None:
    applied = cluster.kubectl("apply", "-f", str(EXAMPLE))
    after_apply = time.monotonic()
    # The validating webhook ran the planner; kubectl prints its admission warning.
    assert "Warning: plan " in applied.stderr and "context 2048" in applied.stderr, applied.stderr
    body = cluster.wait_for(server_path(cluster), lambda o: status(o).get("plan"), timeout=10)
    plan_latency = time.monotonic() - after_apply
    print(f"status.plan appeared {plan_latency:.2f} s after kubectl apply returned")
    row = columns(cluster)
    assert (row["CONTEXT"], row["KV TOKENS"], row["CHUNK"]) == ("2048", "16384", "256"), row
    assert row["PHASE"] in ("Pending", "Deploying", "Validating"), row

    deployment = cluster.wait_for(child_path(cluster, "deployments", NAME), lambda o: True, timeout=10)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    pod = wait_pod(cluster)
    # The engine runs the rendered args; only the model mount and the listen address are translated.
    expected = [str(cluster.claims["models"] / MODEL_FOLDER) if a == f"/models/{MODEL_FOLDER}" else a
                for a in container["args"]]
    expected[expected.index("--host") + 1] = "127.0.0.1"
    expected[expected.index("--port") + 1] = str(pod.command.ports["http"])
    assert container["command"] == ["headroom", "serve"]
    assert running_args(pod) == expected

    body = cluster.wait_for(server_path(cluster), lambda o: status(o).get("phase") in ("Ready", "Failed", "Degraded"),
                            timeout=240)
    assert status(body)["phase"] == "Ready", f"{status(body)}\n{cluster.diagnostics()}"
    validated = condition(body, "Validated")
    assert (validated["status"], validated["reason"]) == ("True", "SmokePassed"), validated
    smoke = status(body)["lastSmoke"]
    assert smoke["result"] == "Passed"
    for check in ("long_prefill", "short_ttft_during_long_prefill", "boundary_prompt_over_context", "retention"):
        assert smoke["checks"][check]["status"] == "pass", smoke["checks"]
    row = columns(cluster)
    assert (row["PHASE"], row["SMOKE"]) == ("Ready", "Passed"), row

    url = service_url(cluster)
    answer = complete(url, "Hello through the Service")
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8, answer
    # The engine behind the Service runs the plan the operator admitted.
    engine_plan = served_plan(url)
    revision = status(body)["lastGoodRevision"]
    config_map = cluster.get(child_path(cluster, "configmaps", f"{NAME}-plan-{revision}")) or {}
    admitted = json.loads(config_map["data"]["plan.json"])
    for key in PLAN_KEYS:
        assert engine_plan[key] == admitted[key], (key, engine_plan, admitted)
    seen["first"] = status(body)["lastGoodRevision"]
    # The 1-second contract is held in-process by tests/operator/test_operator_kopf.py. Here the path adds a
    # separate operator process and a webhook round trip on kopf's finalizer patch, on a 2-core machine that
    # CI shares: measured 0.4-1.0 s on a quiet machine, 1.0-2.4 s at load average 10. The bound catches a
    # plan that waits on the rollout (seconds to minutes), not scheduling noise. Checked last, so a busy
    # machine fails only this check.
    assert plan_latency < 3.0, f"status.plan appeared {plan_latency:.2f} s after kubectl apply returned"


def test_spec_change_is_promoted_across_an_operator_kill_mid_smoke(cluster: LocalCluster, seen: dict[str, str]) -> None:
    old_pod = wait_pod(cluster)
    cluster.kubectl("patch", "inferenceserver", NAME, "--type=merge", "-p",
                    json.dumps({"spec": {"targets": {"maxRunningRequests": 2}}}))
    body = cluster.wait_for(server_path(cluster), lambda o: status(o).get("currentRevision") not in (None, seen["first"]))
    second = status(body)["currentRevision"]
    new_pod = wait_pod(cluster, lambda pod: pod is not old_pod)
    # Recreate: the old engine has ended before the new one was started.
    assert old_pod.process is not None and old_pod.process.returncode is not None
    assert "--max-running-requests" in running_args(new_pod)
    assert running_args(new_pod)[running_args(new_pod).index("--max-running-requests") + 1] == "2"

    cluster.wait_for(server_path(cluster), lambda o: status(o).get("phase") == "Validating"
                     and (status(o).get("lastSmoke") or {}).get("revision") == second, timeout=120)
    assert columns(cluster)["SMOKE"] == "Running"
    cluster.kill_operator()
    assert status(cluster.get(server_path(cluster)) or {})["phase"] == "Validating"
    cluster.start_operator()
    body = cluster.wait_for(server_path(cluster), lambda o: status(o).get("phase") in ("Ready", "Failed", "Degraded")
                            and status(o).get("lastGoodRevision") != seen["first"] or status(o).get("failedRevision"),
                            timeout=180)
    assert status(body)["phase"] == "Ready" and status(body)["lastGoodRevision"] == second, status(body)
    assert condition(body, "Validated")["status"] == "True"
    # The restarted operator re-ran the gate against the same engine; it never restarted the pod.
    assert wait_pod(cluster) is new_pod and new_pod.restarts == 0
    url = service_url(cluster)
    assert served_plan(url)["max_running_requests"] == 2
    assert complete(url, "after the restart")["choices"][0]["text"]
    assert columns(cluster)["PHASE"] == "Ready"
    seen["second"] = second


def test_engine_failing_the_smoke_test_is_rolled_back(cluster: LocalCluster, seen: dict[str, str]) -> None:
    good = seen["second"]
    live_spec = (cluster.get(server_path(cluster)) or {})["spec"]
    cluster.kubectl("patch", "inferenceserver", NAME, "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"extraArgs": shorter_context_args(live_spec, 512)}}}))
    body = cluster.wait_for(server_path(cluster), lambda o: status(o).get("failedRevision"), timeout=180)
    bad = status(body)["failedRevision"]
    assert bad != good
    validated = condition(body, "Validated")
    assert (validated["status"], validated["reason"]) == ("False", "SmokeFailed"), validated
    assert "long_prefill" in validated["message"], validated["message"]
    assert status(body)["lastSmoke"]["checks"]["long_prefill"]["status"] == "fail"

    body = cluster.wait_for(server_path(cluster), lambda o: status(o).get("phase") == "Degraded", timeout=120)
    assert status(body)["lastGoodRevision"] == good
    assert condition(body, "Degraded")["reason"] == "RolledBack"
    deployment = cluster.get(child_path(cluster, "deployments", NAME)) or {}
    assert deployment["metadata"]["annotations"]["headroom.dev/revision"] == good
    service = cluster.get(child_path(cluster, "services", NAME)) or {}
    assert service["spec"]["selector"]["headroom.dev/revision"] == good
    # The old engine serves again, through the same Service address.
    url = service_url(cluster)
    engine_plan = served_plan(url)
    assert (engine_plan["context_length"], engine_plan["max_running_requests"]) == (2048, 2), engine_plan
    assert complete(url, "after the rollback")["choices"][0]["text"]
    row = columns(cluster)
    assert (row["PHASE"], row["SMOKE"]) == ("Degraded", "Failed"), row


def test_infeasible_spec_is_refused_at_admission(cluster: LocalCluster) -> None:
    geometry, server = example_docs()
    server = json.loads(json.dumps(server))
    server["metadata"]["name"] = "too-big"
    # Less than the CUDA context alone (704 MiB): no plan fits whatever the other lines.
    server["spec"]["gpu"]["memory"] = "512Mi"
    refused = cluster.kubectl_apply(geometry, server, check=False)
    assert refused.returncode != 0
    assert 'admission webhook "validate.inferenceservers.headroom.dev" denied the request' in refused.stderr
    assert "no feasible plan" in refused.stderr and "binding constraint" in refused.stderr, refused.stderr
    assert cluster.get(server_path(cluster, "too-big")) is None


def test_delete_removes_every_child(cluster: LocalCluster) -> None:
    pod = wait_pod(cluster)
    address = service_url(cluster).removeprefix("http://").split(":")
    cluster.kubectl("delete", "inferenceserver", NAME, "--wait=false")
    cluster.wait_for(f"/api/v1/namespaces/{cluster.namespace}/pods", lambda o: not o["items"], timeout=60)
    deadline = time.monotonic() + 30
    while cluster.get(server_path(cluster)) is not None:
        assert time.monotonic() < deadline, "the InferenceServer was not deleted"
        time.sleep(0.1)
    for kind in ("deployments", "services"):
        path = child_path(cluster, kind, "").rstrip("/")
        assert [o["metadata"]["name"] for o in (cluster.get(path) or {})["items"]] == [], kind
    config_maps = (cluster.get(f"/api/v1/namespaces/{cluster.namespace}/configmaps") or {})["items"]
    assert [c["metadata"]["name"] for c in config_maps] == ["tiny-hybrid-geometry"]
    assert pod.process is not None and pod.process.returncode is not None
    # Nothing listens on the Service's address any more.
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((address[0], int(address[1])), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "the Service's address still accepts connections"
        time.sleep(0.2)
