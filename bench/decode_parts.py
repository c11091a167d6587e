"""Parts of bench/engine_speed.py that decide two kernel paths by measurement on the GPU:
gemv_sweep: kernels/gemv.py's configurations against cuBLAS (torch's F.linear) at the 4B model's decode shapes;
short_pass_sweep: lone short prefill passes with the Gated DeltaNet rows token by token (kernels/gdn_decode.py)
against fla's chunked kernels (engine/layers/linear_attention.py RECURRENT_ROWS)."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The 4B model's linear layers at decode: (out_features, in_features, how many a step runs).
DECODE_SHAPES = {
    "mlp_gate_up": (18432, 2560, 32), "mlp_down": (2560, 9216, 32), "gdn_in_proj": (12352, 2560, 24),
    # A quantized checkpoint's split GDN projection (its dense b|a cannot stack with qkv|z): not in a bf16 step.
    "gdn_qkvz": (12288, 2560, 0), "gdn_ba": (64, 2560, 0),
    "gdn_out_proj": (2560, 4096, 24), "attn_qkv": (10240, 2560, 8), "attn_o_proj": (2560, 4096, 8),
    "lm_head": (248320, 2560, 1),
}


def _graph_time(fn, calls_per_replay: int, replays: int = 20) -> float:
    """Seconds per call of fn (which makes calls_per_replay calls), replayed from a CUDA graph: launch gaps out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / replays / calls_per_replay


def gemv_sweep(budget_s: float = 150.0) -> dict:
    """Per shape and batch (1, 8, 16): cuBLAS and the best GemvConfig, each timed over enough weight copies that
    L2 (60 MB) holds none of them between calls; GB/s of weight bytes; and a decode step's linear time with
    either choice per shape. Configurations past budget_s are skipped (the JSON says how many ran)."""
    from headroom.kernels.gemv import GemvConfig, gemv

    started = time.perf_counter()
    # Session 7's first sweeps (splits to 8, 4 and 8 warps) picked 4 warps and splits of 1 to 4 everywhere.
    tiles = [(bn, bk) for bn, bk in itertools.product((16, 32, 64), (128, 256, 512)) if bn * bk <= 16384]
    configs = [GemvConfig(bn, bk, split, warps, stages) for (bn, bk), split, warps, stages
               in itertools.product(tiles, (1, 2, 4), (4,), (2, 4))]
    out: dict = {"configs_tried": 0, "shapes": {}}
    for name, (n, k, per_step) in DECODE_SHAPES.items():
        copies = max(2, -(-300_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        weight_bytes = n * k * 2
        rows: dict = {}
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0])
            cublas = _graph_time(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], copies)
            best: tuple[float, GemvConfig] | None = None
            errors = 0
            for config in configs:
                if time.perf_counter() - started > budget_s:
                    break
                try:
                    got = gemv(x, weights[0], config)
                    if not torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02):
                        errors += 1
                        continue
                    seconds = _graph_time(lambda x=x, c=config, ws=weights: [gemv(x, w, c) for w in ws], copies)
                except Exception:  # noqa: BLE001 - a config that does not compile or run is skipped
                    errors += 1
                    continue
                out["configs_tried"] += 1
                if best is None or seconds < best[0]:
                    best = (seconds, config)
            rows[str(m)] = {"cublas_us": cublas * 1e6, "cublas_gb_s": weight_bytes / cublas / 1e9,
                            "best_us": best[0] * 1e6 if best else None,
                            "best_gb_s": weight_bytes / best[0] / 1e9 if best else None,
                            "best_config": vars(best[1]) if best else None, "failed_configs": errors}
        out["shapes"][name] = {"n": n, "k": k, "per_step": per_step, "weight_bytes": weight_bytes, "batches": rows}
        del weights
        torch.cuda.empty_cache()
    for m in ("1", "8", "16"):
        shapes = out["shapes"].values()
        out[f"step_linear_ms_bs{m}"] = {
            "cublas": sum(s["per_step"] * s["batches"][m]["cublas_us"] for s in shapes) / 1000,
            "best_of_both": sum(s["per_step"] * min(s["batches"][m]["cublas_us"], s["batches"][m]["best_us"] or 1e9)
                                for s in shapes) / 1000}
    out["seconds"] = time.perf_counter() - started
    return out


# A shape goes to the Triton GEMV only if it won by at least this share: smaller differences are within what the
# same kernel varies between runs.
GEMV_MIN_GAIN = 0.03


def gemv_table(sweep: dict) -> list[dict]:
    """kernels/gemv_tuned_configs.json's configs for this GPU from a gemv_sweep: the (shape, rows) where the best
    configuration beat cuBLAS by GEMV_MIN_GAIN, with both timings (kernels/tuned_table.py writes the table)."""
    configs = []
    for name, shape in sweep["shapes"].items():
        for m, row in shape["batches"].items():
            if row["best_us"] is not None and row["best_us"] <= (1 - GEMV_MIN_GAIN) * row["cublas_us"]:
                configs.append({"layer": name, "n": shape["n"], "k": shape["k"], "m": int(m), **row["best_config"],
                                "us": round(row["best_us"], 2), "cublas_us": round(row["cublas_us"], 2)})
    return configs


def short_pass_sweep(model: Path, lengths: tuple[int, ...] = (8, 16, 30, 64, 128, 256)) -> dict:
    """Wall time of one lone prefill pass of each length through the LLM API (prefix cache on, no checkpoint
    stops), best of 3 after a warm-up, with the delta rule token by token (RECURRENT_ROWS above the length) and
    through fla (RECURRENT_ROWS 0); also 4 prompts of 30 tokens in one pass, as an interjection runs them."""
    from engine_speed_parts import timed_prompts
    from headroom.engine.layers import linear_attention
    from headroom.engine.llm import LLM

    rng = random.Random(7)
    llm = LLM(str(model), device="cuda", dtype="bfloat16", kv_dtype="bf16", max_total_tokens=40000, ssm_slots=24,
              chunked_prefill_size=8192, context_length=16384, max_running_requests=8)
    default_rows = linear_attention.RECURRENT_ROWS

    def run(lengths_in_pass: list[int]) -> float:
        return timed_prompts(llm, lengths_in_pass, False, rng)

    out: dict = {"default_recurrent_rows": default_rows, "passes_ms": {}}
    try:
        for label, rows in (("recurrent", 1 << 30), ("fla", 0)):
            linear_attention.RECURRENT_ROWS = rows
            for shape in [[n] for n in lengths] + [[30] * 4]:
                key = "x".join(map(str, shape))
                run(shape)
                out["passes_ms"].setdefault(key, {})[label] = min(run(shape) for _ in range(3)) * 1000
    finally:
        linear_attention.RECURRENT_ROWS = default_rows
    return out


def gpu_timeline(prof, min_gap_us: float = 20.0, top: int = 10) -> dict:
    """Where the GPU of a torch profile sat idle: the span from the first kernel's start to the last one's end,
    the time some kernel ran (intervals merged), and the largest gaps with the kernels on either side (a gap
    after a kernel that is followed by host work, a sync or a Python-bound stretch shows as a long one)."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        return {}
    busy, gaps, reach, before = 0.0, [], kernels[0][0], kernels[0][2]
    for start, end, name in kernels:
        if start - reach >= min_gap_us:
            gaps.append((start - reach, before, name))
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, before = end, name
    span = reach - kernels[0][0]
    gaps.sort(reverse=True)
    return {"span_ms": span / 1000, "busy_ms": busy / 1000, "idle_ms": (span - busy) / 1000,
            "gaps_over_min_ms": sum(g for g, _, _ in gaps) / 1000, "num_gaps_over_min": len(gaps),
            "min_gap_us": min_gap_us, "largest_gaps": [{"us": round(g, 1), "after": a[:70], "before": b[:70]}
                                                       for g, a, b in gaps[:top]]}
