"""KIVI decode attention on the H200 at the 4B model's shapes (16 query heads, 4 KV heads, head_dim 256, pages of
32, value groups of 32): kernels/kivi_decode.py against the general paged kernel it replaces and bf16 at the same
key counts, with correctness against naive_paged_attention.

    python3 bench/kivi_decode_bench.py OUT.json          (CUDA; headroom.kernels importable)

Per (format, batch) at 32,768 keys a sequence: ms of one pool pass (the kernel and its split merge; do_bench), the
bytes it reads and their rate, the general kernel's ms in the same run, and a sweep of the new kernel's tile
(pages a tile, warps, stages) and split count (multiples of the default). Writes OUT as it goes."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_kernels  # noqa: E402
import torch  # noqa: E402
from headroom.kernels import paged_attention as pa  # noqa: E402
from triton.testing import do_bench  # noqa: E402

CONTEXT = 32768
SWEEP = [{}, {"num_warps": 8}, {"num_stages": 1}, {"num_stages": 3}, {"num_pages": 4}, {"num_pages": 4, "num_warps": 8},
         {"splits_x": 2}, {"splits_x": 4}, {"splits_x": 2, "num_warps": 8}, {"splits_x": 0.5}]


def _ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60)


def _bytes(kv, batch: int) -> int:
    """Bytes a pass reads: codes, key scales and zeros a page, value scales and zeros a token (or bf16 K and V)."""
    per_seq = sum(t[: CONTEXT // (gpu_kernels.PAGE if kv.kind == "kivi" else 1)].numel() * t.element_size()
                  for t in (kv.k, kv.v, kv.k_scale, kv.k_zero) if t is not None)
    if kv.kind == "kivi":
        per_seq += sum(t[:CONTEXT].numel() * t.element_size() for t in (kv.v_scale, kv.v_zero))
    return per_seq * batch


def case(name: str, batch: int) -> dict:
    lens = [CONTEXT] * batch
    kv, table = gpu_kernels.filled_pool(name, lens)
    args = gpu_kernels.attention_args(kv, table, lens, [1] * batch)
    splits = pa.default_num_splits(batch, 1, gpu_kernels.HQ // gpu_kernels.HKV, gpu_kernels.HKV)
    run = functools.partial(pa.paged_attention, *args, max_q_len=1, num_splits=splits)
    row: dict = {"num_splits": splits, "bytes": _bytes(kv, batch)}
    out, lse = run()
    torch.cuda.synchronize()
    row["ms"] = _ms(run)
    row["GB_per_s"] = row["bytes"] / row["ms"] / 1e6
    if kv.kind != "kivi":
        return row
    ref, ref_lse = pa.naive_paged_attention(*args)
    row["vs_naive"] = gpu_kernels.max_error(out, lse, ref, ref_lse)
    pa.DECODE_TUNING["kivi_decode"] = 0
    try:
        general, general_lse = run()
        row["general_ms"] = _ms(run)
        row["vs_general_kernel"] = gpu_kernels.max_error(out, lse, general, general_lse)
        row["general_vs_naive"] = gpu_kernels.max_error(general, general_lse, ref, ref_lse)
    finally:
        pa.DECODE_TUNING.clear()
    sweep = {}
    for config in SWEEP:
        key = "default" if not config else "_".join(f"{k}{v}" for k, v in config.items())
        pa.DECODE_TUNING.update({k: v for k, v in config.items() if k != "splits_x"})
        count = max(1, int(splits * config.get("splits_x", 1)))
        tuned = functools.partial(pa.paged_attention, *args, max_q_len=1, num_splits=count)
        try:
            got, got_lse = tuned()
            sweep[key] = {"ms": _ms(tuned), "num_splits": count, **gpu_kernels.max_error(got, got_lse, ref, ref_lse)}
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is recorded, not fatal
            sweep[key] = {"error": str(exc)[:300]}
        finally:
            pa.DECODE_TUNING.clear()
    row["sweep"] = sweep
    return row


def main(path: str) -> None:
    target = Path(path)
    result: dict = {"command": "python3 bench/kivi_decode_bench.py " + path, "gpu": torch.cuda.get_device_name(),
                    "context": CONTEXT, "rows": {}}
    for batch in (1, 8):
        for name in ("bf16", "int2", "int4", "int8"):
            started = time.perf_counter()
            try:
                result["rows"][f"{name}_b{batch}"] = case(name, batch)
            except Exception as exc:  # noqa: BLE001 - one format's failure is recorded, the others still run
                result["rows"][f"{name}_b{batch}"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            result["rows"][f"{name}_b{batch}"]["seconds"] = round(time.perf_counter() - started, 1)
            target.write_text(json.dumps(result, indent=1) + "\n")
            row = result["rows"][f"{name}_b{batch}"]
            print(name, batch, {k: row.get(k) for k in ("ms", "general_ms", "GB_per_s", "num_splits", "error")},
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
