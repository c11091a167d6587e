"""What kernels/compile_ahead.py's thread pool can gain: Triton compiles for sm_90 on this machine's CPUs (no GPU;
Triton ships ptxas), one thread against a pool, how much of a compile holds the GIL, and the memory the pool costs.

    python3 bench/compile_threads.py OUT.json [THREADS]

- The subject: eight variants of a FlashAttention-style loop (tile sizes and stages), each compiled once, first
  one after another, then on a pool of THREADS (default 2), each in an empty Triton cache.
- GIL share: a Python thread counting in a loop while the main thread compiles seven variants loses count while
  a compile holds the GIL; the time it lost over the same compiles' time alone.
- Memory: peak RSS growth of a process that compiles the eight variants on 1, 2 and 4 threads (one child each,
  its own high-water mark).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def attention_loop(q_ptr, k_ptr, v_ptr, o_ptr, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                   STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :])
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for start in tl.range(0, n, BLOCK_N, num_stages=STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        s = tl.dot(q, tl.load(k_ptr + offs_n[None, :] * D + offs_d[:, None]))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), tl.load(v_ptr + offs_n[:, None] * D + offs_d[None, :]))
        m = m_new
    tl.store(o_ptr + offs_m[:, None] * D + offs_d[None, :], (acc / total[:, None]).to(tl.bfloat16))


VARIANTS = [dict(BLOCK_M=bm, BLOCK_N=bn, D=128, STAGES=st) for bm in (64, 128) for bn in (32, 64) for st in (2, 3)]
SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "n": "i32"}


def compile_one(constants: dict) -> float:
    started = time.perf_counter()
    triton.compile(ASTSource(attention_loop, {**SIGNATURE, **{k: "constexpr" for k in constants}}, constants),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return time.perf_counter() - started


def fresh_cache() -> None:
    # Triton reads its cache directory per compile: a new one makes every variant compile again.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-threads-")


def wall(threads: int) -> float:
    fresh_cache()
    started = time.perf_counter()
    if threads == 1:
        for constants in VARIANTS:
            compile_one(constants)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(compile_one, VARIANTS))
    return time.perf_counter() - started


def gil_share() -> dict:
    """A compile's share of the GIL: a Python thread counting in a loop while the main thread compiles seven
    variants loses count for every moment a compile holds the GIL; that time over the same compiles' time alone."""
    fresh_cache()
    compile_one(VARIANTS[0])  # the first compile's one-time set-up, out of the measurement
    alone = sum(compile_one(constants) for constants in VARIANTS[1:])
    fresh_cache()
    compile_one(VARIANTS[0])
    stop, count = threading.Event(), [0]

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(1.0)
    alone_rate = count[0] / 1.0
    count[0] = 0
    started = time.perf_counter()
    for constants in VARIANTS[1:]:
        compile_one(constants)
    seconds = time.perf_counter() - started
    stop.set()
    spinner.join()
    kept = (count[0] / seconds) / alone_rate
    return {"compiles_alone_s": alone, "compiles_beside_the_counter_s": seconds, "counter_rate_kept": kept,
            "share": (1.0 - kept) * seconds / alone}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: its own address space's high-water mark; getrusage's maxrss
    would start from the parent's peak in a child)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_growth_mb(threads: int) -> float:
    """Peak RSS growth of a child compiling every variant on `threads` threads."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import compile_threads as c; base = c.peak_rss_mb(); "
            f"c.wall({threads}); print(c.peak_rss_mb() - base)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    out = Path(sys.argv[1])
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    wall(1)  # warm the interpreter's imports and Triton's one-time set-up
    one, pool = wall(1), wall(threads)
    result = {"command": "python3 bench/compile_threads.py " + " ".join(sys.argv[1:]), "triton": triton.__version__,
              "target": "cuda sm_90 (compiled on CPUs, no GPU)", "cpus": len(os.sched_getaffinity(0)),
              "variants": len(VARIANTS), "one_thread_s": one, f"{threads}_threads_s": pool, "speedup": one / pool,
              "gil": gil_share(),
              "peak_rss_growth_mb": {n: rss_growth_mb(n) for n in (1, 2, 4)}}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
