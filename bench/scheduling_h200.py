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
Policies: fair (the old default), strict FCFS, short_first (the new default) over the ITL target knob.

    .venv/bin/python bench/scheduling_h200.py      # writes bench/results/scheduling_h200.json, prints tables
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from headroom.engine.scheduler.capacity import CountingCapacity
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import PassCostModel, SchedRequest, SchedulerConfig

COST = PassCostModel(fixed_s=0.0035, prefill_fixed_s=0.0448, prefill_tokens_per_s=71_500.0, decode_s=0.00007)
CHUNK, RUNNING, POOL, LONG, SHORT = 8192, 16, 200_000, 16_000, 30
SHORT_AT_S = [1.0 + 0.037 * k for k in range(8)]
ITL_TARGETS_S = [None, 0.3, 0.2, 0.15, 0.1, 0.075, 0.05]


def policies() -> dict[str, SchedulerConfig]:
    base = SchedulerConfig(chunked_prefill_size=CHUNK, max_running_requests=RUNNING, cost_model=COST)
    found = {"fair (old default)": replace(base, policy="fair"),
             "strict FCFS": replace(SchedulerConfig.strict_fcfs(CHUNK, RUNNING, CHUNK), cost_model=COST)}
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
    while clock < until_s and (pending or scheduler.has_work):
        while pending and pending[0][0] <= clock:
            scheduler.add(pending.pop(0)[1])
        if not scheduler.has_work:
            clock = pending[0][0]
            continue
        plan = scheduler.schedule()
        for request in plan.preempted:
            capacity.release(request)
        clock += COST.pass_seconds(plan.num_prefill_tokens, len(plan.decodes))
        finished = set()
        for item in plan.items:
            capacity.allocate(item.request, item.num_tokens)
            if item.samples:
                tokens.setdefault(item.request.request_id, []).append(clock)
                if item.request.num_generated + 1 >= item.request.max_new_tokens:
                    finished.add(item.request.request_id)
        scheduler.complete(plan, finished)
        for item in plan.items:
            if item.request.request_id in finished:
                capacity.release(item.request)
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
