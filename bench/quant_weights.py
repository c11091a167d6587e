"""Quantized weights on the GPU (issue 19): the Qwen3.5-4B-shaped random model of bench/gpu_engine.py in bf16,
block FP8 (128x128) and INT4 W4A16 (group 128, symmetric), the same weights quantized. Per format: prefill
tok/s (8K prompt), decode tok/s at batch 1 and 8 and as a share of the HBM limit for the bytes a decode step
reads (weights as stored + SSM state read and written), logits error and greedy agreement against bf16, and
the peak device memory of a builtin plan (24 GiB, 32K context) against the plan's ledger.

Run on the H200 (about 4 minutes):
    source bench/device_env.sh && python3 bench/quant_weights.py $OUT/quant_weights.json
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from gpu_engine import MODEL_4B, _build_4b, section_env, section_roofline, sync_time

FORMATS = ("bf16", "fp8", "int4")
# The quantized checkpoints dequantized back to dense bf16 (bench only): the engine on these against the engine
# on the quantized ones isolates the kernels' error from the quantization's own.
PLAN_GIB, PLAN_CONTEXT, PLAN_RUNNING = 24, 32768, 4
# Past this, the remaining plan probes are skipped (the device call allows 10 minutes).
BUDGET_S = 165.0


def build_checkpoints() -> dict[str, Path]:
    from headroom.engine.runtime.quant_checkpoint import (
        fp8_block_config,
        int4_pack_config,
        write_quantized_checkpoint,
    )

    _build_4b()
    dirs = {"bf16": MODEL_4B}
    for fmt, config in (("fp8", fp8_block_config()), ("int4", int4_pack_config(128, symmetric=True))):
        path = Path(f"{MODEL_4B}-{fmt}")
        if not (path / "config.json").exists():
            write_quantized_checkpoint(MODEL_4B, path, config, device="cuda")
        dirs[fmt] = path
        dirs[fmt + "_dequantized"] = write_dequantized(path, Path(f"{path}-dequantized"))
    return dirs


def write_dequantized(src: Path, dst: Path) -> Path:
    """A dense bf16 checkpoint holding the quantized checkpoint's weights as its dequantize reference reads them."""
    from headroom.engine.plan.quant_format import weight_quant_from_config
    from headroom.kernels.quant_weight import QuantizedWeight, naive_dequantize
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    quant = weight_quant_from_config(config)
    assert quant is not None
    for path in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(path), device="cuda")
        out = {}
        for name, tensor in tensors.items():
            if name.endswith(".weight_scale_inv"):
                module = name[: -len(".weight_scale_inv")]
                data = tensors[module + ".weight"]
                weight = QuantizedWeight("fp8_block", data, tensor, None, *data.shape, quant.block)
            elif name.endswith(".weight_packed"):
                module = name[: -len(".weight_packed")]
                n, k = (int(v) for v in tensors[module + ".weight_shape"].tolist())
                weight = QuantizedWeight("int4_group", tensor, tensors[module + ".weight_scale"],
                                         tensors.get(module + ".weight_zero_point"), n, k, quant.block)
            else:
                continue
            out[module + ".weight"] = naive_dequantize(weight, torch.bfloat16)
        quantized_parts = (".weight_scale_inv", ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape")
        for name, tensor in tensors.items():
            module = name.rsplit(".", 1)[0]
            if name not in out and not name.endswith(quantized_parts) and module + ".weight_scale_inv" not in tensors:
                out[name] = tensor
        save_file({k: v.contiguous().cpu() for k, v in out.items()}, str(dst / path.name))
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def measure(path: Path, hbm: float, base: dict | None, timed: bool = True) -> dict:
    """Speed and accuracy of one checkpoint; base holds bf16's logits and tokens once measured. timed=False:
    logits and greedy tokens only."""
    from headroom.engine.llm import LLM

    rng = random.Random(7)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 200000) for _ in range(n)]

    llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_dtype="bf16", max_total_tokens=40000, ssm_slots=24,
              chunked_prefill_size=8192, context_length=16384, max_running_requests=8, enable_prefix_cache=False)
    runner = llm.runner
    out: dict = {"weight_bytes": runner.weight_bytes, "weight_format": runner.model_config.weight_quant.label
                 if runner.model_config.weight_quant else "bf16"}
    fixed = [random.Random(3).randrange(1000, 200000) for _ in range(777)]
    gen = llm.generate([fixed], max_new_tokens=24, ignore_eos=True)[0]
    logits = gen.prompt_logits.float()
    if base is not None:
        out["max_abs_logit_diff_vs_bf16"] = float((logits - base["logits"]).abs().max())
        out["logit_scale_bf16"] = float(base["logits"].abs().max())
        out["top1_equal_vs_bf16"] = bool(logits.argmax() == base["logits"].argmax())
        out["greedy_agreement_vs_bf16"] = sum(a == b for a, b in zip(gen.token_ids, base["tokens"], strict=True)) / 24
    if not timed:
        return {"result": out, "logits": logits, "tokens": gen.token_ids}
    # Warm-up at the measured sizes: Triton compiles per shape class.
    llm.generate([prompt(8192 + 100)], max_new_tokens=2, ignore_eos=True)
    llm.generate([prompt(64) for _ in range(8)], max_new_tokens=3, ignore_eos=True)
    seconds, _ = sync_time(lambda: llm.generate([prompt(8192)], max_new_tokens=1, ignore_eos=True))
    out["prefill_8192_tokens_per_s"] = 8192 / seconds
    # One SSM slot (conv + recurrent state of every GDN layer), read and written by every decode step.
    slot = runner.ssm_pool.nbytes() // runner.config.ssm_slots if runner.ssm_pool is not None else 0
    out["decode"] = {}
    for batch in (1, 8):
        prompts = [prompt(256) for _ in range(batch)]
        t1, _ = sync_time(lambda p=prompts: llm.generate(p, max_new_tokens=1, ignore_eos=True))
        prompts = [prompt(256) for _ in range(batch)]
        t65, _ = sync_time(lambda p=prompts: llm.generate(p, max_new_tokens=65, ignore_eos=True))
        step = (t65 - t1) / 64
        step_bytes = runner.weight_bytes + 2 * batch * slot
        out["decode"][batch] = {"tokens_per_s": batch / step, "step_ms": step * 1000, "bytes_per_step": step_bytes,
                                "share_of_hbm_limit": step_bytes / hbm / step}
    return {"result": out, "logits": logits, "tokens": gen.token_ids}


def plan_and_probe(path: Path) -> dict:
    """A builtin plan for a 24 GiB card, run in a fresh process (bench/gpu_plans.py's probe): peak vs ledger."""
    from headroom.engine.plan import PlanRequest, Targets, load_geometry, make_plan

    plan = make_plan(PlanRequest(geometry=load_geometry(path), gpu_memory_bytes=PLAN_GIB * 1024**3, kv_dtype="bf16",
                                 targets=Targets(context_length=PLAN_CONTEXT, max_running_requests=PLAN_RUNNING,
                                                 max_new_tokens=256)))
    plan_path = Path(f"/tmp/plan-quant-{path.name}.json")
    plan_path.write_text(json.dumps(plan.to_dict()))
    predicted = plan.ledger["static_total"] + plan.ledger["non_static_total"]
    child = subprocess.run([sys.executable, __file__, "--probe", str(path), str(plan_path)], capture_output=True,
                           text=True, timeout=200)
    case: dict = {"weight_format": plan.weight_format, "ledger": plan.ledger, "predicted_peak_bytes": predicted,
                  "max_total_tokens": plan.max_total_tokens}
    if child.returncode != 0:
        case["error"] = child.stderr[-2000:]
        return case
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    case.update(measured=measured, measured_over_predicted=measured["peak_used_above_baseline"] / predicted)
    return case


def main() -> None:
    target = Path(sys.argv[1])
    started = time.perf_counter()
    results: dict = {"command": "python3 bench/quant_weights.py " + sys.argv[1], "env": section_env()}
    results["roofline"] = section_roofline()
    dirs = build_checkpoints()
    results["build_seconds"] = time.perf_counter() - started
    base = None
    for fmt in FORMATS:
        measured = measure(dirs[fmt], results["roofline"]["hbm_bytes_per_s"], base)
        base = base or measured
        if fmt != "bf16":
            # The same weights dense: what the quantized kernels should reproduce up to bf16 rounding.
            dense = measure(dirs[fmt + "_dequantized"], results["roofline"]["hbm_bytes_per_s"], base, timed=False)
            logits = measured["logits"]
            measured["result"]["vs_dequantized_dense"] = {
                "max_abs_logit_diff": float((logits - dense["logits"]).abs().max()),
                "top1_equal": bool(logits.argmax() == dense["logits"].argmax()),
                "greedy_agreement": sum(a == b for a, b in zip(measured["tokens"], dense["tokens"], strict=True)) / 24,
                "dense_max_abs_logit_diff_vs_bf16": dense["result"].get("max_abs_logit_diff_vs_bf16"),
                "dense_greedy_agreement_vs_bf16": dense["result"].get("greedy_agreement_vs_bf16"),
            }
            del dense
        # The engine of this format went out of scope with measure(): give its memory back before the next.
        gc.collect()
        torch.cuda.empty_cache()
        results[fmt] = measured["result"]
        target.write_text(json.dumps(results, indent=1, default=str))
        print(fmt, json.dumps(measured["result"], default=str)[:400], flush=True)
    # The quantized formats' plans first: bf16's peak-vs-ledger is bench/gpu_plans.py's (issue 13), re-probed
    # here only if time is left.
    for fmt in ("fp8", "int4", "bf16"):
        if time.perf_counter() - started > BUDGET_S:
            results[fmt]["plan"] = "skipped: time budget"
            continue
        try:
            results[fmt]["plan"] = plan_and_probe(dirs[fmt])
        except Exception as exc:  # noqa: BLE001 - record and go on
            results[fmt]["plan"] = {"error": repr(exc)[-2000:]}
        target.write_text(json.dumps(results, indent=1, default=str))
    results["elapsed_s"] = time.perf_counter() - started
    target.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--probe":
        import gpu_plans

        gpu_plans.MODEL = Path(sys.argv[2])
        gpu_plans.probe(sys.argv[3])
    else:
        main()
