"""Whether programmatic dependent launch (PDL) shortens a graphed chain of small dependent kernels on this GPU,
the shape of a decode step (about 430 kernels of 1-15 us each on the 4B model, session 10).

    python3 bench/pdl_probe.py OUT.json      (CUDA, Triton with launch_pdl: 3.3 or later)

Two chains, each captured in one CUDA graph and replayed: `tiny` (y = x * a + b over 40K elements, ~2 us) and
`stream` (each kernel also reads its own 4 MiB slab of weights, like a decode GEMV, then adds x). Each chain runs
plain, and launched with PDL where every kernel first lets its dependent launch and then waits on its producer
(gdc_launch_dependents, gdc_wait), and in `stream` also with the weight loads issued before the wait. Reports us
a kernel and the saving."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).parent))  # the bench's siblings, under PYTHONSAFEPATH too
from decode_parts import graph_replay_us  # noqa: E402

CHAIN = 200


@triton.jit
def tiny_kernel(x, y, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y + o, tl.load(x + o, mask=m) * 1.0001 + 1.0, mask=m)


@triton.jit
def stream_kernel(x, w, y, n, per_program, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    """Program i sums its per_program weights (read in BLOCK chunks), then y[i] = x[i] + that sum."""
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
        if not EARLY:
            gdc_wait()
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(0, per_program, BLOCK):
        acc += tl.load(w + pid * per_program + k + tl.arange(0, BLOCK)).to(tl.float32)
    if PDL and EARLY:
        gdc_wait()  # the weights do not depend on the producer: only x does
    total = tl.sum(acc, 0)
    tl.store(y + pid, tl.load(x + pid) + total)


def main(path: str) -> None:
    out: dict = {"command": "python3 bench/pdl_probe.py " + path, "gpu": torch.cuda.get_device_name(),
                 "triton": triton.__version__, "torch": torch.__version__, "chain": CHAIN}
    n = 40960
    bufs = [torch.randn(n, device="cuda") for _ in range(2)]

    def tiny(pdl: bool):
        def launch():
            for i in range(CHAIN):
                tiny_kernel[(triton.cdiv(n, 1024),)](bufs[i % 2], bufs[(i + 1) % 2], n, PDL=pdl, BLOCK=1024,
                                                      launch_pdl=pdl)
        return launch

    out["tiny_plain_us"] = graph_replay_us(tiny(False), CHAIN, 20)
    out["tiny_pdl_us"] = graph_replay_us(tiny(True), CHAIN, 20)
    programs, per_program = 264, 8192  # 264 x 8192 bf16 = 4.3 MB a kernel
    weights = [torch.randn(programs * per_program, device="cuda", dtype=torch.bfloat16) for _ in range(CHAIN // 10)]
    xs = [torch.zeros(programs, device="cuda") for _ in range(2)]

    def streamed(pdl: bool, early: bool):
        def launch():
            for i in range(CHAIN):
                stream_kernel[(programs,)](xs[i % 2], weights[i % len(weights)], xs[(i + 1) % 2], programs,
                                           per_program, PDL=pdl, EARLY=early, BLOCK=1024, launch_pdl=pdl)
        return launch

    out["stream_plain_us"] = graph_replay_us(streamed(False, False), CHAIN, 20)
    out["stream_pdl_us"] = graph_replay_us(streamed(True, False), CHAIN, 20)
    out["stream_pdl_early_us"] = graph_replay_us(streamed(True, True), CHAIN, 20)
    out["stream_bytes_per_kernel"] = programs * per_program * 2
    out["stream_plain_TBps"] = out["stream_bytes_per_kernel"] / out["stream_plain_us"] / 1e6
    out["stream_pdl_early_TBps"] = out["stream_bytes_per_kernel"] / out["stream_pdl_early_us"] / 1e6
    # Correctness of the chains: the PDL chain must compute what the plain one does.
    for pdl in (False, True):
        bufs[0].fill_(1.0)
        tiny(pdl)()
        torch.cuda.synchronize()
        out[f"tiny_result_pdl{int(pdl)}"] = float(bufs[CHAIN % 2].sum())
    for pdl, early in ((False, False), (True, True)):
        xs[0].zero_()
        streamed(pdl, early)()
        torch.cuda.synchronize()
        out[f"stream_result_pdl{int(pdl)}"] = float(xs[CHAIN % 2].double().sum())
    text = json.dumps(out, indent=1)
    print(text)
    open(path, "w").write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
