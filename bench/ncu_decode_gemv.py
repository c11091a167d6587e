"""The decode GEMVs at one row under Nsight Compute (H200): the int4 stream kernel beside the fp8 cores kernel
and cuBLAS on the dense bf16 weight, at the 4B model's qkv shape (8192 x 2560), so that the hardware counters say
what bounds each (DRAM throughput, issue activity, stall reasons, occupancy) instead of a guess from timings.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        python3 bench/ncu_decode_gemv.py > OUT/ncu_decode_gemv.txt

Only the launches between cudaProfilerStart and Stop are profiled (each kernel twice, after a warm-up)."""

from __future__ import annotations

import torch
from headroom.kernels.quant_matmul import quant_matmul_fwd
from headroom.kernels.quant_pack import quantize_fp8_block, quantize_int4_group
from headroom.kernels.quant_weight import QuantizedWeight


def main() -> None:
    dev = torch.device("cuda")
    n, k = 8192, 2560
    gen = torch.Generator(device=dev).manual_seed(0)
    dense = torch.randn(n, k, device=dev, generator=gen) * 0.02
    packed, scale, zero = quantize_int4_group(dense.bfloat16(), 128, True)
    int4 = QuantizedWeight("int4_group", packed, scale, zero, n, k, (1, 128))
    data, fscale = quantize_fp8_block(dense, (128, 128))
    fp8 = QuantizedWeight("fp8_block", data, fscale, None, n, k, (128, 128))
    bf16 = dense.bfloat16()
    x = torch.randn(1, k, device=dev, generator=gen).bfloat16()
    runs = [lambda: quant_matmul_fwd(x, int4, kernel="stream"), lambda: quant_matmul_fwd(x, fp8, kernel="cores"),
            lambda: x @ bf16.t()]
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for run in runs:
        for _ in range(2):
            run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
