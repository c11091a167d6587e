"""Tensor parallelism on two H200s (issue 20): TP1 against TP2 for the Qwen3.5-4B-shaped random bf16 model.

For each tp, in a fresh process: plan as a 24 GiB GPU would be planned (per-GPU ledger), start the engine
exactly as planned (rank 0 here, rank 1 spawned by the engine), then time
- prefill: one 8,192-token prompt (tokens / wall second, first token included);
- decode: batch 1 and batch 8 (the plan's running requests), 128 new tokens each, timed as the difference
  between a 129-token and a 1-token generation of the same prompts;
and record each GPU's peak memory (pynvml, whole device, above its idle baseline) against the rank's
ledger (static_total + non_static_total), plus torch's own peaks per rank and whether decode graphs
(which hold the NCCL all-reduces) were captured.

Run on nvidia-h200-x2 from the repo root, NVLink multicast off (the device's KINDS.md):
    source bench/device_env.sh && NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 bench/tp_speed.py $OUT/tp_speed.json
Needs /tmp/headroom-q35-4b (built here through bench/gpu_engine.py's builder when absent, about a minute).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

MODEL = Path("/tmp/headroom-q35-4b")
GPU_MEMORY_GIB = 24
PROBE_TIMEOUT_S = 150
CONTEXT, RUNNING, PREFILL_TOKENS, DECODE_TOKENS = 32768, 8, 8192, 128
# A program using NVLink multicast can take the host's shared GPUs out of service (KINDS.md): refuse without these.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def build_model() -> None:
    if (MODEL / "config.json").exists():
        return
    spec = importlib.util.spec_from_file_location("gpu_engine", Path(__file__).with_name("gpu_engine.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._build_4b()


def plan_for(tp: int) -> dict:
    from headroom.engine.plan import PlanRequest, Targets, load_geometry, make_plan

    return make_plan(PlanRequest(
        geometry=load_geometry(MODEL), gpu_memory_bytes=GPU_MEMORY_GIB * 1024**3, kv_dtype="bf16", engine="builtin",
        tp=tp, targets=Targets(context_length=CONTEXT, max_running_requests=RUNNING, max_new_tokens=256),
    )).to_dict()


class PeakSampler:
    """Peak pynvml 'used' of GPUs 0..n-1 above their idle baselines, sampled every 5 ms."""

    def __init__(self, num_gpus: int):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(num_gpus)]
        self.baseline = [pynvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]
        self.peak = list(self.baseline)
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.done.is_set():
            for i, handle in enumerate(self.handles):
                self.peak[i] = max(self.peak[i], self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
            time.sleep(0.005)

    def stop(self) -> list[int]:
        time.sleep(0.05)
        self.done.set()
        return [p - b for p, b in zip(self.peak, self.baseline, strict=True)]


def timed(llm, prompts: list[list[int]], new_tokens: int) -> float:
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    llm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    llm.runner.synchronize()
    return time.perf_counter() - started


def probe(tp: int, plan_path: str, graphs: bool) -> None:
    """Child process: one engine as planned; prints one JSON line."""
    import torch
    from headroom.engine.config import EngineConfig
    from headroom.engine.llm import LLM
    from headroom.engine.plan import Plan

    sampler = PeakSampler(tp)
    plan = Plan.from_dict(json.loads(Path(plan_path).read_text()))
    # The H200 is larger than the planned GPU: keep the static-budget check, skip the device-size one.
    overrides = {} if graphs else {"cuda_graph_max_batch": 0}
    config = EngineConfig.from_plan(plan, str(MODEL), dtype="bfloat16", gpu_memory_bytes=None, **overrides)
    started = time.perf_counter()
    llm = LLM(str(MODEL), config=config)
    load_s = time.perf_counter() - started
    vocab = llm.runner.vocab_size
    long_prompt = [(1000 + i * 7919) % vocab for i in range(PREFILL_TOKENS)]
    short = [[(2000 + i * 31 + j * 977) % vocab for i in range(128)] for j in range(RUNNING)]
    # Warm every kernel path once, on other tokens (a cached prefix would shorten the timed prefill).
    timed(llm, [[(t + 1) % vocab for t in long_prompt[:2048]]], 2)
    prefill_s = timed(llm, [long_prompt], 1)
    decode = {}
    for batch in (1, RUNNING):
        # Distinct prompts each run (a cached prefix would shorten the second prefill).
        prompts = [[(t + 7 * batch) % vocab for t in p] for p in short[:batch]]
        first = timed(llm, prompts, 1)
        prompts = [[(t + 11 * batch) % vocab for t in p] for p in short[:batch]]
        whole = timed(llm, prompts, DECODE_TOKENS + 1)
        decode[f"batch_{batch}"] = {"tokens_per_s": batch * DECODE_TOKENS / (whole - first), "seconds": whole - first}
    llm.runner.synchronize()
    rank_memory = getattr(llm.runner, "rank_memory", None) or [
        {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}]
    rank_pools = getattr(llm.runner, "rank_pools", None)
    peaks = sampler.stop()
    print(json.dumps({
        "tp": tp, "decode_graphs": len(llm.graph_capture.batch_sizes), "load_seconds": load_s,
        "prefill": {"tokens": PREFILL_TOKENS, "seconds": prefill_s, "tokens_per_s": PREFILL_TOKENS / prefill_s},
        "decode": decode, "peak_used_above_baseline": peaks, "torch_peaks": rank_memory, "rank_pools": rank_pools,
    }))
    llm.close()


def run_case(tp: int, plan_path: Path, graphs: bool) -> dict:
    try:
        child = subprocess.run([sys.executable, __file__, "--probe", str(tp), str(plan_path), str(int(graphs))],
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        # A capture that deadlocks in NCCL must not cost the eager run after it.
        return {"error": f"timed out after {PROBE_TIMEOUT_S} s: {str(exc.stderr or '')[-2000:]}"}
    if child.returncode != 0:
        return {"error": (child.stderr or child.stdout)[-3000:], "returncode": child.returncode}
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    missing = {k: v for k, v in MULTICAST_OFF.items() if os.environ.get(k) != v}
    if missing:
        sys.exit(f"set {' '.join(f'{k}={v}' for k, v in missing.items())} first (NVLink multicast must stay off)")
    target = Path(sys.argv[1])
    results: dict = {"command": "python3 bench/tp_speed.py " + sys.argv[1], "env": dict(MULTICAST_OFF), "cases": []}
    build_model()
    for tp in (1, 2):
        case: dict = {"tp": tp}
        try:
            plan = plan_for(tp)
            plan_path = Path(f"/tmp/plan-tp{tp}.json")
            plan_path.write_text(json.dumps(plan))
            ledger = plan["ledger"]
            predicted = ledger["static_total"] + ledger["non_static_total"]
            case.update(ledger=ledger, predicted_peak_bytes=predicted, max_total_tokens=plan["max_total_tokens"],
                        ssm_slots=plan["ssm_slots"], engine_args=plan["engine_args"])
            measured = run_case(tp, plan_path, graphs=True)
            if "error" in measured and tp > 1:
                # Record why the graphed run failed, then measure the eager one.
                case["graphed_error"] = measured["error"]
                measured = run_case(tp, plan_path, graphs=False)
            case["measured"] = measured
            if "peak_used_above_baseline" in measured:
                case["peak_over_ledger"] = [p / predicted for p in measured["peak_used_above_baseline"]]
                case["within_3_percent"] = all(abs(r - 1) <= 0.03 for r in case["peak_over_ledger"])
        except Exception:  # noqa: BLE001 - record and go on to the next case
            case["error"] = traceback.format_exc()[-3000:]
        results["cases"].append(case)
        target.write_text(json.dumps(results, indent=1))
        print(json.dumps({k: case.get(k) for k in ("tp", "peak_over_ledger", "within_3_percent")}), flush=True)
    if all("measured" in c and "prefill" in c["measured"] for c in results["cases"]):
        one, two = (c["measured"] for c in results["cases"])
        results["tp2_over_tp1"] = {
            "prefill": two["prefill"]["tokens_per_s"] / one["prefill"]["tokens_per_s"],
            **{k: two["decode"][k]["tokens_per_s"] / one["decode"][k]["tokens_per_s"] for k in one["decode"]},
        }
        target.write_text(json.dumps(results, indent=1))
        print(json.dumps(results["tp2_over_tp1"]), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--probe":
        probe(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
    else:
        main()
