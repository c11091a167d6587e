"""Issue 15's contention scenario on the real scheduler with a pass-cost model fitted to H200 measurements.

Cost model (Qwen3.5-4B-shaped bf16 on one H200, through `headroom serve`, session 5 call 5,
bench/results/session5/): lone prompts of 2,048 and 8,192 tokens took 76.9 and 162.8 ms a pass (the first from
the warm-up's timed pass, the second the server's own pass time for an 8K prompt), so a pass carrying prefill
costs 48.3 ms + tokens / 71,500 tok/s: the eager pass's kernel launches are most of a mid-sized pass. A
decode-only pass replays a CUDA graph: 3.5 ms at batch 1 and 4.5 at 16 (LLM API, call 5), ~0.07 ms a decode.
These are simulated figures from fitted costs, not GPU measurements (bench/gpu_contention.sh measures the same
scenario through the server).

Scenarios: (1) four 16,000-token prompts at t = 0 and a 30-token question at t = 1 s (8 arrival phases);
(2) a lone 16K prompt; (3) four decoding streams while two 16K prompts prefill: their decode gaps.
Policies: fair (the old default), strict FCFS, short_first without interjection, and short_first (the default,
with interjection) over the ITL target knob.

Interjection (scheduler/interjection.py): a pass is LAYERS equal layers; a short request arriving during an
interruptible pass runs in a pass of its own at the first layer boundary at least INTERJECTION_LAG layers after
its arrival (the engine keeps the host that many layers ahead of the GPU: what it interjects waits for those), and
the long pass ends that much later. With an ITL target, a long pass defers its decodes to decode steps (graph
replays) at the boundaries where the target falls due.

    .venv/bin/python bench/scheduling_h200.py      # writes bench/results/scheduling_h200.json, prints tables
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from headroom.engine.runtime.model_runner import INTERJECTION_LAG
from headroom.engine.scheduler.capacity import CountingCapacity, finish_counted_pass, start_counted_pass
from headroom.engine.scheduler.interjection import decode_step_due
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import PassCostModel, SchedRequest, ScheduledPass, SchedulerConfig

COST = PassCostModel(fixed_s=0.0035, prefill_fixed_s=0.0448, prefill_tokens_per_s=71_500.0, decode_s=0.00007)
CHUNK, RUNNING, POOL, LONG, SHORT = 8192, 16, 200_000, 16_000, 30
LAYERS = 32  # the Qwen3.5-4B shape's: 24 Gated DeltaNet and 8 attention layers
SHORT_AT_S = [1.0 + 0.037 * k for k in range(8)]
ITL_TARGETS_S = [None, 0.3, 0.2, 0.15, 0.1, 0.075, 0.05, 0.03, 0.02, 0.012]


def policies() -> dict[str, SchedulerConfig]:
    base = SchedulerConfig(chunked_prefill_size=CHUNK, max_running_requests=RUNNING, cost_model=COST)
    found = {"fair (old default)": replace(base, policy="fair"),
             "strict FCFS": replace(SchedulerConfig.strict_fcfs(CHUNK, RUNNING, CHUNK), cost_model=COST),
             "short_first, no interjection": replace(base, interject_short=False)}
    for target in ITL_TARGETS_S:
        name = "short_first" + ("" if target is None else f", ITL target {target * 1000:.0f} ms")
        found[name] = replace(base, itl_target_s=target)
    return found


def simulate(config: SchedulerConfig, arrivals: list[tuple[float, SchedRequest]], stop: set[str] | None = None,
             until_s: float = 120.0) -> dict[str, list[float]]:
    """Token times (simulated s) per request id; ends when every id in `stop` has its first token."""
    capacity = CountingCapacity(POOL, 64)
    scheduler = Scheduler(config, capacity)
    pending, clock, tokens = sorted(arrivals, key=lambda a: a[0]), 0.0, {}
    last_decode = [0.0]  # when the last pass carrying decodes ended (StepRunner.last_decode_at)

    def arrive(until: float) -> bool:
        arrived = bool(pending) and pending[0][0] <= until
        while pending and pending[0][0] <= until:
            scheduler.add(pending.pop(0)[1])
        return arrived

    def finish(plan: ScheduledPass, at: float) -> None:
        for item in plan.items:
            if item.samples:
                tokens.setdefault(item.request.request_id, []).append(at)
        if plan.decodes:
            last_decode[0] = at
        finish_counted_pass(scheduler, capacity, plan)

    while clock < until_s and (pending or scheduler.has_work):
        arrive(clock)
        if not scheduler.has_work:
            clock = pending[0][0]
            continue
        plan = start_counted_pass(scheduler, capacity, scheduler.schedule())
        seconds = COST.pass_seconds(plan.num_prefill_tokens, len(plan.decodes))
        if scheduler.is_interruptible(plan):
            # Layer by layer; the engine polls its inbox at every boundary (EngineLoop._poll_arrivals).
            layer = seconds / LAYERS
            for _ in range(LAYERS - 1):
                clock += layer
                if arrive(clock - INTERJECTION_LAG * layer) and (inner := scheduler.schedule_interjection(plan)):
                    start_counted_pass(scheduler, capacity, inner)
                    clock += COST.pass_seconds(inner.num_prefill_tokens, 0)
                    finish(inner, clock)
                due = decode_step_due(config, clock - last_decode[0], scheduler.num_decoding, layer)
                if plan.deferred_decodes and due and (step := scheduler.schedule_decode_step(plan)):
                    start_counted_pass(scheduler, capacity, step)
                    clock += COST.pass_seconds(0, len(step.decodes))
                    finish(step, clock)
            seconds = layer
        clock += seconds
        finish(plan, clock)
        if stop is not None and stop <= tokens.keys():
            break
    return tokens


def contention(config: SchedulerConfig) -> dict[str, float]:
    longs = [f"long{k}" for k in range(4)]
    short_ttfts, long_ttfts = [], []
    for at in SHORT_AT_S:
        arrivals = [(0.0, SchedRequest(name, LONG, 8)) for name in longs] + [(at, SchedRequest("q", SHORT, 4))]
        tokens = simulate(config, arrivals, stop={*longs, "q"})
        short_ttfts.append(tokens["q"][0] - at)
        long_ttfts.append([tokens[name][0] for name in longs])
    idle = simulate(config, [(0.0, SchedRequest("q", SHORT, 4))])["q"][0]
    lone = simulate(config, [(0.0, SchedRequest("long0", LONG, 2))])["long0"][0]
    first = long_ttfts[0]
    return {"short_ttft_idle_s": idle, "short_ttft_mean_s": statistics.fmean(short_ttfts),
            "short_ttft_max_s": max(short_ttfts), "long_ttfts_s": first, "long_ttft_mean_s": statistics.fmean(first),
            "contended_prefill_tok_s": 4 * LONG / max(first), "lone_prefill_tok_s": LONG / lone}


def decode_gaps(config: SchedulerConfig) -> dict[str, float]:
    chats = [(0.0, SchedRequest(f"chat{k}", 200, 100_000)) for k in range(4)]
    idle = simulate(config, chats, until_s=1.0)
    idle_gaps = [b - a for a, b in zip(idle["chat0"][5:], idle["chat0"][6:], strict=False)]
    longs = [(1.0, SchedRequest(f"long{k}", LONG, 2)) for k in range(2)]
    tokens = simulate(config, chats + longs, stop={"long0", "long1"})
    end = max(tokens["long0"][0], tokens["long1"][0])
    gaps = [b - a for k in range(4) for a, b in zip(tokens[f"chat{k}"], tokens[f"chat{k}"][1:], strict=False)
            if a >= 1.0 and b <= end]
    return {"idle_itl_s": statistics.median(idle_gaps), "itl_p50_s": statistics.median(gaps),
            "itl_p95_s": statistics.quantiles(gaps, n=20)[18], "prefill_with_decodes_tok_s": 2 * LONG / (end - 1.0)}


def main() -> int:
    results = {name: {**contention(config), **decode_gaps(config)} for name, config in policies().items()}
    fcfs = results["strict FCFS"]
    for figures in results.values():
        figures["prefill_vs_fcfs"] = figures["contended_prefill_tok_s"] / fcfs["contended_prefill_tok_s"]
        figures["long_ttft_vs_fcfs"] = figures["long_ttft_mean_s"] / fcfs["long_ttft_mean_s"]
        figures["short_ttft_vs_idle"] = figures["short_ttft_mean_s"] / figures["short_ttft_idle_s"]
        figures["itl_p95_vs_idle"] = figures["itl_p95_s"] / figures["idle_itl_s"]
        figures["prefill_with_decodes_vs_fcfs"] = (figures["prefill_with_decodes_tok_s"]
                                                   / fcfs["prefill_with_decodes_tok_s"])
    out = Path(__file__).parent / "results" / "scheduling_h200.json"
    setup = {"cost_model": COST.__dict__, "chunk": CHUNK, "running": RUNNING, "pool_tokens": POOL,
             "long_tokens": LONG, "short_tokens": SHORT, "short_arrivals_s": SHORT_AT_S,
             "command": "python bench/scheduling_h200.py"}
    out.write_text(json.dumps({"setup": setup, "results": results}, indent=2) + "\n")
    keys = ["short_ttft_mean_s", "short_ttft_vs_idle", "long_ttft_mean_s", "long_ttft_vs_fcfs",
            "contended_prefill_tok_s", "prefill_vs_fcfs", "lone_prefill_tok_s", "itl_p50_s", "itl_p95_s",
            "itl_p95_vs_idle", "prefill_with_decodes_tok_s", "prefill_with_decodes_vs_fcfs"]
    print("| policy | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for name, figures in results.items():
        print(f"| {name} | " + " | ".join(f"{figures[k]:,.3f}" if figures[k] < 100 else f"{figures[k]:,.0f}"
                                           for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
