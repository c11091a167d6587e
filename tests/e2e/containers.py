"""A pod template's container as a local command line: volumes become folders, the listen port a free one.

There are no containers here, so what a container runtime would give the process is translated instead:
- each volumeMount's mountPath becomes a local folder: every argument, command word and env value that
  names a path under a mountPath is rewritten to the same path under that folder;
- a pod has no network namespace, so the listen flags are rewritten: `--host` to 127.0.0.1 and `--port`
  of a declared containerPort to a free loopback port (the engines' flags: headroom, SGLang and vLLM all
  spell them this way);
- the command is looked up on this machine's PATH, with this Python's bin folder first (the venv's
  `headroom`).
Everything else (the args' order and values, the env) is exactly what the operator rendered.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LocalCommand:
    """argv, env and the container ports: {port name or number as str: local port}."""

    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]


def localize_path(value: str, mounts: dict[str, Path]) -> str:
    """`/models/x` -> `<model folder>/x` for the longest mountPath it lies under; `--a=/models/x` too."""
    if value.startswith("--") and "=" in value:
        flag, _, rest = value.partition("=")
        return f"{flag}={localize_path(rest, mounts)}"
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + value[len(mount):]
    return value


def localize_listen(args: list[str], port_map: dict[int, int]) -> list[str]:
    """`--host H` -> `--host 127.0.0.1`; `--port P` (P a containerPort) -> `--port <local port>`."""
    out = list(args)
    for i, arg in enumerate(out):
        flag, eq, inline = arg.partition("=")
        if flag not in ("--host", "--port"):
            continue
        value = inline if eq else (out[i + 1] if i + 1 < len(out) else "")
        if flag == "--host":
            new = LOOPBACK
        elif value.isdigit() and int(value) in port_map:
            new = str(port_map[int(value)])
        else:
            continue
        if eq:
            out[i] = f"{flag}={new}"
        else:
            out[i + 1] = new
    return out


def container_ports(container: dict[str, Any], free_ports: list[int]) -> tuple[dict[int, int], dict[str, int]]:
    """(containerPort -> local port, name-or-number -> local port), one free port per declared port."""
    declared = container.get("ports") or []
    if len(free_ports) < len(declared):
        raise ValueError(f"container {container.get('name')} declares {len(declared)} ports, got {len(free_ports)} free")
    by_number = {int(p["containerPort"]): free_ports[i] for i, p in enumerate(declared)}
    by_key = {str(n): local for n, local in by_number.items()}
    by_key.update({p["name"]: by_number[int(p["containerPort"])] for p in declared if p.get("name")})
    return by_number, by_key


def local_command(container: dict[str, Any], mounts: dict[str, Path], free_ports: list[int]) -> LocalCommand:
    """The process to run for `container`; mounts: mountPath -> local folder (already populated)."""
    by_number, by_key = container_ports(container, free_ports)
    words = [*(container.get("command") or []), *(container.get("args") or [])]
    if not words:
        raise ValueError(f"container {container.get('name')} has no command: images' entry points are unknown here")
    argv = localize_listen([localize_path(w, mounts) for w in words], by_number)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = localize_path(str(item["value"]), mounts)
    executable = shutil.which(argv[0], path=env["PATH"])
    if executable is None:
        raise ValueError(f"container {container.get('name')}: command {argv[0]!r} is not on PATH")
    return LocalCommand([executable, *argv[1:]], env, by_key)
