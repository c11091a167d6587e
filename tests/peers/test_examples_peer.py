"""The operator's Deployment for every SGLang and vLLM example starts: its args pass the pinned engines' parsers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from headroom.engine.plan import parse_size
from headroom.operator.build_deployment import build_deployment
from headroom.operator.planning import plan_revision
from headroom.operator.spec import parse_spec

from tests.chart.test_examples import EXAMPLES, load_example
from tests.peers.test_sglang_peer import parse as parse_sglang
from tests.peers.test_vllm_peer import parse as parse_vllm


def _container(path: Path) -> tuple[str, str | None, dict]:
    server, config_map = load_example(path)
    spec = parse_spec(server["spec"])
    assert spec.gpu.memory is not None
    planned = plan_revision(spec, json.loads(config_map["data"]["config.json"]), parse_size(spec.gpu.memory))
    owner = {**server, "metadata": {"namespace": "default", "uid": "0", **server["metadata"]}}
    deployment = build_deployment(owner, spec, planned.plan.engine_args, planned.revision, "headroom:dev")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return spec.engine.kind, spec.engine.flavour, container


PEER_EXAMPLES = [p for p in EXAMPLES if _container(p)[0] in ("sglang", "vllm")]


def test_there_are_sglang_and_vllm_examples() -> None:
    kinds = {_container(p)[0] for p in PEER_EXAMPLES}
    assert kinds == {"sglang", "vllm"}


@pytest.mark.parametrize("path", PEER_EXAMPLES, ids=lambda p: p.name)
def test_example_deployment_passes_the_engines_parser(path: Path, sglang_parser, vllm_serve) -> None:
    kind, flavour, container = _container(path)
    args = list(container["args"])
    if kind == "vllm":
        assert container["command"][:2] == ["vllm", "serve"]
        parsed = parse_vllm(vllm_serve, args)
        assert parsed.kv_cache_memory_bytes == int(args[args.index("--kv-cache-memory-bytes") + 1])
        return
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    model = args[args.index("--model-path") + 1]
    rest = args[:args.index("--model-path")] + args[args.index("--model-path") + 2:]
    if flavour == "int-kv":
        # The fork's own --kv-cache-dtype int2 is what stock SGLang rejects; every other flag is stock's.
        at = rest.index("--kv-cache-dtype")
        with pytest.raises((SystemExit, argparse.ArgumentError)):
            parse_sglang(sglang_parser, rest)
        rest = rest[:at] + rest[at + 2:]
    parsed = parse_sglang(sglang_parser, rest)
    assert parsed.model_path == "/models/m" and model.startswith("/models/")
