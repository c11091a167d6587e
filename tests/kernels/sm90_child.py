"""Test helper: a script run in a child process through Triton's real JIT, compiled for sm_90 (Triton ships ptxas)
with a driver that answers for an H200, without the interpreter, so no GPU is needed; its last line of output is
JSON. For what only the real JIT does: specialisation keys, cache hooks, preloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The child's first lines: what the JIT asks a driver for before it compiles (a device, a stream, the target).
PRELUDE = r'''
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


class H200:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(H200())
'''


def run_on_sm90(script: str, tmp_path: Path, **names: object) -> dict:
    """Run PRELUDE + script (names set first, by repr) in a child with its own Triton cache; its last line, parsed."""
    child = tmp_path / "child.py"
    child.write_text("".join(f"{name} = {value!r}\n" for name, value in names.items()) + PRELUDE + script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    done = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
