"""Test helper: compile Triton kernels for sm_90 (the H200) on a machine without a GPU. Triton ships ptxas, so a
kernel that the interpreter runs but the GPU compiler rejects (an early return in a constexpr branch, which the
interpreter never reads) fails here instead of on the device. The tests run under TRITON_INTERPRET, where kernels
are interpreted functions, so the compiles run in a child process without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = r"""
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

results = []
for module, name, pointers, constants, warps, stages in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(module), name)
    # A constexpr the variant leaves out takes its default, as a launch that leaves it out would (not an i32).
    for param in inspect.signature(kernel.fn).parameters.values():
        if param.name not in constants and param.default is not param.empty and "constexpr" in str(param.annotation):
            constants[param.name] = param.default
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in kernel.arg_names}
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        results.append({"ok": True, "ptx": compiled.asm["ptx"], "ttgir": compiled.asm["ttgir"]})
    except Exception as exc:
        results.append({"ok": False, "error": str(exc)[-3000:]})
print(json.dumps(results))
"""


def compile_sm90(variants: list[tuple[str, str, dict, dict]], num_warps: int = 4, num_stages: int = 3) -> list[dict]:
    """variants: (module, kernel name, pointer types by argument ("*bf16", ...), constexprs); every other argument
    is an i32. Returns per variant {"ok", "ptx", "ttgir"} or {"ok": False, "error"}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    payload = json.dumps([[m, n, p, c, num_warps, num_stages] for m, n, p, c in variants])
    done = subprocess.run([sys.executable, "-c", _CHILD], input=payload, capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"sm_90 compile child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
