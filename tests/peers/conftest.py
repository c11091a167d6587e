"""The pinned SGLang and vLLM releases, importable without a GPU (installed by `make peers`).

Only here, for the tests: vLLM's compiled CUDA extensions are replaced by empty modules and its platform
probe is pointed at CUDA (the platform the plans are for), so its parsers and sizing classes import on a CPU.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

PEERS_SITE = Path(__file__).resolve().parents[2] / ".cache" / "peers" / "site"
# Appended, so the venv's torch, transformers and pydantic win over anything in the peers' folder.
if str(PEERS_SITE) not in sys.path:
    sys.path.append(str(PEERS_SITE))


def _require_peers() -> None:
    if not (PEERS_SITE / "sglang").is_dir() or not (PEERS_SITE / "vllm").is_dir():
        pytest.fail(f"the pinned engines are not installed in {PEERS_SITE}: run `make peers`")


@pytest.fixture(scope="session")
def sglang_parser() -> Any:
    """argparse parser of SGLang's ServerArgs (ServerArgs.add_cli_args)."""
    _require_peers()
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _stub_vllm_cuda_extensions() -> None:
    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import vllm.platforms as platforms

    for name in list(platforms.builtin_platform_plugins):
        platforms.builtin_platform_plugins[name] = (lambda: None)
    platforms.builtin_platform_plugins["cuda"] = lambda: "vllm.platforms.cuda.CudaPlatform"


@pytest.fixture(scope="session")
def vllm_serve() -> Any:
    """(parser, ServeSubcommand) of `vllm serve`."""
    _require_peers()
    _stub_vllm_cuda_extensions()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers)
    return parser, command
