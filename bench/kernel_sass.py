"""Instructions per element in a decode kernel's main loop, read off its SASS for sm_90 on a machine without a
GPU (Triton compiles for a target it names; its package carries ptxas and cuobjdump).

    .venv/bin/python bench/kernel_sass.py OUT.json [stream BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES ...]
    .venv/bin/python bench/kernel_sass.py OUT.json kivi [BITS,BLOCK_N,WARPS,STAGES ...]
    .venv/bin/python bench/kernel_sass.py OUT.json gemv [BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,PREFETCH[,PDL[,FUSE[,L2]]]]] ...]
    .venv/bin/python bench/kernel_sass.py OUT.json attention [KIND,BLOCK_M,BLOCK_N,WARPS,STAGES,MASK_SPLIT,LAZY,COMMON[,MAGIC[,LOAD[,HALF[,MAXREG[,WINDOW]]]]]] ...]
    .venv/bin/python bench/kernel_sass.py OUT.json kivi_chunks [CHUNKS,WARPS,STAGES,MAXREG,MAGIC ...]

- stream: the int4 stream kernel (kernels/quant_gemv.py), instructions a code. A decode GEMV over int4 words is
  bound by the instructions it issues per code before it is bound by memory (that module's docstring).
- kivi: paged attention's decode over a KIVI pool (kernels/paged_attention.py, whole-page tiles), instructions
  per key or value element: the 4B model's attention (4 query heads a KV head, head_dim 256, pages of 32 keys,
  value groups of 32 channels).
- attention: the paged attention's loop per key tile (kernels/paged_attention.py) at the 4B model's heads, a bf16
  pool (KIND 0) or an int2 KIVI pool (KIND 2), with its loop variants MASK_SPLIT and LAZY_RESCALE; instructions per
  score element (a query row's key). COMMON 1 compiles a copy of the kernel whose variant branches (a tile that needs
  its masks, a maximum that grew past RESCALE_LOG2) never run: the path nearly every tile of a long prefix takes,
  where the plain count holds both sides of each branch.
- kivi_chunks: the same decode over an int2 pool through kernels/kivi_decode.py, the head in CHUNKS chunks (0: the
  general kernel), MAXREG a register cap for ptxas (0: none), MAGIC 1 the magic exponent in a register; what
  counts here is the registers a thread (programs a multiprocessor) beside the instructions an element.
- gemv: the bf16 decode GEMV (kernels/gemv.py), instructions per weight element, at K a multiple of BLOCK_K (every
  4B decode shape), compiled without a split over K (a split changes only the epilogue, whose loop over the
  splits' partials can outgrow a short main loop and be counted instead). FUSE 1 counts the RMSNorm fused in
  front (each x unit normed in the loop), 2 the residual add behind (epilogue only: the loop as plain), 3 Gated
  DeltaNet's output norm in front (each tile's heads normed and gated in the loop), 4 that and the residual add. bf16 at 4.3 TB/s is 8 weight elements a cycle an SM against 128 lane
  instructions issued, so here the count matters less than for int4, but every instruction in the loop is one the
  warp issues instead of a load.

The main loop is the backward branch spanning the most code; each kernel is compiled as its launcher
specializes it at the 4B shapes (pointers and 16-divisible integer arguments marked so)."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

STREAM_CONFIGS = ["1,64,128,4,3", "1,128,128,4,3", "1,256,128,4,3", "1,256,128,8,3", "1,512,128,8,2",
                  "4,128,64,4,3", "4,128,128,4,3", "4,64,128,4,3"]
KIVI_CONFIGS = ["2,64,4,2", "2,64,8,2", "4,64,4,2"]
GEMV_CONFIGS = ["1,16,512,4,1", "1,16,512,4,3", "1,32,256,4,1", "1,32,256,4,4", "1,8,512,4,1", "1,64,128,4,3",
                "16,32,128,4,4", "16,64,128,4,4"]


def _stream(spec: str) -> tuple[object, dict, dict, dict, float, set]:
    """(kernel, pointer types, constants, launch options, elements a thread per loop iteration, integer arguments
    that are not 16-divisible at the 4B shapes); bf16 rows, as the engine's decode passes them (int32 pairs)."""
    from headroom.kernels.quant_gemv import quant_stream_kernel

    block_m, block_n, block_k, warps, stages = map(int, spec.split(","))
    pointers = {"x": "*i32", "w": "*i32", "s": "*bf16", "z": "*i32", "o": "*bf16", "ws": "*fp32", "counters": "*i32"}
    constants = {"HAS_ZERO": False, "ZERO": 8, "SCALE_BK": 128, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "BLOCK_K": block_k, "SPLIT": True, "NUM_STAGES": stages, "EVEN_K": True, "X_PAIRS": True}
    return (quant_stream_kernel, pointers, constants, {"num_warps": warps, "num_stages": stages},
            block_n * block_k / (32 * warps), {"M", "stride_sn", "stride_zn", "num_splits"})


def _gemv(spec: str) -> tuple[object, dict, dict, dict, float, set]:
    """The same for kernels/gemv.py: bf16 weight elements a thread per loop iteration. Constants the kernel does
    not take are left out, so that one spec counts the kernel of any commit (before/after figures)."""
    from headroom.kernels.gemv import gemv_fwd_kernel

    fields = [int(x) for x in spec.split(",")]
    block_m, block_n, block_k, warps, stages = fields[:5]
    # PREFETCH and PDL, a sixth and seventh field (1 and 0 when left out): weight tiles before the PDL wait.
    prefetch = fields[5] if len(fields) > 5 else 1
    pdl = bool(fields[6]) if len(fields) > 6 else False
    # FUSE, an eighth field (0 when left out): 1 the RMSNorm in front (NORM, Qwen3.5's unit offset), 2 the residual
    # add behind (RESIDUAL), 3 Gated DeltaNet's output norm in front (GATED, heads of 128), 4 GATED and RESIDUAL,
    # 5 Gated DeltaNet's decode conv behind (CONV, four taps), 6 NORM and CONV (its in-projection at one row).
    fuse = fields[7] if len(fields) > 7 else 0
    # L2_PREFETCH, a ninth field (0 when left out): weight tiles asked of L2 before the PDL wait.
    l2_prefetch = fields[8] if len(fields) > 8 else 0
    # One row goes in as int32 pairs where the kernel takes them (PAIRS), as its launcher passes bf16.
    pairs = block_m == 1 and "PAIRS" in gemv_fwd_kernel.arg_names
    pointers = {"x": "*i32" if pairs else "*bf16", "up": "*i32" if pairs else "*bf16",
                "w": "*i32" if pairs else "*bf16", "out": "*bf16", "ws": "*fp32", "counters": "*i32",
                "res": "*bf16", "sumsq": "*fp32", "eps": "fp32", "norm_w": "*i32" if pairs else "*bf16",
                "conv_w": "*bf16", "conv_states": "*bf16", "conv_slots": "*i32"}
    # The plain GEMV (the fused SwiGLU input is a variant of its own: SILU_MUL).
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": stages, "EVEN_K": True,
                 "SPLIT": False, "PAIRS": pairs, "SILU_MUL": False, "PDL": pdl,
                 "SWAP_AB": False, "CORE_ROWS": False, "ROW_SUM": False, "PREFETCH": prefetch,
                 "NORM": fuse in (1, 6), "UNIT_OFFSET": fuse in (1, 6), "RESIDUAL": fuse in (2, 4),
                 "GATED": fuse in (3, 4), "HEAD": 128, "CONV": fuse in (5, 6), "CONV_TAPS": 4, "CONV_BLOCK": 4,
                 "L2_PREFETCH": l2_prefetch}
    constants = {k: v for k, v in constants.items() if k in gemv_fwd_kernel.arg_names}
    # (num_parts is no specialisation key: the launcher's kernel does not specialize it)
    return (gemv_fwd_kernel, pointers, constants, {"num_warps": warps, "num_stages": stages},
            block_n * block_k / (32 * warps), {"M", "num_splits", "num_parts"})


def _paged_attention_launch(kind: int, bits: int, block_m: int, block_n: int, mask_split: bool = False,
                            lazy: bool = False) -> tuple[dict, dict]:
    """(pointer types, constants) of a paged attention launch at the 4B model's heads (GQA 4, head_dim 256): a bf16
    pool (kind 0) or a KIVI pool of 32-token pages (kind 2, bits a code), without PDL or a continued range."""
    pool = "*bf16" if kind == 0 else "*u8"
    pointers = {name: "*i32" for name in ("q_pos", "q_offsets", "kv_table", "kv_start", "kv_lens")}
    pointers.update(q="*bf16", o="*bf16" if block_m > 16 else "*fp32", lse="*fp32", k=pool, v=pool, k_scale="*fp16",
                    k_zero="*fp16", v_scale="*fp16", v_zero="*fp16", prev_o="*fp32", prev_lse="*fp32", sm_scale="fp32")
    constants = {"GROUP": 4, "HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_M": block_m, "BLOCK_N": block_n, "KIND": kind,
                 "BITS": bits, "PAGE": 32 if kind == 2 else 1, "GROUP_D": 32, "DOT_FP32": False,
                 "DOT_PRECISION": "tf32", "ROUND_TILES": True, "PAGE_TILE": kind == 2, "CONTINUE": False,
                 "PDL": False, "MASK_SPLIT": mask_split, "LAZY_RESCALE": lazy, "MAGIC_IN_REGISTER": False,
                 "LOAD_PER_TOKEN": False, "HALF_TILES": 0}
    return pointers, constants


# Integer arguments of a paged attention launch that are not 16-divisible at the 4B shapes.
_ATTENTION_NOT_DIVISIBLE = {"stride_vsh", "stride_table", "stride_ls", "NUM_SPLITS", "magic_exponent", "stride_wt"}


def _kivi(spec: str) -> tuple[object, dict, dict, dict, float, set]:
    """The same for a decode launch over a KIVI pool (one query token, 16 rows a program)."""
    from headroom.kernels.paged_attention import paged_attention_fwd_kernel

    bits, block_n, warps, stages = map(int, spec.split(","))
    pointers, constants = _paged_attention_launch(2, bits, 16, block_n)
    # A key and a value element for every (key, channel) of the tile.
    return (paged_attention_fwd_kernel, pointers, constants, {"num_warps": warps, "num_stages": stages},
            2 * block_n * 256 / (32 * warps), _ATTENTION_NOT_DIVISIBLE)


KIVI_CHUNK_CONFIGS = ["0,4,2,0,0", "0,4,2,0,1", "1,4,2,0,0", "2,4,2,0,0", "2,4,2,0,1", "4,4,2,0,0", "4,4,2,168,0",
                      "4,4,2,168,1", "2,4,2,128,0", "2,8,2,0,0"]


def _kivi_chunks(spec: str) -> tuple[object, dict, dict, dict, float, set]:
    """The int2 decode launch (16 rows, 64-key tiles) of kernels/kivi_decode.py, or of the general kernel (CHUNKS 0)."""
    from headroom.kernels.kivi_decode import kivi_decode_fwd_kernel
    from headroom.kernels.paged_attention import paged_attention_fwd_kernel

    chunks, warps, stages, maxreg, magic = map(int, spec.split(","))
    pointers, constants = _paged_attention_launch(2, 2, 16, 64)
    constants["MAGIC_IN_REGISTER"] = bool(magic)
    kernel = paged_attention_fwd_kernel
    if chunks:
        kernel = kivi_decode_fwd_kernel
        pointers = {k: t for k, t in pointers.items() if k not in ("prev_o", "prev_lse")}
        kept = ("GROUP", "HEAD_DIM", "BLOCK_D", "BLOCK_M", "BLOCK_N", "BITS", "PAGE", "GROUP_D", "DOT_FP32",
                "DOT_PRECISION", "PDL", "MAGIC_IN_REGISTER")
        constants = {k: v for k, v in constants.items() if k in kept} | {"CHUNKS": chunks}
    options = {"num_warps": warps, "num_stages": stages} | ({"maxnreg": maxreg} if maxreg else {})
    return kernel, pointers, constants, options, 2 * 64 * 256 / (32 * warps), _ATTENTION_NOT_DIVISIBLE


# The engine's prefill tiles over a bf16 pool and over an int2 pool, and its int2 decode tile.
ATTENTION_CONFIGS = ["0,128,64,8,3,0,0,0", "0,128,64,8,3,1,1,0", "0,128,64,8,3,1,0,1", "0,128,64,8,3,0,1,1",
                     "0,128,64,8,3,1,1,1", "2,128,64,8,2,0,0,0", "2,128,64,8,2,1,1,0", "2,128,64,8,2,1,1,1",
                     "2,16,64,4,2,0,0,0", "2,16,64,4,2,1,1,1"]


def _attention(spec: str) -> tuple[object, dict, dict, dict, float, set]:
    """The same for the paged attention's loop: score elements (query row x key) a thread per key tile."""
    import importlib.util
    import tempfile

    from headroom.kernels import paged_attention as module

    fields = [int(x) for x in spec.split(",")]
    # MAGIC, a ninth field (0 when left out): the KIVI int-to-float exponent in a register (MAGIC_IN_REGISTER);
    # LOAD, a tenth: each packed KIVI byte loaded once per token it holds (LOAD_PER_TOKEN).
    kind, block_m, block_n, warps, stages, mask_split, lazy, common = fields[:8]
    magic = fields[8] if len(fields) > 8 else 0
    load_per_token = fields[9] if len(fields) > 9 else 0
    # HALF, an eleventh: fp16 KIVI tiles (HALF_TILES: 1 their codes in Triton, as the interpreter runs them; 2 by
    # inline PTX, as the GPU does).
    half_tiles = fields[10] if len(fields) > 10 else 0
    # MAXREG, a twelfth: a register cap for ptxas (maxnreg; 0 none), as the tuning's max_registers.
    max_registers = fields[11] if len(fields) > 11 else 0
    # WINDOW, a thirteenth: a decode launch with its residual windows' program (a graphed KIVI step's).
    window = fields[12] if len(fields) > 12 else 0
    if common:
        source = Path(module.__file__).read_text()
        for branch in ("if j0 + BLOCK_N > seen_by_all:", "if grow > RESCALE_LOG2:"):
            if branch not in source:
                raise RuntimeError(f"kernels/paged_attention.py has no {branch!r} to take out")
            source = source.replace(branch, "if False:")
        copy = Path(tempfile.mkdtemp()) / "paged_attention_common_path.py"
        copy.write_text(source)
        loaded = importlib.util.spec_from_file_location("paged_attention_common_path", copy)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    pointers, constants = _paged_attention_launch(kind, 2 if kind == 2 else 0, block_m, block_n, bool(mask_split),
                                                  bool(lazy))
    constants["MAGIC_IN_REGISTER"] = bool(magic)
    constants["LOAD_PER_TOKEN"] = bool(load_per_token)
    constants["HALF_TILES"] = half_tiles
    pointers.update(w_table="*i32", w_start="*i32", w_lens="*i32", w_k="*bf16", w_v="*bf16")
    constants.update(WINDOW=window, BLOCK_W=module.WINDOW_BLOCK)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": max_registers} if max_registers else {})}
    return (module.paged_attention_fwd_kernel, pointers, constants, options, block_m * block_n / (32 * warps),
            _ATTENTION_NOT_DIVISIBLE)


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (opcode names, predicates dropped)."""
    rows = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)]
    loops = [(at - int(t.group(1), 16), int(t.group(1), 16), at) for at, text in rows
             if (t := re.search(r"BRA (0x[0-9a-f]+)", text)) and int(t.group(1), 16) < at]
    _, start, end = max(loops)
    return [re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0] for at, text in rows if start <= at <= end]


def count(kernel, pointers: dict, constants: dict, options: dict, elements: float, not_divisible: set) -> dict:
    """Compile for sm_90 and count the main loop: instructions, their mix, registers a thread."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    # Pointers and integer arguments as Triton specializes the 4B shapes: 16-divisible but for those named.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constants and signature[n] != "fp32" and n not in not_divisible}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    cubin = Path("/tmp/kernel_sass.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    ops = main_loop(sass)
    return {"loop_instructions": len(ops), "elements_per_thread": elements,
            "instructions_per_element": round(len(ops) / elements, 2),
            "registers": int(registers.group(1)) if registers else None,
            # Register spills: local-memory stores and loads, in the loop and in the whole kernel.
            "spills_in_loop": sum(op in ("STL", "LDL") for op in ops),
            "spills_in_kernel": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
            # prefetch.global.L2 (gemv's L2_PREFETCH) compiles to CCTL.E.PF2, outside the loop
            "l2_prefetches_in_kernel": len(re.findall(r"\bCCTL\.E\.PF2\b", sass)),
            "opcodes": dict(collections.Counter(ops).most_common(14))}


def main() -> None:
    out = Path(sys.argv[1])
    subjects = {"stream": (_stream, STREAM_CONFIGS), "kivi": (_kivi, KIVI_CONFIGS), "gemv": (_gemv, GEMV_CONFIGS),
                "attention": (_attention, ATTENTION_CONFIGS), "kivi_chunks": (_kivi_chunks, KIVI_CHUNK_CONFIGS)}
    subject = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] in subjects else "stream"
    build, defaults = subjects[subject]
    specs = [a for a in sys.argv[2:] if a != subject] or defaults
    results = []
    for spec in specs:
        row = {"config": spec, **count(*build(spec))}
        results.append(row)
        print(f"{subject} {spec}: {row['instructions_per_element']} an element ({row['loop_instructions']} in the "
              f"loop, {row['registers']} registers)", row["opcodes"])
    fields = {"stream": "BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES", "kivi": "BITS,BLOCK_N,WARPS,STAGES",
              "gemv": "BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,PREFETCH[,PDL[,FUSE[,L2]]]]",
              "attention": "KIND,BLOCK_M,BLOCK_N,WARPS,STAGES,MASK_SPLIT,LAZY,COMMON[,MAGIC[,LOAD[,HALF[,MAXREG[,WINDOW]]]]]",
              "kivi_chunks": "CHUNKS,WARPS,STAGES,MAXREG,MAGIC"}[subject]
    out.write_text(json.dumps({"command": "python3 bench/kernel_sass.py " + " ".join(sys.argv[1:]),
                               "triton": triton.__version__, "target": "cuda sm_90", "subject": subject,
                               "config_fields": fields, "rows": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
