"""Pure builders: ConfigMap, Deployment, Services rendered from a plan (no API server involved)."""

from __future__ import annotations

import json

import pytest
from headroom.operator.build_configmap import build_configmap
from headroom.operator.build_deployment import build_deployment
from headroom.operator.build_service import build_canary_service, build_service
from headroom.operator.planning import PlannedRevision, plan_revision
from headroom.operator.spec import SpecError, parse_spec

from tests.operator.resources import inference_server

OWNER = {"metadata": {"name": "qwen", "namespace": "llm", "uid": "u-1"}}


def planned(**spec_changes) -> PlannedRevision:
    spec = parse_spec(inference_server(**spec_changes)["spec"])
    return plan_revision(spec, spec.model.config or {}, 24 * 1024**3)


def deployment_of(p: PlannedRevision) -> dict:
    return build_deployment(OWNER, p.spec, p.plan.engine_args, p.revision, "headroom:1.0")


def test_deployment_runs_the_plans_flags_non_root_with_gpus_and_probes() -> None:
    p = planned()
    deployment = deployment_of(p)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["headroom", "serve"]
    args = container["args"]
    for flag, value in [("--context-length", p.plan.context_length), ("--max-total-tokens", p.plan.max_total_tokens),
                        ("--chunked-prefill-size", p.plan.chunked_prefill_size)]:
        assert args[args.index(flag) + 1] == str(value)
    assert args[args.index("--model") + 1] == "/models/qwen3.5-4b"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["image"] == "headroom:1.0"
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert deployment["metadata"]["annotations"]["headroom.dev/revision"] == p.revision
    assert deployment["spec"]["template"]["metadata"]["labels"]["headroom.dev/revision"] == p.revision
    # The selector must not contain the revision: it is immutable across rollouts.
    assert "headroom.dev/revision" not in deployment["spec"]["selector"]["matchLabels"]
    owner = deployment["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "u-1" and owner["controller"] is True and owner["kind"] == "InferenceServer"
    claim = next(v for v in pod["volumes"] if v["name"] == "model")["persistentVolumeClaim"]
    assert claim == {"claimName": "models", "readOnly": True}


def test_builtin_engine_on_two_gpus_runs_tensor_parallel_and_asks_for_both() -> None:
    p = planned(gpu={"count": 2, "memory": "24Gi"})
    container = deployment_of(p)["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"


def test_sglang_engine_uses_its_entry_point_image_and_extra_args() -> None:
    engine = {"kind": "sglang", "image": "lmsysorg/sglang:v0.5.23", "extraArgs": ["--enable-metrics"]}
    p = planned(engine=engine, model={"hostPath": "/data/models", "path": "q", "config": inference_server()["spec"]["model"]["config"]},
                gpu={"count": 2, "memory": "24Gi", "product": "NVIDIA-L4"})
    deployment = deployment_of(p)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    assert container["args"][:2] == ["--model-path", "/models/q"]
    assert container["args"][-1] == "--enable-metrics"
    assert container["image"] == "lmsysorg/sglang:v0.5.23"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert next(v for v in pod["volumes"] if v["name"] == "model")["hostPath"]["path"] == "/data/models"


def test_configmap_holds_plan_args_and_a_spec_that_rebuilds_the_revision() -> None:
    p = planned()
    config_map = build_configmap(OWNER, p)
    assert config_map["metadata"]["name"] == f"qwen-plan-{p.revision}"
    data = config_map["data"]
    assert json.loads(data["plan.json"])["max_total_tokens"] == p.plan.max_total_tokens
    assert data["engine-args"].split() == p.plan.engine_args
    assert parse_spec(json.loads(data["spec.json"])) == p.spec


def test_services_select_by_revision() -> None:
    stable = build_service(OWNER, "abc", 8000)
    canary = build_canary_service(OWNER, "def", 8000)
    assert stable["metadata"]["name"] == "qwen" and canary["metadata"]["name"] == "qwen-canary"
    assert stable["spec"]["selector"]["headroom.dev/revision"] == "abc"
    assert canary["spec"]["selector"]["headroom.dev/revision"] == "def"
    assert stable["spec"]["ports"][0]["port"] == 8000


def test_revision_changes_with_the_plan_and_not_otherwise() -> None:
    assert planned().revision == planned().revision
    other_targets = {"contextLength": 16384, "maxRunningRequests": 4, "maxNewTokens": 512}
    assert planned(targets=other_targets).revision != planned().revision
    assert planned(engine={"kind": "builtin", "image": "headroom:2"}).revision != planned().revision


@pytest.mark.parametrize("changes, field", [
    ({"targets": {"retainedSessions": 2}}, "sessionTokens"),
    ({"overrides": {"memFractionStatic": 1.2}}, "memFractionStatic"),
    ({"gpu": {"count": 0}}, "gpu.count"),
    ({"engine": {"kind": "vllm"}}, "engine.image"),
    ({"model": {"path": "x", "config": {}}}, "pvc or hostPath"),
    ({"kvCache": {"dtype": "fp4"}}, "kvCache.dtype"),
])
def test_spec_model_names_the_failing_field(changes, field) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_spec(inference_server(**changes)["spec"])


# Contract with `headroom serve`: every flag the Deployment passes must be one the engine accepts.
def test_builtin_deployment_args_parse_with_headroom_serve() -> None:
    import argparse

    serve_cli = pytest.importorskip("headroom.engine.server.cli")
    p = planned()
    args = deployment_of(p)["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    parsed = parser.parse_args(args)
    assert parsed.context_length == p.plan.context_length


@pytest.mark.parametrize("kind, variable", [("builtin", "HEADROOM_API_KEY"), ("vllm", "VLLM_API_KEY"),
                                            ("sglang", "HEADROOM_API_KEY")])
def test_the_api_key_reaches_each_engine_from_the_secret_never_inline(kind: str, variable: str) -> None:
    images = {"vllm": "vllm/vllm-openai:v0.33.0", "sglang": "lmsysorg/sglang:v0.5.23"}
    engine = {"kind": kind} if kind == "builtin" else {"kind": kind, "image": images[kind]}
    p = planned(engine=engine, auth={"apiKeySecret": {"name": "engine-key"}})
    container = deployment_of(p)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": variable, "valueFrom": {"secretKeyRef": {"name": "engine-key", "key": "api-key"}}} in container["env"]
    # SGLang reads no variable: its flag refers to it and the kubelet expands $(VAR) in args.
    assert (container["args"][-2:] == ["--api-key", f"$({variable})"]) == (kind == "sglang")
    assert "--api-key" not in container["args"] or kind == "sglang"


def test_without_auth_no_key_is_wired() -> None:
    container = deployment_of(planned())["spec"]["template"]["spec"]["containers"][0]
    assert not any("API_KEY" in e["name"] for e in container["env"]) and "--api-key" not in container["args"]
