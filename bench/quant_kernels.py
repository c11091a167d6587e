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


# Candidate configurations of the stream kernel (block_n, block_k, num_warps, num_stages, programs_per_sm),
# timed at one and four rows on every shape (int4 symmetric) beside the default for that bucket. Wide row
# blocks first: each thread then holds more rows of the same word lanes, so x's loads and the per-lane scale
# work are shared by more codes (bench/kernel_sass.py: 5.5 instructions a code at 64 x 128, 4.3 at 256 x 128).
SWEEP_CONFIGS = [(128, 128, 4, 3, 2), (256, 128, 4, 3, 2), (256, 128, 8, 3, 4), (128, 128, 4, 3, 6),
                 (128, 128, 4, 3, 8), (128, 128, 4, 2, 4), (64, 128, 4, 3, 4), (64, 128, 4, 3, 8),
                 (128, 64, 4, 3, 2), (128, 64, 4, 3, 4), (32, 128, 4, 3, 4)]
# A shape gets a table entry only where its best candidate beats the default by this much (timing noise).
TABLE_MARGIN = 0.03
# Seconds the sweep may take (QUANT_KERNELS_SWEEP_S): candidates after that are recorded as skipped, so that
# the rows and the table so far are saved inside the part's limit.
SWEEP_SECONDS = float(os.environ.get("QUANT_KERNELS_SWEEP_S", "90"))


def stream_sweep(weights_by_shape: dict, dev: torch.device, gen: torch.Generator, save=lambda partial: None) -> dict:
    """Microseconds of the default and each candidate configuration per (shape, rows 1 and 4), and the table
    kernels/quant_gemv_tuned_configs.json ships from them: per shape and row bucket, the fastest candidate where
    it beats the default by TABLE_MARGIN. save(result so far) after each shape, so a run cut short keeps it."""
    from dataclasses import astuple

    from headroom.kernels.quant_gemv import StreamConfig, default_config, quant_stream_fwd
    from headroom.kernels.quant_weight import naive_dequantize

    rows_out: list[dict] = []
    table: list[dict] = []
    deadline = time.perf_counter() + SWEEP_SECONDS
    for (_fmt, name), copies in weights_by_shape.items():
        n, k = copies[0].out_features, copies[0].in_features
        for m in (1, 4):
            x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
            ref = x.float() @ naive_dequantize(copies[0]).t()
            timed: dict[tuple, float] = {}
            for cfg in [astuple(default_config(m))] + SWEEP_CONFIGS:
                config = StreamConfig(*cfg)
                err = None
                if time.perf_counter() > deadline:
                    rows_out.append({"shape": name, "M": m, "config": cfg, "us": None, "error": "skipped: time"})
                    continue
                try:
                    err = float((quant_stream_fwd(x, copies[0], config).float() - ref).abs().max())
                    us = bench_us(lambda w, x=x, config=config: quant_stream_fwd(x, w, config), copies, iters=10)
                except Exception as exc:  # a configuration the compiler rejects (registers, shared memory)
                    us, error = None, f"{type(exc).__name__}: {str(exc)[:120]}"
                else:
                    error = None
                    # A configuration is a candidate only if it computes the same product (bf16 output rounding).
                    if err <= 2e-2 * float(ref.abs().max()):
                        timed[cfg] = us
                rows_out.append({"shape": name, "M": m, "config": cfg, "us": us, "max_abs_err": err,
                                 "ref_abs_max": float(ref.abs().max()), "error": error})
            # The default with bf16 rows read 2 bytes at a time, beside the int32 pairs every row above used.
            try:
                rows_out.append({"shape": name, "M": m, "config": astuple(default_config(m)), "x_pairs": False,
                                 "us": bench_us(lambda w, x=x: quant_stream_fwd(x, w, x_pairs=False), copies, iters=10)})
            except Exception as exc:
                rows_out.append({"shape": name, "M": m, "x_pairs": False, "us": None, "error": str(exc)[:120]})
            default_us = timed.get(astuple(default_config(m)))
            best = min(timed, key=timed.get) if timed else None
            if best is not None and default_us is not None and timed[best] < (1 - TABLE_MARGIN) * default_us:
                table.append({"layer": name, "n": n, "k": k, "m": m, "us": round(timed[best], 2),
                              "default_us": round(default_us, 2),
                              **dict(zip(("block_n", "block_k", "num_warps", "num_stages", "programs_per_sm"),
                                         best, strict=True))})
        save({"rows": rows_out, "table": table})
    return {"fields": "config = (block_n, block_k, num_warps, num_stages, programs_per_sm); the first "
                      "row of each (shape, M) is the default", "rows": rows_out, "table": table}


def write_stream_table(table: list[dict], out_dir: Path) -> None:
    """The sweep's table into OUTDIR (to commit) and into this checkout's kernels/, so that the benches after
    this one in the same call (quant_weights) run it."""
    from headroom.kernels import quant_gemv
    from headroom.kernels.tuned_table import table_text

    text = table_text(torch.device("cuda"), table, "H200, python3 bench/quant_kernels.py OUT (stream_sweep): "
                      "the fastest candidate per shape and row bucket where it beat the default by 3%",
                      quant_gemv.TUNED_CONFIGS)
    (out_dir / "quant_gemv_tuned_configs.json").write_text(text)
    quant_gemv.TUNED_CONFIGS.write_text(text)
    quant_gemv._tuned = None


def main() -> None:
    from headroom.kernels.quant_matmul import dequantize_fwd, pick_kernel, quant_matmul, quant_matmul_fwd
    from headroom.kernels.quant_pack import quantize_fp8_block, quantize_int4_group
    from headroom.kernels.quant_weight import QuantizedWeight, naive_dequantize

    dev = torch.device("cuda")
    hbm = 4.2e12
    out: dict = {"command": "python3 bench/quant_kernels.py " + sys.argv[1], "gpu": torch.cuda.get_device_name(),
                 "cases": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    sweep_weights: dict = {}
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
            if fmt == "int4_sym":
                sweep_weights[(fmt, name)] = copies
            w32 = naive_dequantize(weight)
            exact = bool(torch.equal(dequantize_fwd(weight, torch.float32), w32))
            wq16 = w32.bfloat16()
            for m in ROWS:
                x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
                ref = x.float() @ w32.t()
                scale_ref = float(ref.abs().max())
                gemm = quant_matmul(x, weight, dense_min_rows=1 << 30)
                swap = quant_matmul_fwd(x, weight, kernel="swap_ab") if m <= 64 else None
                cores = quant_matmul_fwd(x, weight, kernel="cores") if m <= 4 and fmt == "fp8" else None
                streams = m <= 4 and weight.method == "int4_group"
                stream = quant_matmul_fwd(x, weight, kernel="stream") if streams else None
                major = quant_matmul_fwd(x, weight, kernel="m_major")
                deq = quant_matmul(x, weight, dense_min_rows=1)
                plain = (x @ wq16.t()).float()
                case = {"shape": name, "N": n, "K": k, "M": m, "format": fmt, "dequantize_exact": exact,
                        "ref_abs_max": scale_ref,
                        "gemm_max_abs_err": float((gemm.float() - ref).abs().max()),
                        "m_major_max_abs_err": float((major.float() - ref).abs().max()),
                        "swap_ab_max_abs_err": float((swap.float() - ref).abs().max()) if swap is not None else None,
                        "cores_max_abs_err": float((cores.float() - ref).abs().max()) if cores is not None else None,
                        "stream_max_abs_err": float((stream.float() - ref).abs().max()) if stream is not None else None,
                        "dequant_cublas_max_abs_err": float((deq.float() - ref).abs().max()),
                        "bf16_matmul_max_abs_err": float((plain - ref).abs().max()),
                        "m_major_us": bench_us(lambda w, x=x: quant_matmul_fwd(x, w, kernel="m_major"), copies),
                        "swap_ab_us": bench_us(lambda w, x=x: quant_matmul_fwd(x, w, kernel="swap_ab"), copies)
                        if m <= 64 else None,
                        "cores_us": bench_us(lambda w, x=x: quant_matmul_fwd(x, w, kernel="cores"), copies)
                        if cores is not None else None,
                        "stream_us": bench_us(lambda w, x=x: quant_matmul_fwd(x, w, kernel="stream"), copies)
                        if streams else None,
                        "picked": pick_kernel(x, weight),
                        "dequant_cublas_us": bench_us(lambda w, x=x: quant_matmul(x, w, dense_min_rows=1), copies),
                        "dense_bf16_us": bench_us(lambda d, x=x: x @ d.t(), dense_copies)}
                kernel_us = min(v for v in (case["m_major_us"], case["swap_ab_us"], case["cores_us"], case["stream_us"])
                                if v is not None)
                case["kernel_hbm_share"] = weight.nbytes / hbm / (kernel_us * 1e-6)
                case["dense_hbm_share"] = dense_bf16.numel() * 2 / hbm / (case["dense_bf16_us"] * 1e-6)
                out["cases"].append(case)
                print(json.dumps(case), flush=True)
        del copies, dense_copies
        torch.cuda.empty_cache()
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    if os.environ.get("QUANT_KERNELS_SWEEP", "1") == "1":
        def save(partial: dict) -> None:
            out["stream_sweep"] = {"partial": partial}
            Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
            write_stream_table(partial["table"], Path(sys.argv[1]).parent)

        out["stream_sweep"] = stream_sweep(sweep_weights, dev, gen, save)
        print(json.dumps(out["stream_sweep"]["table"]), flush=True)
    del sweep_weights
    bad = [c for c in out["cases"] if not c["dequantize_exact"] or
           max(c["gemm_max_abs_err"], c["m_major_max_abs_err"], c["swap_ab_max_abs_err"] or 0.0,
               c["cores_max_abs_err"] or 0.0, c["stream_max_abs_err"] or 0.0)
           > 4 * c["bf16_matmul_max_abs_err"] + 1e-3 * c["ref_abs_max"]]
    out["gemm_within_bf16_distance"] = not bad
    out["worst"] = sorted(out["cases"], key=lambda c: -c["gemm_max_abs_err"] / max(c["ref_abs_max"], 1e-9))[:5]
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    print("gemm within bf16 distance:", not bad, flush=True)


if __name__ == "__main__":
    main()
