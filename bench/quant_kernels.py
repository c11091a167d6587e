"""Quantized-weight GEMM on the GPU (issue 19): kernels/quant_matmul.py against its references at the
Qwen3.5-4B linears' real sizes, bf16 activations. For each format (fp8 128x128 blocks, int4 group 128
symmetric and asymmetric), each weight shape and M rows:
- error of the Triton GEMM and of dequantize-then-cuBLAS against fp32 math on the same dequantized weight,
  beside the error of a plain bf16 matmul on that weight (bf16's own distance, the bar);
- microseconds of each path (the swap-AB decode kernel, the M-major GEMM, dequantize-then-cuBLAS) and of cuBLAS
  on the dense bf16 weight, each call on another of several copies of the weight (more bytes than the 50 MB L2,
  as decode streams every layer's weights once), and each kernel's share of HBM bandwidth at small M;
- dequantize_fwd against naive_dequantize (exact).

Run on the H200 (about a minute):
    source bench/device_env.sh && python3 bench/quant_kernels.py $OUT/quant_kernels.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

# (name, N, K) of the 4B-shaped model's quantized linears (lm_head and the GDN a/b stay bf16).
SHAPES = [("qkv_gdn", 8192, 2560), ("attn_kv", 1024, 2560), ("out_proj", 2560, 4096), ("gate_up", 9216, 2560),
          ("down", 2560, 9216)]
ROWS = tuple(int(r) for r in os.environ.get("QUANT_KERNELS_ROWS", "1,2,4,8,16,64,256,1024,8192").split(","))


# Copies of each weight cycled through, so that a call finds none of its weight in L2.
COPY_BYTES = 400 * 2**20


def bench_us(fn, copies: list, iters: int = 20) -> float:
    """Microseconds of fn(copy) per call, averaged over the copies, under CUDA-graph replay (no launch gaps,
    as in the engine's decode graphs)."""
    for c in copies:
        fn(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in copies:
            fn(c)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters / len(copies) * 1e6


def main() -> None:
    from headroom.kernels.quant_matmul import dequantize_fwd, quant_matmul, quant_matmul_fwd
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
        num_copies = max(2, -(-COPY_BYTES // (n * k * 2)))
        dense_copies = [dense_bf16.clone() for _ in range(num_copies)]
        for fmt, weight in weights.items():
            from dataclasses import replace

            copies = [replace(weight, data=weight.data.clone(), scale=weight.scale.clone()) for _ in range(num_copies)]
            w32 = naive_dequantize(weight)
            exact = bool(torch.equal(dequantize_fwd(weight, torch.float32), w32))
            wq16 = w32.bfloat16()
            for m in ROWS:
                x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
                ref = x.float() @ w32.t()
                scale_ref = float(ref.abs().max())
                gemm = quant_matmul(x, weight, dense_min_rows=1 << 30)
                swap = quant_matmul_fwd(x, weight, kernel="swap_ab") if m <= 64 else None
                cores = quant_matmul_fwd(x, weight, kernel="cores") if m <= 4 else None
                major = quant_matmul_fwd(x, weight, kernel="m_major")
                deq = quant_matmul(x, weight, dense_min_rows=1)
                plain = (x @ wq16.t()).float()
                case = {"shape": name, "N": n, "K": k, "M": m, "format": fmt, "dequantize_exact": exact,
                        "ref_abs_max": scale_ref,
                        "gemm_max_abs_err": float((gemm.float() - ref).abs().max()),
                        "m_major_max_abs_err": float((major.float() - ref).abs().max()),
                        "swap_ab_max_abs_err": float((swap.float() - ref).abs().max()) if swap is not None else None,
                        "cores_max_abs_err": float((cores.float() - ref).abs().max()) if cores is not None else None,
                        "dequant_cublas_max_abs_err": float((deq.float() - ref).abs().max()),
                        "bf16_matmul_max_abs_err": float((plain - ref).abs().max()),
                        "m_major_us": bench_us(lambda w, x=x: quant_matmul_fwd(x, w, kernel="m_major"), copies),
                        "swap_ab_us": bench_us(lambda w, x=x: quant_matmul_fwd(x, w, kernel="swap_ab"), copies)
                        if m <= 64 else None,
                        "cores_us": bench_us(lambda w, x=x: quant_matmul_fwd(x, w, kernel="cores"), copies)
                        if m <= 4 else None,
                        "dequant_cublas_us": bench_us(lambda w, x=x: quant_matmul(x, w, dense_min_rows=1), copies),
                        "dense_bf16_us": bench_us(lambda d, x=x: x @ d.t(), dense_copies)}
                kernel_us = min(v for v in (case["m_major_us"], case["swap_ab_us"], case["cores_us"]) if v is not None)
                case["kernel_hbm_share"] = weight.nbytes / hbm / (kernel_us * 1e-6)
                case["dense_hbm_share"] = dense_bf16.numel() * 2 / hbm / (case["dense_bf16_us"] * 1e-6)
                out["cases"].append(case)
                print(json.dumps(case), flush=True)
        del copies, dense_copies
        torch.cuda.empty_cache()
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    bad = [c for c in out["cases"] if not c["dequantize_exact"] or
           max(c["gemm_max_abs_err"], c["m_major_max_abs_err"], c["swap_ab_max_abs_err"] or 0.0,
               c["cores_max_abs_err"] or 0.0)
           > 4 * c["bf16_matmul_max_abs_err"] + 1e-3 * c["ref_abs_max"]]
    out["gemm_within_bf16_distance"] = not bad
    out["worst"] = sorted(out["cases"], key=lambda c: -c["gemm_max_abs_err"] / max(c["ref_abs_max"], 1e-9))[:5]
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    print("gemm within bf16 distance:", not bad, flush=True)


if __name__ == "__main__":
    main()
