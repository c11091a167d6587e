"""How long one plan takes (admission calls the planner, so it must stay well under 100 ms).

Run: .venv/bin/python bench/plan_speed.py  (writes bench/results/plan_speed.json)
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from headroom.engine.plan import Pinned, PlanRefused, PlanRequest, Targets, geometry_from_config, make_plan
from headroom.engine.plan.presets import preset_config

GiB = 1024**3
REPEATS = 200


def _geometry(name: str):
    config, weight_bytes = preset_config(name)
    geometry = geometry_from_config(config)
    return geometry.with_weight_bytes(weight_bytes) if weight_bytes else geometry


def cases() -> dict[str, PlanRequest]:
    seed = PlanRequest(
        geometry=_geometry("seed-27b-int2"), gpu_memory_bytes=12227 * 1024**2, kv_dtype="int2", engine="sglang",
        engine_flavour="int-kv", tp=2, ssm_dtype="fp16",
        targets=Targets(context_length=131072, retained_sessions=3, session_tokens=66000, max_running_requests=4),
    )
    return {
        "seed004_sglang_int2_derive": seed,
        "seed004_auto_context": replace(seed, targets=replace(seed.targets, context_length=None)),
        "seed004_refused_with_alternatives": replace(
            seed, pinned=Pinned(mem_fraction_static=0.78, max_total_tokens=150000, chunked_prefill_size=4096),
            targets=replace(seed.targets, context_length=114688),
        ),
        "rtx4070_qwen35_4b_builtin_auto": PlanRequest(
            geometry=_geometry("qwen3.5-4b"), gpu_memory_bytes=12 * GiB, kv_dtype="fp8", engine="builtin",
            targets=Targets(context_length=None, max_running_requests=8),
        ),
        "h200_qwen3_next_vllm": PlanRequest(
            # The FP8 checkpoint (about 82 GB); bf16 weights (160 GB) do not fit one H200.
            geometry=_geometry("qwen3-next-80b-a3b").with_weight_bytes(82 * 10**9), gpu_memory_bytes=141 * 10**9, kv_dtype="fp8",
            engine="vllm", targets=Targets(context_length=262144, retained_sessions=4, session_tokens=100000),
        ),
    }


def time_case(request: PlanRequest) -> dict[str, float | str]:
    samples = []
    outcome = "plan"
    for _ in range(REPEATS):
        start = time.perf_counter()
        try:
            make_plan(request)
        except PlanRefused as refusal:
            outcome = f"refused: {refusal.binding_constraint} ({len(refusal.alternatives)} alternatives)"
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return {
        "outcome": outcome,
        "p50_ms": round(statistics.median(samples), 3),
        "p99_ms": round(samples[int(0.99 * len(samples)) - 1], 3),
        "max_ms": round(samples[-1], 3),
    }


def main() -> None:
    results = {name: time_case(request) for name, request in cases().items()}
    report = {"repeats": REPEATS, "python": platform.python_version(), "machine": platform.machine(), "cases": results}
    out = Path(__file__).parent / "results" / "plan_speed.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("| case | outcome | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['outcome']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} |")


if __name__ == "__main__":
    main()
