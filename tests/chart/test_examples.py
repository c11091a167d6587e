"""Every example in examples/ is well formed and plans feasibly, through the operator's own spec -> plan path.

Each example file holds the geometry ConfigMap and the InferenceServer that references it. The test
parses the spec with the operator's pydantic model (unknown fields fail), reads config.json from the
ConfigMap, takes spec.gpu.memory, and calls the planner exactly as the admission webhook does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from headroom.engine.plan import parse_size
from headroom.operator.planning import plan_revision
from headroom.operator.spec import parse_spec
from kubernetes_validate import validate as validate_builtin

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))
EXPECTED = {"rtx4070-qwen3.5-4b.yaml", "2x12gb-tp2-27b-int2.yaml", "h200-qwen3-next-80b.yaml",
            "rtx4070-qwen3.5-9b-int4.yaml", "rtx4090-qwen3.5-27b-int4.yaml"}
KUBERNETES_VERSION = "1.33"


def load_example(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(InferenceServer, the ConfigMap holding its geometry) from one example file."""
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    servers = [d for d in docs if d["kind"] == "InferenceServer"]
    assert len(servers) == 1, f"{path.name}: expected one InferenceServer, found {len(servers)}"
    server = servers[0]
    ref = server["spec"]["model"]["configMap"]
    maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["name"]]
    assert maps, f"{path.name}: ConfigMap {ref['name']!r} named by spec.model.configMap is not in the file"
    return server, maps[0]


def test_the_examples_exist() -> None:
    assert EXPECTED <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_plans_feasibly(path: Path) -> None:
    server, config_map = load_example(path)
    assert server["apiVersion"] == "headroom.dev/v1alpha1"
    validate_builtin(config_map, KUBERNETES_VERSION, strict=True)
    spec = parse_spec(server["spec"])
    key = spec.model.config_map.key if spec.model.config_map else "config.json"
    config_json = json.loads(config_map["data"][key])
    assert spec.gpu.memory is not None, f"{path.name}: examples state spec.gpu.memory so they plan anywhere"
    gpu_memory = parse_size(spec.gpu.memory, field="spec.gpu.memory")

    planned = plan_revision(spec, config_json, gpu_memory)

    plan = planned.plan
    targets = spec.targets
    assert plan.engine == spec.engine.kind and plan.kv_dtype == spec.kv_cache.dtype and plan.tp == spec.gpu.count
    if isinstance(targets.context_length, int):
        assert plan.context_length == targets.context_length
    assert plan.context_length <= plan.max_total_tokens
    assert targets.retained_sessions * targets.session_tokens <= plan.max_total_tokens
    assert 0.0 < plan.mem_fraction_static < 1.0
    assert plan.static_bytes <= plan.mem_fraction_static * plan.gpu_memory_bytes
    assert all(value >= 0 for value in plan.ledger.values()), plan.ledger


def test_seed_004_example_holds_all_three_sessions() -> None:
    server, config_map = load_example(REPO_ROOT / "examples" / "2x12gb-tp2-27b-int2.yaml")
    spec = parse_spec(server["spec"])
    assert (spec.engine.kind, spec.kv_cache.dtype, spec.gpu.count) == ("sglang", "int2", 2)
    assert (spec.targets.context_length, spec.targets.retained_sessions, spec.targets.session_tokens) == (
        131072, 3, 66000,
    )
    planned = plan_revision(spec, json.loads(config_map["data"]["config.json"]), parse_size(spec.gpu.memory or ""))
    # The report's failure: a 148,058-token pool cannot hold 3 x 66,000 = 198,000 tokens.
    assert planned.plan.max_total_tokens >= 198_000
    assert "--chunked-prefill-size" in planned.plan.engine_args


@pytest.mark.parametrize(("name", "gib"), [("rtx4070-qwen3.5-9b-int4.yaml", 12), ("rtx4090-qwen3.5-27b-int4.yaml", 24)])
def test_quantized_examples_plan_int4_weights_that_bf16_could_not_fit(name: str, gib: int) -> None:
    """The 12 GB and 24 GB cards plan a 9B and a 27B hybrid only because the weights are INT4."""
    from headroom.engine.plan import geometry_from_config

    server, config_map = load_example(REPO_ROOT / "examples" / name)
    spec = parse_spec(server["spec"])
    config_json = json.loads(config_map["data"]["config.json"])
    plan = plan_revision(spec, config_json, parse_size(spec.gpu.memory or "")).plan
    assert plan.weight_format == "int4 W4A16, group 128, symmetric"
    assert plan.ledger["weights"] < 0.75 * gib * 1024**3
    dense = dict(config_json)
    dense.pop("quantization_config")
    assert geometry_from_config(dense).total_weight_bytes() > gib * 1024**3
