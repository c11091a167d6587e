"""The Dockerfile, parsed (no Docker engine here): targets, non-root users, health checks, no torch in the operator."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
# Packages that make up the compute stack; none may be installed into the operator image.
COMPUTE_STACK = re.compile(r"\b(torch|triton|fla-core|fla|nvidia-cu\w*)\b|\[[^\]]*\b(engine|gpu)\b[^\]]*\]")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [value for kind, value in self.instructions if kind == instruction]

    def depends_on(self) -> set[str]:
        """Stages this one reads from: its FROM base and every COPY --from."""
        deps = {self.base}
        for value in self.values("COPY"):
            for token in shlex.split(value):
                if token.startswith("--from="):
                    deps.add(token.removeprefix("--from="))
        return deps


def parse_stages(path: Path) -> dict[str, Stage]:
    parser = DockerfileParser(path=str(path))
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for item in parser.structure:
        kind, value = item["instruction"], item["value"]
        if kind == "FROM":
            words = value.split()
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else f"stage-{len(stages)}"
            current = Stage(name=name, base=words[0])
            stages[name] = current
        elif current is not None and kind != "COMMENT":
            current.instructions.append((kind, value))
    return stages


def closure(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The target stage and every stage it builds on, transitively."""
    seen: list[str] = []
    pending = [target]
    while pending:
        name = pending.pop()
        if name in seen or name not in stages:
            continue
        seen.append(name)
        pending.extend(stages[name].depends_on())
    return [stages[name] for name in seen]


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_stages(DOCKERFILE)


def test_both_targets_exist(stages: dict[str, Stage]) -> None:
    assert {"operator", "engine"} <= set(stages), f"stages: {sorted(stages)}"


@pytest.mark.parametrize("target", ["operator", "engine"])
def test_final_stage_runs_as_non_root(stages: dict[str, Stage], target: str) -> None:
    users = stages[target].values("USER")
    assert users, f"stage {target!r} sets no USER, so it runs as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"stage {target!r} ends with USER {users[-1]}"
    assert user.isdigit(), "a numeric USER lets Kubernetes' runAsNonRoot verify it"


@pytest.mark.parametrize("target", ["operator", "engine"])
def test_final_stage_has_healthcheck_entrypoint_and_tmp_home(stages: dict[str, Stage], target: str) -> None:
    stage = stages[target]
    healthchecks = stage.values("HEALTHCHECK")
    assert healthchecks and "NONE" not in healthchecks[-1].upper().split(), f"{target} lacks a HEALTHCHECK"
    assert stage.values("ENTRYPOINT"), f"{target} has no ENTRYPOINT"
    env = " ".join(stage.values("ENV"))
    # Read-only root filesystem: every writable path must be under /tmp (an emptyDir in Kubernetes).
    assert "HOME=/tmp" in env, f"{target}: HOME must point at /tmp, ENV is {env!r}"
    assert "XDG_CACHE_HOME=/tmp" in env


def test_engine_caches_live_under_tmp(stages: dict[str, Stage]) -> None:
    env = " ".join(stages["engine"].values("ENV"))
    for variable in ("TRITON_CACHE_DIR", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        match = re.search(rf"{variable}=(\S+)", env)
        assert match and match.group(1).startswith("/tmp"), f"engine: {variable} not under /tmp in {env!r}"


def test_operator_image_installs_no_compute_stack(stages: dict[str, Stage]) -> None:
    chain = closure(stages, "operator")
    assert {s.name for s in chain} >= {"operator", "operator-venv", "wheel"}
    for stage in chain:
        for kind, value in stage.instructions:
            if kind != "RUN":
                continue
            for command in re.split(r"&&|;", value):
                if "pip" in command and "install" in command:
                    hit = COMPUTE_STACK.search(command)
                    assert hit is None, f"stage {stage.name!r} installs {hit.group(0)!r}: {command.strip()}"


def test_engine_image_installs_torch_triton_and_fla(stages: dict[str, Stage]) -> None:
    runs = " ".join(v for s in closure(stages, "engine") for v in s.values("RUN"))
    assert "torch==" in runs
    assert "[engine,gpu]" in runs, "the gpu extra brings fla-core, the engine extra triton"
    assert stages["engine-base"].base.startswith("${CUDA_IMAGE}") or "cuda" in stages["engine-base"].base


def test_dockerignore_keeps_build_inputs(stages: dict[str, Stage]) -> None:
    ignored = {
        line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = {
        shlex.split(v)[0] for s in stages.values() for v in s.values("COPY") if not v.startswith("--from")
    }
    assert copied, "no COPY from the build context"
    for source in copied:
        assert source.rstrip("/") not in ignored, f"{source} is COPY'd but .dockerignore drops it"
    assert {".venv", ".git", ".tools"} <= ignored
    # The node agent and the emulator (tests/e2e, tests/operator) are development tools: never in an image.
    assert "tests" in ignored and not any(source.startswith("tests") for source in copied)
