"""Re-plan the measured cases with the calibrated builtin model and extrapolate their peaks (no GPU).

Not a measurement: it assumes what lived outside the static pools on the H200 (context, activations,
allocator slack) stays the same when only the pool sizes change, which holds because none of those
depend on the pool size. The measurement itself is the file named (bench/results/gpu_plans_*.json).
Run: .venv/bin/python bench/plan_calibration_check.py [MEASURED.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from headroom.engine.plan import PlanRequest, Targets, geometry_from_config, make_plan
from headroom.engine.plan.presets import preset_config

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    source = sys.argv[1] if len(sys.argv) > 1 else "gpu_plans_after_first_calibration.json"
    measured = json.loads((RESULTS / source).read_text())
    rows = []
    for case in measured["cases"]:
        if "measured" not in case:
            continue
        geometry = geometry_from_config(preset_config("qwen3.5-4b")[0]).with_weight_bytes(case["ledger"]["weights"])
        gpu = case["gpu_memory_gib"] * 1024**3
        plan = make_plan(PlanRequest(
            geometry=geometry, gpu_memory_bytes=gpu, kv_dtype=case["kv_dtype"], engine="builtin",
            targets=Targets(context_length=case["context_length"], max_running_requests=case["running"],
                            max_new_tokens=256),
        ))
        outside_measured = case["measured"]["peak_used_above_baseline"] - case["ledger"]["static_total"]
        predicted = plan.ledger["static_total"] + plan.ledger["non_static_total"]
        extrapolated = plan.ledger["static_total"] + outside_measured
        rows.append({
            "gpu_memory_gib": case["gpu_memory_gib"], "kv_dtype": case["kv_dtype"],
            "context_length": case["context_length"], "mem_fraction_static": plan.mem_fraction_static,
            "max_total_tokens": plan.max_total_tokens, "predicted_peak_bytes": predicted,
            "extrapolated_peak_bytes": extrapolated, "extrapolated_over_predicted": extrapolated / predicted,
            "extrapolated_fits_gpu": extrapolated <= gpu,
        })
    out = {"command": f".venv/bin/python bench/plan_calibration_check.py {source}", "source": source, "note": __doc__.split("\n\n")[1], "cases": rows}
    (RESULTS / "plan_calibration_extrapolation.json").write_text(json.dumps(out, indent=1) + "\n")
    for row in rows:
        print(f"{row['gpu_memory_gib']} GiB {row['kv_dtype']} ctx {row['context_length']}: "
              f"extrapolated/predicted {row['extrapolated_over_predicted']:.3f}, fits {row['extrapolated_fits_gpu']}")


if __name__ == "__main__":
    main()
