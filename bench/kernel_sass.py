"""Instructions a code in the int4 stream kernel's main loop, read off its SASS for sm_90 on a machine without a
GPU (Triton compiles for a target it names; its package carries ptxas and cuobjdump).

    .venv/bin/python bench/kernel_sass.py OUT.json [BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES ...]

A decode GEMV over int4 words is bound by the instructions it issues per code before it is bound by memory
(kernels/quant_gemv.py's docstring), so the count per code is the figure to drive down between H200 runs. The
main loop is the backward branch spanning the most code; the kernel is compiled as the launcher specializes it
for the 4B model's layers (pointers and the K-sized arguments 16-divisible, K a multiple of the tile)."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import triton
from headroom.kernels.quant_gemv import quant_stream_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = {"x": "*bf16", "w": "*i32", "s": "*bf16", "z": "*i32", "o": "*bf16", "ws": "*fp32", "counters": "*i32"}
# Integer arguments the launcher's values make 16-divisible at the 4B shapes (Triton specializes on that).
DIVISIBLE = {"M": False, "N": True, "K": True, "stride_xm": True, "stride_wn": True, "stride_om": True,
             "k_per_split": True, "magic_bits": True}
DEFAULT_CONFIGS = ["1,64,128,4,3", "1,128,128,4,3", "1,256,128,4,3", "1,256,128,8,3", "1,512,128,8,2",
                   "4,128,64,4,3", "4,128,128,4,3", "4,64,128,4,3"]


def compile_sass(block_m: int, block_n: int, block_k: int, warps: int, stages: int) -> str:
    """bf16 rows, as the engine's decode passes them (int32 pairs)."""
    constants = {"HAS_ZERO": False, "ZERO": 8, "SCALE_BK": 128, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "BLOCK_K": block_k, "SPLIT": True, "NUM_STAGES": stages, "EVEN_K": True, "X_PAIRS": True}
    names = quant_stream_kernel.arg_names
    signature = {n: "constexpr" if n in constants else POINTERS.get(n, "i32") for n in names}
    signature["x"] = "*i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in POINTERS or DIVISIBLE.get(n)}
    kernel = triton.compile(ASTSource(quant_stream_kernel, signature, constants, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    cubin = Path("/tmp/kernel_sass.cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (opcode names, predicates dropped)."""
    rows = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)]
    loops = [(at - int(t.group(1), 16), int(t.group(1), 16), at) for at, text in rows
             if (t := re.search(r"BRA (0x[0-9a-f]+)", text)) and int(t.group(1), 16) < at]
    _, start, end = max(loops)
    return [re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0] for at, text in rows if start <= at <= end]


def main() -> None:
    out = Path(sys.argv[1])
    results = []
    for spec in sys.argv[2:] or DEFAULT_CONFIGS:
        block_m, block_n, block_k, warps, stages = map(int, spec.split(","))
        ops = main_loop(compile_sass(block_m, block_n, block_k, warps, stages))
        codes_per_thread = block_n * block_k / (32 * warps)
        row = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages,
               "loop_instructions": len(ops), "codes_per_thread": codes_per_thread,
               "instructions_per_code": round(len(ops) / codes_per_thread, 2),
               "opcodes": dict(collections.Counter(ops).most_common(12))}
        results.append(row)
        print(f"{spec}: {row['instructions_per_code']} a code ({len(ops)} in the loop)", row["opcodes"])
    out.write_text(json.dumps({"command": "python3 bench/kernel_sass.py " + " ".join(sys.argv[1:]),
                               "triton": triton.__version__, "target": "cuda sm_90", "rows": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
