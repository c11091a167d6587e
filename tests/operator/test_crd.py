"""The CRD manifest (kubernetes-validate) and its schema + CEL rules on valid and invalid resources.

Custom-resource checks use crd_approx, an APPROXIMATION of the API server (see its docstring).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.operator.crd_approx import validate_custom_resource
from tests.operator.resources import inference_server

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferenceservers.headroom.dev.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())


def test_crd_manifest_passes_kubernetes_validate_strict() -> None:
    tool = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(tool), "--strict", str(CRD_PATH)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "INFO" in result.stdout or "valid" in result.stdout.lower(), result.stdout


def test_crd_names_and_printer_columns() -> None:
    spec = CRD["spec"]
    assert spec["group"] == "headroom.dev" and spec["names"]["kind"] == "InferenceServer"
    assert set(spec["names"]["shortNames"]) == {"isvc", "hrs"}
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Context", "KV tokens", "Chunk", "Slots", "Smoke", "Age"]


@pytest.mark.parametrize("changes", [
    {},
    {"targets": {"contextLength": "auto"}},
    {"targets": {"contextLength": 65536, "retainedSessions": 3, "sessionTokens": 20000}},
    {"engine": {"kind": "sglang", "image": "lmsysorg/sglang:v0.5.23", "extraArgs": ["--enable-metrics"]}},
    {"overrides": {"memFractionStatic": 0.85, "chunkedPrefillSize": 8192}},
    {"gpu": {"count": 2}},
    {"smokeTest": {"enabled": False}},
])
def test_valid_resources_are_admitted(changes) -> None:
    assert validate_custom_resource(inference_server(**changes), CRD) == []


@pytest.mark.parametrize("changes, expected", [
    ({"targets": {"retainedSessions": 3}}, "sessionTokens is required"),
    ({"overrides": {"memFractionStatic": 1.0}}, "strictly between 0 and 1"),
    ({"overrides": {"memFractionStatic": 0}}, "strictly between 0 and 1"),
    ({"gpu": {"count": 0}}, "minimum"),
    ({"engine": {"kind": "vllm"}}, "engine.image is required"),
    ({"engine": {"kind": "tgi", "image": "x"}}, "is not one of"),
    ({"targets": {"contextLength": "long"}}, "positive integer or 'auto'"),
    ({"targets": {"contextLength": 0}}, "positive integer or 'auto'"),
    ({"kvCache": {"dtype": "fp4"}}, "is not one of"),
    ({"gpu": {"count": 1, "memory": "lots"}}, "does not match"),
    ({"targets": {"maxNewTokens": 0}}, "minimum"),
])
def test_invalid_resources_are_rejected(changes, expected) -> None:
    errors = validate_custom_resource(inference_server(**changes), CRD)
    assert any(expected in e for e in errors), errors


def test_model_needs_exactly_one_source_and_one_geometry() -> None:
    both = inference_server()
    both["spec"]["model"]["hostPath"] = "/data"
    assert any("exactly one source" in e for e in validate_custom_resource(both, CRD))
    neither = copy.deepcopy(inference_server())
    del neither["spec"]["model"]["config"]
    assert any("exactly one geometry source" in e for e in validate_custom_resource(neither, CRD))
    by_configmap = inference_server()
    del by_configmap["spec"]["model"]["config"]
    by_configmap["spec"]["model"]["configMap"] = {"name": "qwen-config"}
    assert validate_custom_resource(by_configmap, CRD) == []


def test_unknown_fields_are_caught() -> None:
    typo = inference_server()
    typo["spec"]["targets"]["contextLenght"] = 4096
    assert any("contextLenght" in e for e in validate_custom_resource(typo, CRD))
