"""Fixtures for the chart tests: the helm binary (fetched once into .tools/) and a renderer around it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.chart_tools import (
    CHART_DIR,
    HELM_CACHE_DIR,
    RELEASE_NAMESPACE,
    Renderer,
    extract_helm,
    run_helm,
)


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    """Path to a working helm binary (fetched once per checkout, then cached in .tools/)."""
    helm = HELM_CACHE_DIR / "helm"
    if not helm.is_file():
        helm = extract_helm(HELM_CACHE_DIR)
    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=30)
    if version.returncode != 0:
        pytest.fail(f"{helm} does not run: {version.stderr.strip()}")
    return helm


@pytest.fixture(scope="session")
def render(helm_binary: Path) -> Renderer:
    """render(*set_args, values=None) -> the list of manifests `helm template` produces."""

    def _render(*set_args: str, values: Path | None = None) -> list[dict[str, Any]]:
        args = ["template", "demo", str(CHART_DIR), "--namespace", RELEASE_NAMESPACE]
        if values is not None:
            args += ["--values", str(values)]
        for item in set_args:
            args += ["--set", item]
        result = run_helm(helm_binary, *args)
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return _render
