"""Every measured plan probe, decomposed and re-predicted with the current builtin model (no GPU).

Not a measurement: it assumes what lived outside the static pools on the H200 (context, activations,
allocator slack, graph memory) stays the same when only the pool sizes change, which holds because none of
those depend on the pool size. The measurements are the files in SOURCES (bench/gpu_plans.py's probe, also
run by bench/quant_weights.py); a case measured without decode graphs, re-planned with them (KIVI pools are
graphed now), is charged the new plan's own graph line, which that case therefore does not test.
Run: .venv/bin/python bench/plan_calibration_check.py [SOURCE.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from headroom.engine.plan import PlanRequest, Targets, geometry_from_config, make_plan
from headroom.engine.plan.engines import builtin
from headroom.engine.plan.kv_format import kv_format
from headroom.engine.plan.presets import preset_config

RESULTS = Path(__file__).parent / "results"
MiB = 1024**2
# Oldest first. The gpu_plans_* runs measured the engine before issue 18's fused elementwise kernels and before
# decode-graph capture warmed on one stream; quant_weights.json (session 3) the engine after both.
SOURCES = ("gpu_plans_before_calibration.json", "gpu_plans_after_first_calibration.json",
           "gpu_plans_recalibrated.json", "quant_weights.json", "session5/gpu_plans_call3.json",
           "session5/quant_weights_call3.json", "session5/quant_weights_call6.json")
ENGINE = {
    "gpu_plans_before_calibration.json": "before fused kernels",
    "gpu_plans_after_first_calibration.json": "before fused kernels",
    "gpu_plans_recalibrated.json": "before fused kernels",
    "quant_weights.json": "fused kernels (session 3)",
    "session5/gpu_plans_call3.json": "current (session 5)",
    "session5/quant_weights_call3.json": "current (session 5)",
    "session5/quant_weights_call6.json": "current, planned so (s5)",
}
# The engine the planner models: its runs must land at 0.97-1.0 of their plans.
CURRENT = ("session5/gpu_plans_call3.json", "session5/quant_weights_call3.json", "session5/quant_weights_call6.json")
# bench/quant_weights.py's probe: a 24 GiB plan, 32K context, 4 running, bf16 KV, of the same model in three
# weight formats. The quantization_config dicts are engine/runtime/quant_checkpoint.py's fp8_block_config() and
# int4_pack_config(128, symmetric=True), copied so that this script needs no torch.
_IGNORE = ["lm_head", "in_proj_a", "in_proj_b", "in_proj_ba", "mlp.gate", "shared_expert_gate"]
QUANT_CONFIGS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": _IGNORE},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group",
                 "dynamic": False, "actorder": None, "block_structure": None}}},
             "ignore": _IGNORE},
}
QUANT_PLAN = {"gpu_memory_gib": 24, "kv_dtype": "bf16", "context_length": 32768, "running": 4}
# Outside torch's allocator with no decode graph captured (CUDA context, cuBLAS, Triton and fla modules): the
# same 687 MiB in every graph-less run of every file. The two older files did not record the graphs they
# captured; a run is taken to have captured some when its outside-torch memory exceeds this by over 32 MiB.
_GRAPH_EVIDENCE_BYTES = 32 * MiB


def measured_cases(source: str) -> list[dict[str, Any]]:
    """Each probed case of a results file as {source, name, plan inputs, weight_format, ledger, measured}."""
    data = json.loads((RESULTS / source).read_text())
    cases = []
    if "cases" in data:
        for case in data["cases"]:
            if "measured" in case:
                cases.append({**{k: case[k] for k in QUANT_PLAN}, "weight_format": "bf16",
                              "ledger": case["ledger"], "measured": case["measured"]})
    else:
        for fmt in QUANT_CONFIGS:
            plan = data.get(fmt, {}).get("plan")
            if isinstance(plan, dict) and "measured" in plan:
                cases.append({**QUANT_PLAN, "weight_format": fmt, "ledger": plan["ledger"], "measured": plan["measured"]})
    for case in cases:
        case["source"] = source
        case["name"] = (f"{case['gpu_memory_gib']} GiB {case['kv_dtype']} KV {case['context_length'] // 1024}K "
                        f"r{case['running']} {case['weight_format']} weights")
    return cases


def decompose(case: dict[str, Any], no_graph_outside: int) -> dict[str, Any]:
    """The measured peak split at torch's allocator, beside the ledger lines each part was predicted by.

    static: the pools the runner allocated; allocated: torch's max allocated above them (activations, plus the
    cuBLAS workspaces of the streams that ran GEMMs); slack: max reserved - max allocated (cached free blocks,
    the graphs' private pool included); outside: pynvml's peak - max reserved (CUDA context, modules, the
    driver's graph objects). Where the graphs were recorded, graph_device (memory the capture took, all three
    kinds) is split off: its pool out of the slack, its outside-torch part (outside minus the graph-less
    figure) out of outside, the rest (the capture streams' workspaces) out of allocated.
    """
    ledger, m = case["ledger"], case["measured"]
    static = m.get("static_bytes", ledger["static_total"])
    allocated = m["torch_max_allocated"] - static
    slack = m["torch_max_reserved"] - m["torch_max_allocated"]
    outside = m["peak_used_above_baseline"] - m["torch_max_reserved"]
    if "decode_graphs" in m:
        graphs_captured = m["decode_graphs"] > 0
    else:
        graphs_captured = outside > no_graph_outside + _GRAPH_EVIDENCE_BYTES
    out: dict[str, Any] = {
        "static": {"ledger": ledger["static_total"], "measured": static},
        "activations": {"ledger": ledger["activations"] + ledger.get("dequant_transient", 0)
                        + ledger.get("weight_dequant_transient", 0), "measured_allocated": allocated},
        "slack": {"ledger": ledger["fragmentation"], "measured": slack},
        "outside_torch": {"ledger_cuda_context": ledger["cuda_context"], "measured": outside},
        "graphs": {"ledger": ledger["graph_reserve"], "captured": graphs_captured},
        "non_static": {"ledger": ledger["non_static_total"], "measured": m["peak_used_above_baseline"] - static},
    }
    if m.get("graph_device_bytes"):
        pool, device = m["graph_pool_bytes"], m["graph_device_bytes"]
        driver = outside - no_graph_outside
        out["graphs"].update(measured_device=device, measured_pool=pool, measured_outside_torch=driver,
                             measured_workspaces=device - pool - driver)
        out["activations"]["measured_prefill"] = allocated - (device - pool - driver)
        out["slack"]["measured_prefill"] = slack - pool
        out["outside_torch"]["measured_context"] = no_graph_outside
    return out


def replan(case: dict[str, Any]):
    config = dict(preset_config("qwen3.5-4b")[0])
    quant = QUANT_CONFIGS[case["weight_format"]]
    if quant is not None:
        config["quantization_config"] = quant
    geometry = geometry_from_config(config).with_weight_bytes(case["ledger"]["weights"])
    return make_plan(PlanRequest(
        geometry=geometry, gpu_memory_bytes=case["gpu_memory_gib"] * 1024**3, kv_dtype=case["kv_dtype"],
        engine="builtin", targets=Targets(context_length=case["context_length"],
                                          max_running_requests=case["running"], max_new_tokens=256),
    ))


def predict(case: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any]:
    """The current model's plan for the case's inputs and the measured peak carried over to its pools."""
    plan = replan(case)
    ledger = plan.ledger
    measured_outside = case["measured"]["peak_used_above_baseline"] - case["ledger"]["static_total"]
    graph_assumed = ledger["graph_reserve"] > 0 and not parts["graphs"]["captured"]
    if graph_assumed:
        measured_outside += ledger["graph_reserve"]
    predicted = ledger["static_total"] + ledger["non_static_total"]
    extrapolated = ledger["static_total"] + measured_outside
    gpu = case["gpu_memory_gib"] * 1024**3
    return {
        "mem_fraction_static": plan.mem_fraction_static, "max_total_tokens": plan.max_total_tokens,
        "chunked_prefill_size": plan.chunked_prefill_size,
        "ledger_mib": {k: round(ledger[k] / MiB, 1) for k in (
            "cuda_context", "activations", "dequant_transient", "weight_dequant_transient", "graph_reserve",
            "fragmentation", "static_total", "non_static_total")},
        "graph_memory_assumed_equal_to_ledger": graph_assumed,
        "predicted_peak_bytes": predicted, "extrapolated_peak_bytes": extrapolated,
        "extrapolated_over_predicted": extrapolated / predicted, "extrapolated_fits_gpu": extrapolated <= gpu,
    }


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:,.0f}"


def main() -> None:
    sources = tuple(sys.argv[1:]) or SOURCES
    cases = [case for source in sources for case in measured_cases(source)]
    # The graph-less outside-torch figure, from the runs that recorded capturing no graph.
    graphless = [c["measured"]["peak_used_above_baseline"] - c["measured"]["torch_max_reserved"]
                 for c in cases if c["measured"].get("decode_graphs") == 0]
    no_graph_outside = max(graphless) if graphless else 687 * MiB
    rows = []
    for case in cases:
        parts = decompose(case, no_graph_outside)
        row = {"source": case["source"], "engine": ENGINE.get(case["source"], "?"), "case": case["name"],
               "kv_is_kivi": kv_format(case["kv_dtype"]).is_kivi, "measured_parts": parts,
               "measured_over_predicted_then": case["measured"]["peak_used_above_baseline"]
               / (case["ledger"]["static_total"] + case["ledger"]["non_static_total"]),
               "current_model": predict(case, parts)}
        rows.append(row)
    ratios = [r["current_model"]["extrapolated_over_predicted"] for r in rows]
    fused = [r["current_model"]["extrapolated_over_predicted"] for r in rows if r["engine"].startswith("current")]
    over = [f"{r['source']}: {r['case']}: {r['current_model']['extrapolated_over_predicted']:.4f}"
            for r in rows if r["current_model"]["extrapolated_over_predicted"] > 1.0]
    out = {"command": ".venv/bin/python bench/plan_calibration_check.py " + " ".join(sys.argv[1:]),
           "sources": list(sources), "note": __doc__.split("\n\n")[1],
           "model": {"cuda_context_mib": builtin._CUDA_CONTEXT_BYTES / MiB,
                     "activation_scale": builtin._ACTIVATION_SCALE,
                     "graph_reserve_mib": f"{builtin._GRAPH_BASE_BYTES / MiB:.0f} + "
                                          f"{builtin._GRAPH_BYTES_EACH / MiB:.0f} a graph",
                     "slack": f"{builtin._SLACK_SCALE} x activations + {builtin._SLACK_WEIGHT_COPIES} x weight_dequant_transient"},
           "no_graph_outside_torch_bytes": no_graph_outside,
           "summary": {"all_cases": [min(ratios), max(ratios)],
                       "current_engine_cases": [min(fused), max(fused)] if fused else None,
                       "cases_above_1": over},
           "cases": rows}
    (RESULTS / "plan_calibration_extrapolation.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'case':44s} {'engine':26s} | MiB measured (ledger then): allocated  slack  outside | "
          f"graphs dev/pool | then  | now: frag graph | extrap/pred")
    for r in rows:
        p, now = r["measured_parts"], r["current_model"]
        print(f"{r['case']:44s} {r['engine']:26s} | "
              f"{_mib(p['activations']['measured_allocated']):>6s} ({_mib(p['activations']['ledger']):>5s}) "
              f"{_mib(p['slack']['measured']):>5s} ({_mib(p['slack']['ledger']):>5s}) "
              f"{_mib(p['outside_torch']['measured']):>5s} ({_mib(p['outside_torch']['ledger_cuda_context'] + p['graphs']['ledger']):>5s}) | "
              f"{_mib(p['graphs'].get('measured_device')):>4s}/{_mib(p['graphs'].get('measured_pool')):>4s} | "
              f"{r['measured_over_predicted_then']:.3f} | {now['ledger_mib']['fragmentation']:6,.0f} "
              f"{now['ledger_mib']['graph_reserve']:4,.0f}{'*' if now['graph_memory_assumed_equal_to_ledger'] else ' '} | "
              f"{now['extrapolated_over_predicted']:.3f}{'' if now['extrapolated_fits_gpu'] else ' OVER THE GPU'}")
    print(f"all cases {min(ratios):.3f}-{max(ratios):.3f}"
          + (f"; current engine {min(fused):.3f}-{max(fused):.3f}" if fused else "")
          + "  (* graph memory not measured for that case: charged the ledger's line)")


if __name__ == "__main__":
    main()
