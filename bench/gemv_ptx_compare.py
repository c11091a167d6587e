"""The shipped GEMV variants' sm_90 PTX from a tree, instruction for instruction (register numbers and parameter
lines dropped), so that two trees can be compared without a GPU: a change to gemv_fwd_kernel's constexpr branches
should leave the variants it does not turn on as they were. Variants: one row plain, RESIDUAL (4 x 2,048 tiles) and
NORM as pairs; 16 rows swapped with a split; SwiGLU at 16 rows with L2 prefetch; all with PDL.

`python3 bench/gemv_ptx_compare.py OUT.json [TREE]` (TREE: a checkout's root, this one's by default; its
kernels/gemv.py is compiled with this checkout's test helper), then compare two OUT.json files:
`python3 bench/gemv_ptx_compare.py --diff A.json B.json`."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = {"x": "*bf16", "up": "*bf16", "w": "*bf16", "out": "*bf16", "ws": "*fp32", "counters": "*i32",
        "res": "*bf16", "sumsq": "*fp32", "eps": "fp32"}
PAIRS = dict(BASE, x="*i32", up="*i32", w="*i32")
VARIANTS = [
    (PAIRS, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "PAIRS": True, "SPLIT": False, "SWAP_AB": False}),
    (PAIRS, {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 2048, "PAIRS": True, "SPLIT": False, "SWAP_AB": False,
             "RESIDUAL": True}),
    (PAIRS, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "PAIRS": True, "SPLIT": False, "SWAP_AB": False,
             "NORM": True, "UNIT_OFFSET": True}),
    (BASE, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "PAIRS": False, "SPLIT": True, "SWAP_AB": True}),
    (BASE, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "PAIRS": False, "SPLIT": False, "SWAP_AB": False,
            "SWIGLU": True, "L2_PREFETCH": 2}),
]
COMMON = {"NUM_STAGES": 3, "EVEN_K": True, "SILU_MUL": False, "PDL": True, "CORE_ROWS": False, "ROW_SUM": False}


def instructions(ptx: str) -> list[str]:
    """The PTX body's lines without parameters, comments, debug sections and register numbers."""
    body = [line.strip() for line in ptx.splitlines()]
    body = [line for line in body if line and "param" not in line
            and not line.startswith(("//", ".file", ".loc", ".section", ".b8", ".b32", ".b64"))]
    return [re.sub(r"%\w+\d+", "R", line) for line in body]


def compile_tree(tree: Path) -> list[list[str]]:
    """Each variant's instructions, compiled from tree's kernels/gemv.py (imported as headroom.kernels.gemv)."""
    sys.path.insert(0, str(ROOT))
    from tests.kernels.sm90 import compile_sm90

    with tempfile.TemporaryDirectory() as packages:
        (Path(packages) / "headroom").symlink_to(tree.resolve())
        # (the compile child inherits the environment: the tree's package ahead of the installed one)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [packages, os.environ.get("PYTHONPATH")]))
        variants = [("headroom.kernels.gemv", "gemv_fwd_kernel", pointers, {**COMMON, **constants})
                    for pointers, constants in VARIANTS]
        results = compile_sm90(variants)
    for result in results:
        if not result["ok"]:
            raise SystemExit(f"compile failed: {result.get('error')}")
    return [instructions(result["ptx"]) for result in results]


def main() -> None:
    if sys.argv[1] == "--diff":
        a, b = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            print(f"variant {i}: {len(x)} / {len(y)} lines, {'the same' if x == y else 'DIFFERENT'}")
        raise SystemExit(0 if a == b else 1)
    tree = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT
    Path(sys.argv[1]).write_text(json.dumps(compile_tree(tree)))


if __name__ == "__main__":
    main()
