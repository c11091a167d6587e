"""The chart's CRD is the repository's crds/, byte for byte, and crds.enabled / crds.keep switch it."""

from __future__ import annotations

import filecmp
from pathlib import Path

import yaml

from tests.chart.chart_tools import CHART_DIR, REPO_ROOT, Renderer, by_kind

SOURCE = REPO_ROOT / "crds"
COPY = CHART_DIR / "files" / "crds"


def test_chart_copy_is_identical_to_crds() -> None:
    sources = sorted(p.name for p in SOURCE.glob("*.yaml"))
    copies = sorted(p.name for p in COPY.glob("*.yaml"))
    assert sources, "crds/ holds no CRD"
    assert copies == sources, f"charts/headroom/files/crds has {copies}, crds/ has {sources}: run `make sync-crds`"
    for name in sources:
        assert filecmp.cmp(SOURCE / name, COPY / name, shallow=False), f"{name} differs: run `make sync-crds`"


def _source_crds() -> dict[str, dict]:
    docs = [d for p in sorted(SOURCE.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs}


def test_rendered_crd_equals_the_source_apart_from_labels_and_keep(render: Renderer) -> None:
    rendered = {c["metadata"]["name"]: c for c in by_kind(render(), "CustomResourceDefinition")}
    source = _source_crds()
    assert set(rendered) == set(source)
    for name, crd in rendered.items():
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert crd["spec"] == source[name]["spec"], f"{name}: spec changed in rendering"


def test_crds_keep_false_drops_the_policy(render: Renderer) -> None:
    for crd in by_kind(render("crds.keep=false"), "CustomResourceDefinition"):
        assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


def test_crds_disabled_renders_none(render: Renderer) -> None:
    assert not by_kind(render("crds.enabled=false"), "CustomResourceDefinition")


def test_peering_crds_follow_the_watch_scope(render: Renderer) -> None:
    cluster = by_kind(render("operator.peering.enabled=true"), "CustomResourceDefinition")
    assert {c["metadata"]["name"] for c in cluster} >= {"clusterkopfpeerings.kopf.dev"}
    namespaced = by_kind(render("operator.peering.enabled=true", "operator.watchNamespaces={a}"),
                         "CustomResourceDefinition")
    assert {c["metadata"]["name"] for c in namespaced} >= {"kopfpeerings.kopf.dev"}
    without = by_kind(render("operator.peering.enabled=true", "operator.peering.installCRDs=false"),
                      "CustomResourceDefinition")
    assert not [c for c in without if c["spec"]["group"] == "kopf.dev"]


def test_copy_path_is_outside_helms_special_crds_folder() -> None:
    # Helm installs charts/<chart>/crds/ unconditionally; the copy must not live there.
    assert not (CHART_DIR / "crds").exists()
    assert isinstance(COPY, Path) and COPY.is_dir()
