"""A quick look at stream-K (kernels/gemv.py GemvConfig.stream) on the GPU: at the 4B model's several-row decode
shapes, the shipped grid config against the same tile as stream-K with 1 and 2 programs a multiprocessor, and
cuBLAS, each timed over enough weight copies that L2 holds none between calls (CUDA graphs of the chain, as the
sweep times them), with each result checked against cuBLAS. For a device call too short for the sweep
(bench/engine_speed.py gemv); the sweep decides the table.

Usage: python3 bench/stream_k_probe.py OUT.json [rows]"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import torch.nn.functional as F
from decode_parts import _graph_time
from headroom.kernels.gemv import GemvConfig, gemv, load_tuned_configs

# (layer, out_features, in_features) of the 4B model whose several-row grids balance worst (docs/gpu.md, session 19)
SHAPES = [("mlp_down", 2560, 9216), ("gdn_out_proj", 2560, 4096), ("mlp_gate_up", 18432, 2560),
          ("gdn_in_proj", 12352, 2560)]


def main() -> None:
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    table = load_tuned_configs(torch.device("cuda"))
    out: dict = {"rows": rows, "gpu": torch.cuda.get_device_name(), "shapes": {}}
    started = time.perf_counter()
    for name, n, k in SHAPES:
        shipped = table.get((n, k, rows, "x"))
        base = shipped or GemvConfig(64, 128, 1, 4, 4, swap_ab=True)
        copies = max(2, -(-300_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, weights[0])
        row: dict = {"shipped": vars(shipped) if shipped else None, "weight_mb": n * k * 2 / 1e6,
                     "cublas_us": _graph_time(lambda ws=weights, x=x: [F.linear(x, w) for w in ws], copies) * 1e6}
        configs = {"grid": base}
        for programs in (1, 2):
            configs[f"stream{programs}"] = dataclasses.replace(base, swap_ab=True, split=1, stream=programs)
        for label, config in configs.items():
            got = gemv(x, weights[0], config)
            row[label] = {"us": _graph_time(lambda c=config, ws=weights, x=x: [gemv(x, w, c) for w in ws], copies) * 1e6,
                          "max_abs_vs_cublas": float((got.float() - want.float()).abs().max())}
            row[label]["tb_s"] = n * k * 2 / row[label]["us"] / 1e6
        out["shapes"][name] = row
        del weights
        torch.cuda.empty_cache()
        print(name, {key: (v["us"] if isinstance(v, dict) and "us" in v else v) for key, v in row.items()}, flush=True)
    out["seconds"] = time.perf_counter() - started
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
