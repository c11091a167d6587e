"""Plans against measured memory (issue 8): for several builtin plans of the Qwen3.5-4B-shaped model, start
the engine exactly as planned in a fresh process, run a prefill of the longest allowed prompt next to
decoding requests, and compare the peak GPU memory (pynvml, whole device) with the plan's ledger.

Run on the H200 after bench/gpu_engine.py built /tmp/headroom-q35-4b:
    python3 bench/gpu_plans.py OUT.json
The plans pretend smaller GPUs (--gpu-memory) so the ledger, not the H200's 141 GB, sizes the pools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MODEL = Path("/tmp/headroom-q35-4b")
# (gpu memory GiB, kv dtype, context length, running requests)
CASES = [(16, "bf16", 32768, 4), (16, "int2", 65536, 4), (24, "fp8", 65536, 8), (24, "int4", 131072, 4),
         (32, "int8", 131072, 8)]
# GPU_PLANS_KV=fp8,int2 runs only the cases of those KV formats (device time is scarce).


def plan_for(gib: int, kv: str, context: int, running: int) -> dict:
    from headroom.engine.plan import PlanRequest, Targets, load_geometry, make_plan

    plan = make_plan(PlanRequest(
        geometry=load_geometry(MODEL), gpu_memory_bytes=gib * 1024**3, kv_dtype=kv, engine="builtin",
        targets=Targets(context_length=context, max_running_requests=running, max_new_tokens=256),
    ))
    return plan.to_dict()


def probe(plan_path: str) -> None:
    """Child process: run the plan, print peak device memory used (bytes) above the idle baseline."""
    import pynvml
    import torch
    from headroom.engine.config import EngineConfig
    from headroom.engine.llm import LLM
    from headroom.engine.plan import Plan

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    baseline = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], pynvml.nvmlDeviceGetMemoryInfo(handle).used)
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    plan = Plan.from_dict(json.loads(Path(plan_path).read_text()))
    # The H200 is larger than the plan's GPU: keep the static-budget check, skip the device-size one.
    config = EngineConfig.from_plan(plan, str(MODEL), dtype="bfloat16", gpu_memory_bytes=None)
    llm = LLM(str(MODEL), config=config)
    capture = llm.graph_capture
    long_prompt = [1000 + (i * 7919) % 200000 for i in range(plan.context_length - plan.max_new_tokens)]
    others = [[2000 + (i * 31 + j) % 5000 for i in range(64)] for j in range(plan.max_running_requests - 1)]
    started = time.perf_counter()
    llm.generate([long_prompt, *others], max_new_tokens=8, ignore_eos=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    time.sleep(0.05)
    done.set()
    print(json.dumps({"peak_used_above_baseline": peak[0] - baseline, "seconds": elapsed,
                      "torch_max_allocated": torch.cuda.max_memory_allocated(),
                      "torch_max_reserved": torch.cuda.max_memory_reserved(),
                      "static_bytes": llm.runner.static_bytes, "decode_graphs": len(capture.batch_sizes),
                      "graph_pool_bytes": capture.pool_bytes, "graph_device_bytes": capture.device_bytes}))


def main() -> None:
    target = Path(sys.argv[1])
    results: dict = {"command": "python3 bench/gpu_plans.py " + sys.argv[1], "cases": []}
    only = [kv for kv in os.environ.get("GPU_PLANS_KV", "").split(",") if kv]
    for gib, kv, context, running in CASES:
        if only and kv not in only:
            continue
        case: dict = {"gpu_memory_gib": gib, "kv_dtype": kv, "context_length": context, "running": running}
        try:
            plan = plan_for(gib, kv, context, running)
            plan_path = Path(f"/tmp/plan-{gib}-{kv}-{context}.json")
            plan_path.write_text(json.dumps(plan))
            ledger = plan["ledger"]
            # The whole ledger: the allocator's slack is device memory pynvml sees, so it counts.
            predicted = ledger["static_total"] + ledger["non_static_total"]
            case.update(plan={k: plan[k] for k in ("mem_fraction_static", "max_total_tokens", "chunked_prefill_size",
                                                   "ssm_slots", "static_bytes")},
                        ledger=ledger, predicted_peak_bytes=predicted)
            child = subprocess.run([sys.executable, __file__, "--probe", str(plan_path)], capture_output=True,
                                   text=True, timeout=240)
            if child.returncode != 0:
                case["error"] = child.stderr[-2000:]
            else:
                measured = json.loads(child.stdout.strip().splitlines()[-1])
                case["measured"] = measured
                case["measured_over_predicted"] = measured["peak_used_above_baseline"] / predicted
                case["within_plan_memory"] = measured["peak_used_above_baseline"] <= gib * 1024**3
        except Exception as exc:  # noqa: BLE001 - record and go on to the next plan
            case["error"] = repr(exc)[-2000:]
        results["cases"].append(case)
        target.write_text(json.dumps(results, indent=1))
        print(json.dumps({k: case.get(k) for k in ("kv_dtype", "context_length", "measured_over_predicted")}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        probe(sys.argv[2])
    else:
        main()
