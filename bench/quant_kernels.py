"""Quantized-weight GEMM on the GPU (issue 19): kernels/quant_matmul.py against its references at the
Qwen3.5-4B linears' real sizes, bf16 activations. For each format (fp8 128x128 blocks, int4 group 128
symmetric and asymmetric), each weight shape and M rows:
- error of the Triton GEMM and of dequantize-then-cuBLAS against fp32 math on the same dequantized weight,
  beside the error of a plain bf16 matmul on that weight (bf16's own distance, the bar);
- microseconds of each path and of cuBLAS on the dense bf16 weight, and the GEMM's bandwidth share at small M;
- dequantize_fwd against naive_dequantize (exact).

Run on the H200 (about a minute):
    source bench/device_env.sh && python3 bench/quant_kernels.py $OUT/quant_kernels.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

# (name, N, K) of the 4B-shaped model's quantized linears (lm_head and the GDN a/b stay bf16).
SHAPES = [("qkv_gdn", 8192, 2560), ("attn_kv", 1024, 2560), ("out_proj", 2560, 4096), ("gate_up", 9216, 2560),
          ("down", 2560, 9216)]
ROWS = (1, 8, 16, 64, 256, 1024, 8192)


def bench_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Graph replay: launch overhead out, as in the engine's decode graphs.
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    from headroom.kernels.quant_matmul import dequantize_fwd, quant_matmul
    from headroom.kernels.quant_pack import quantize_fp8_block, quantize_int4_group
    from headroom.kernels.quant_weight import QuantizedWeight, naive_dequantize

    dev = torch.device("cuda")
    hbm = 4.2e12
    out: dict = {"command": "python3 bench/quant_kernels.py " + sys.argv[1], "gpu": torch.cuda.get_device_name(),
                 "cases": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, n, k in SHAPES:
        dense = torch.randn(n, k, device=dev, generator=gen) * 0.02
        weights = {}
        data, scale = quantize_fp8_block(dense, (128, 128))
        weights["fp8"] = QuantizedWeight("fp8_block", data, scale, None, n, k, (128, 128))
        for sym in (True, False):
            packed, s4, zero = quantize_int4_group(dense.bfloat16(), 128, sym)
            weights["int4_sym" if sym else "int4_asym"] = QuantizedWeight("int4_group", packed, s4, zero, n, k, (1, 128))
        dense_bf16 = dense.bfloat16()
        for fmt, weight in weights.items():
            w32 = naive_dequantize(weight)
            exact = bool(torch.equal(dequantize_fwd(weight, torch.float32), w32))
            wq16 = w32.bfloat16()
            for m in ROWS:
                x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
                ref = x.float() @ w32.t()
                scale_ref = float(ref.abs().max())
                gemm = quant_matmul(x, weight, dense_min_rows=1 << 30)
                deq = quant_matmul(x, weight, dense_min_rows=1)
                plain = (x @ wq16.t()).float()
                case = {"shape": name, "N": n, "K": k, "M": m, "format": fmt, "dequantize_exact": exact,
                        "ref_abs_max": scale_ref,
                        "gemm_max_abs_err": float((gemm.float() - ref).abs().max()),
                        "dequant_cublas_max_abs_err": float((deq.float() - ref).abs().max()),
                        "bf16_matmul_max_abs_err": float((plain - ref).abs().max()),
                        "gemm_us": bench_us(lambda x=x, w=weight: quant_matmul(x, w, dense_min_rows=1 << 30)),
                        "dequant_cublas_us": bench_us(lambda x=x, w=weight: quant_matmul(x, w, dense_min_rows=1)),
                        "dense_bf16_us": bench_us(lambda x=x, d=dense_bf16: x @ d.t())}
                case["gemm_hbm_share"] = weight.nbytes / hbm / (case["gemm_us"] * 1e-6)
                case["dense_hbm_share"] = dense_bf16.numel() * 2 / hbm / (case["dense_bf16_us"] * 1e-6)
                out["cases"].append(case)
                print(json.dumps(case), flush=True)
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    bad = [c for c in out["cases"] if not c["dequantize_exact"] or
           c["gemm_max_abs_err"] > 4 * c["bf16_matmul_max_abs_err"] + 1e-3 * c["ref_abs_max"]]
    out["gemm_within_bf16_distance"] = not bad
    out["worst"] = sorted(out["cases"], key=lambda c: -c["gemm_max_abs_err"] / max(c["ref_abs_max"], 1e-9))[:5]
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    print("gemm within bf16 distance:", not bad, flush=True)


if __name__ == "__main__":
    main()
