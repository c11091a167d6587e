"""Scheduling benchmark: the real engine/scheduler/scheduler.py driven by a simulated clock and the seed's cost model.

Setup (seed 000): one GPU prefilling at ~1,200-1,300 tok/s with ~0.1 s fixed cost per pass, a KV pool of
450K tokens (three 130K sessions fit whole, four do not), max 10 running requests, chunk budget 8192.
Scenarios: a lone 130K prefill; a 30-token question arriving during it; four 130K sessions with two
chat streams decoding and a 30-token question arriving mid-prefill. Policies side by side in one run.

    .venv/bin/python bench/scheduling.py            # writes bench/results/scheduling.json, prints a table
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from headroom.engine.scheduler.capacity import CountingCapacity
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import PassCostModel, SchedRequest, SchedulerConfig

COST = PassCostModel(fixed_s=0.096, prefill_tokens_per_s=1315.0, decode_s=0.004)
POOL_TOKENS = 450_000
SSM_SLOTS = 24
LONG_TOKENS = 130_000
SHORT_TOKENS = 30
# Several arrival phases of the short question so one lucky pass boundary does not decide the figure.
SHORT_ARRIVALS_S = [20.0 + 0.37 * k for k in range(8)]

POLICIES = {
    "strict FCFS-with-stop (before)": SchedulerConfig.strict_fcfs(8192, 10, chunk_per_request=4096),
    "seed's fix (lone request capped too)": SchedulerConfig(
        chunked_prefill_size=8192, max_running_requests=10, cap_lone_request=True, cost_model=COST, policy="fair"),
    "fair, no ITL target": SchedulerConfig(chunked_prefill_size=8192, max_running_requests=10, cost_model=COST, policy="fair"),
    "fair, ITL target 1 s": SchedulerConfig(
        chunked_prefill_size=8192, max_running_requests=10, itl_target_s=1.0, cost_model=COST, policy="fair"),
    "fair, ITL target 0.5 s": SchedulerConfig(
        chunked_prefill_size=8192, max_running_requests=10, itl_target_s=0.5, cost_model=COST, policy="fair"),
    "short_first (new default), no ITL target": SchedulerConfig(
        chunked_prefill_size=8192, max_running_requests=10, cost_model=COST),
    "short_first, ITL target 1 s": SchedulerConfig(
        chunked_prefill_size=8192, max_running_requests=10, itl_target_s=1.0, cost_model=COST),
    "fair, budget 2048, ITL target 1 s": SchedulerConfig(
        chunked_prefill_size=2048, max_running_requests=10, itl_target_s=1.0, cost_model=COST, policy="fair"),
}


@dataclass
class Arrival:
    at_s: float
    request: SchedRequest


@dataclass
class Trace:
    """Token times (simulated seconds) per request id."""

    arrived: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)
    prefill_busy_until: float = 0.0
    scheduler: Scheduler | None = None


def simulate(config: SchedulerConfig, arrivals: list[Arrival], stop_when: str | None = None,
             until_s: float = 3600.0) -> Trace:
    """Run passes on a simulated clock until every request is done, `stop_when` has its first token, or until_s."""
    capacity = CountingCapacity(POOL_TOKENS, SSM_SLOTS)
    scheduler = Scheduler(config, capacity)
    pending = sorted(arrivals, key=lambda a: a.at_s)
    trace, clock = Trace(), 0.0
    trace.scheduler = scheduler
    while clock < until_s and (pending or scheduler.has_work):
        while pending and pending[0].at_s <= clock:
            arrival = pending.pop(0)
            trace.arrived[arrival.request.request_id] = arrival.at_s
            scheduler.add(arrival.request)
        if not scheduler.has_work:
            clock = pending[0].at_s
            continue
        plan = scheduler.schedule()
        for request in plan.preempted:
            capacity.release(request)
        clock += COST.pass_seconds(plan.num_prefill_tokens, len(plan.decodes))
        finished: set[str] = set()
        for item in plan.items:
            capacity.allocate(item.request, item.num_tokens)
            if item.samples:
                trace.tokens.setdefault(item.request.request_id, []).append(clock)
                if item.request.num_generated + 1 >= item.request.max_new_tokens:
                    finished.add(item.request.request_id)
        if any(item.request.request_id.startswith("long") for item in plan.prefills):
            trace.prefill_busy_until = clock
        scheduler.complete(plan, finished)
        for item in plan.items:
            if item.request.request_id in finished:
                capacity.release(item.request)
        if stop_when is not None and stop_when in trace.tokens:
            break
    return trace


def ttft(trace: Trace, request_id: str) -> float:
    return trace.tokens[request_id][0] - trace.arrived[request_id]


def lone_long(config: SchedulerConfig) -> dict[str, float]:
    trace = simulate(config, [Arrival(0.0, SchedRequest("long0", LONG_TOKENS, 1))])
    return {"lone_long_prefill_tok_s": LONG_TOKENS / ttft(trace, "long0")}


def short_behind(config: SchedulerConfig, num_long: int, with_chats: bool) -> list[float]:
    """TTFT of a 30-token question arriving at each phase in SHORT_ARRIVALS_S."""
    results = []
    for at_s in SHORT_ARRIVALS_S:
        arrivals = contended_arrivals(num_long, with_chats) + [Arrival(at_s, SchedRequest("short", SHORT_TOKENS, 16))]
        results.append(ttft(simulate(config, arrivals, stop_when="short"), "short"))
    return results


def contended_arrivals(num_long: int, with_chats: bool) -> list[Arrival]:
    arrivals = [Arrival(0.5 + 0.1 * k, SchedRequest(f"long{k}", LONG_TOKENS, 64)) for k in range(num_long)]
    if with_chats:
        arrivals += [Arrival(0.0, SchedRequest(f"chat{k}", 200, 100_000)) for k in range(2)]
    return arrivals


def contended(config: SchedulerConfig) -> dict[str, float]:
    """Four long sessions and two chat streams: long-prefill throughput and decode ITL while they prefill."""
    trace = simulate(config, contended_arrivals(4, True), until_s=2000.0)
    first_tokens = [trace.tokens[f"long{k}"][0] for k in range(4)]
    gaps = []
    for k in range(2):
        times = [t for t in trace.tokens[f"chat{k}"] if t <= trace.prefill_busy_until]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "contended_prefill_tok_s": 4 * LONG_TOKENS / (max(first_tokens) - 0.5),
        "itl_during_prefill_p50_s": statistics.median(gaps),
        "itl_during_prefill_p99_s": statistics.quantiles(gaps, n=100)[98],
        "itl_during_prefill_max_s": max(gaps),
        "contended_preemptions": float(trace.scheduler.num_preemptions if trace.scheduler else 0),
    }


def run_policy(config: SchedulerConfig) -> dict[str, float]:
    lone_short = short_behind(config, 1, with_chats=False)
    busy_short = short_behind(config, 4, with_chats=True)
    return {
        **lone_long(config),
        "short_ttft_behind_1_long_mean_s": statistics.fmean(lone_short),
        "short_ttft_behind_4_long_mean_s": statistics.fmean(busy_short),
        "short_ttft_behind_4_long_max_s": max(busy_short),
        **contended(config),
    }


ROWS = [
    ("short TTFT behind 1 long prefill, mean (s)", "short_ttft_behind_1_long_mean_s", "{:.2f}"),
    ("short TTFT behind 4 long + 2 chats, mean (s)", "short_ttft_behind_4_long_mean_s", "{:.2f}"),
    ("short TTFT behind 4 long + 2 chats, max (s)", "short_ttft_behind_4_long_max_s", "{:.2f}"),
    ("lone 130K prefill (tok/s)", "lone_long_prefill_tok_s", "{:,.0f}"),
    ("4 x 130K prefill under contention (tok/s)", "contended_prefill_tok_s", "{:,.0f}"),
    ("decode ITL during long prefills, p50 (s)", "itl_during_prefill_p50_s", "{:.2f}"),
    ("decode ITL during long prefills, p99 (s)", "itl_during_prefill_p99_s", "{:.2f}"),
    ("decode ITL during long prefills, max (s)", "itl_during_prefill_max_s", "{:.2f}"),
    ("preemptions (4 x 130K > 450K pool)", "contended_preemptions", "{:.0f}"),
]


def markdown(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    lines = ["| metric | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for label, key, fmt in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt.format(results[n][key]) for n in names) + " |")
    return "\n".join(lines)


def main() -> int:
    results = {name: run_policy(replace(config, cost_model=COST)) for name, config in POLICIES.items()}
    out = Path(__file__).parent / "results" / "scheduling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"cost_model": COST.__dict__, "pool_tokens": POOL_TOKENS, "ssm_slots": SSM_SLOTS,
             "long_tokens": LONG_TOKENS, "short_tokens": SHORT_TOKENS, "short_arrivals_s": SHORT_ARRIVALS_S,
             "command": "python bench/scheduling.py"}
    out.write_text(json.dumps({"setup": setup, "results": results}, indent=2) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
