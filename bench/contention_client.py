"""Issue 15's contention scenario against a running server, over HTTP (run by bench/gpu_contention.sh).

    python3 bench/contention_client.py URL LABEL OUT.json

Figures (seconds and tokens/s, wall clock on the client):
- idle: a 30-token question's TTFT (median of 3) and 4 decoding streams' inter-token gaps alone;
- contention: four 16,000-token prompts at t = 0, the question at t = 1 s (and two more at 1.25 and 1.5 s):
  every TTFT, aggregate prefill = 4 x 16,000 / the last long TTFT;
- lone: one 16,000-token prompt's prefill rate (tokens / TTFT);
- decode gaps: 4 streams decoding, two 16,000-token prompts sent at t = 1 s; the streams' gaps while
  those prefill (p50 / p95) and the two prompts' prefill rate.
Every prompt is its own session (no prefix-cache hit between scenarios or runs).

CONTENTION_REPEATS (default 1) runs the contention and lone scenarios that many times against the same server:
the aggregate of one scenario spans a window of about 1.7 s on the H200 and moved by about 7% between runs of the
same server (docs/scheduling.md, session 8), so one run cannot place it against a 0.94 goal. "contention" and
"lone" stay the first repeat's; "repeats" holds every repeat and their means.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from headroom.client.http import OpenAIClient
from headroom.client.prompts import from_id_range

# CONTENTION_LONG_TOKENS shrinks the long prompts for a dry run on a CPU server.
LONG, SHORT, EXTRA = int(os.environ.get("CONTENTION_LONG_TOKENS", "16000")), 30, {"ignore_eos": True}
factory = from_id_range(32, 127)
QUESTION_TIMES_S = (1.0, 1.25, 1.5)
REPEATS = int(os.environ.get("CONTENTION_REPEATS", "1"))
if REPEATS < 1:
    raise SystemExit(f"CONTENTION_REPEATS={REPEATS}: the scenarios run at least once")


def prompt(label: str, name: str, tokens: int) -> list[int]:
    return factory.make(tokens, session=f"{label}/{name}")


async def idle(client: OpenAIClient, label: str) -> dict:
    ttfts = [(await client.stream_completion(prompt(label, f"idle-q{k}", SHORT), 4, extra=EXTRA)).ttft_s for k in range(3)]
    streams = await asyncio.gather(*(client.stream_completion(prompt(label, f"idle-s{k}", 200), 200, extra=EXTRA)
                                     for k in range(4)))
    gaps = [b - a for r in streams for a, b in zip(r.token_times[10:], r.token_times[11:], strict=False)]
    return {"short_ttft_s": statistics.median(t for t in ttfts if t is not None), "itl_p50_s": statistics.median(gaps),
            "itl_p95_s": statistics.quantiles(gaps, n=20)[18]}


async def contention(client: OpenAIClient, label: str) -> dict:
    start = time.perf_counter()
    longs = [asyncio.create_task(client.stream_completion(prompt(label, f"c-long{k}", LONG), 8, extra=EXTRA))
             for k in range(4)]
    # The question at t = 1 s is the figure. It lands at some point of the pass in flight, so one sample
    # says little: two more questions follow at 1.25 s and 1.5 s (each its own session), reported beside it.
    questions = []
    for at in QUESTION_TIMES_S:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        questions.append(asyncio.create_task(client.stream_completion(prompt(label, f"c-q{at}", SHORT), 4, extra=EXTRA)))
    asked = await asyncio.gather(*questions)
    results = await asyncio.gather(*longs)
    ttfts = [r.ttft_s for r in results]
    last = max(r.sent_at + (r.ttft_s or 0) for r in results) - start
    return {"short_ttft_s": asked[0].ttft_s, "question_ttfts_s": dict(zip(map(str, QUESTION_TIMES_S),
                                                                            (q.ttft_s for q in asked), strict=True)),
            "long_ttfts_s": ttfts, "long_ttft_mean_s": statistics.fmean(ttfts),
            "aggregate_prefill_tok_s": 4 * LONG / last, "errors": [r.error for r in [*results, *asked] if r.error]}


async def lone(client: OpenAIClient, label: str) -> dict:
    result = await client.stream_completion(prompt(label, "lone", LONG), 2, extra=EXTRA)
    return {"prefill_tok_s": LONG / result.ttft_s if result.ttft_s else None, "error": result.error}


async def decode_gaps(client: OpenAIClient, label: str) -> dict:
    streams = [asyncio.create_task(client.stream_completion(prompt(label, f"g-s{k}", 200), 600, extra=EXTRA))
               for k in range(4)]
    await asyncio.sleep(1.0)
    sent = time.perf_counter()
    longs = await asyncio.gather(*(client.stream_completion(prompt(label, f"g-long{k}", LONG), 2, extra=EXTRA)
                                   for k in range(2)))
    end = max(r.sent_at + (r.ttft_s or 0) for r in longs)
    results = await asyncio.gather(*streams)
    gaps = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:], strict=False) if a >= sent and b <= end]
    return {"itl_p50_s": statistics.median(gaps), "itl_p95_s": statistics.quantiles(gaps, n=20)[18],
            "num_gaps": len(gaps), "window_s": end - sent, "prefill_tok_s": 2 * LONG / (end - sent)}


COUNTERS = ("headroom_interjected_passes_total", "headroom_forward_passes_total", "headroom_preemptions")


async def counters(client: OpenAIClient) -> dict[str, float]:
    """The server's own count of passes, interjected passes and preemptions over the whole run (/metrics)."""
    response = await client.get("/metrics")
    found: dict[str, float] = {}
    for line in (response.text if response is not None else "").splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            found[name] = float(value)
    return found


async def repeated(client: OpenAIClient, label: str) -> dict:
    """The contention and lone scenarios REPEATS times (each repeat its own sessions), with the means of the
    figures the goals are about."""
    runs = []
    for r in range(REPEATS):
        name = label if r == 0 else f"{label}/repeat{r}"
        runs.append({"contention": await contention(client, name), "lone": await lone(client, name)})
        # The last long prompts' few decode steps end before the next repeat's prompts arrive.
        await asyncio.sleep(0.5)
    questions = [t for run in runs for t in run["contention"]["question_ttfts_s"].values() if t is not None]
    lone_rates = [run["lone"]["prefill_tok_s"] for run in runs if run["lone"]["prefill_tok_s"]]
    means = {"aggregate_prefill_tok_s": statistics.fmean(run["contention"]["aggregate_prefill_tok_s"] for run in runs),
             "long_ttft_mean_s": statistics.fmean(run["contention"]["long_ttft_mean_s"] for run in runs),
             "question_ttft_median_s": statistics.median(questions) if questions else None,
             "lone_prefill_tok_s": statistics.fmean(lone_rates) if lone_rates else None}
    return {"count": REPEATS, "runs": runs, "means": means}


async def main(url: str, label: str, out: Path) -> None:
    async with OpenAIClient(url, timeout_s=300) as client:
        await client.resolve_model()
        figures: dict = {"label": label, "idle": await idle(client, label)}
        repeats = await repeated(client, label)
        figures.update(contention=repeats["runs"][0]["contention"], lone=repeats["runs"][0]["lone"], repeats=repeats,
                       decode_gaps=await decode_gaps(client, label))
        figures["server_counters"] = await counters(client)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
