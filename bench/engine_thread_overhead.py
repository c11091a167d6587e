"""What the engine thread spends per decode step besides the model's forward: `headroom serve`'s engine (built as
the server builds it, warm-up included) against the LLM API on the same model, config and batch.

Why: on the H200 a decode step through `headroom serve` took 0.44 ms (batch 1) to 1.5 ms (batch 16) longer than
through the LLM API with the same CUDA graph (session 9), and the HTTP handlers' own GIL time was ruled out
(bench/http_token_path.py). What is left is the engine thread's Python between two forwards, which a CPU resolves
as well as a GPU host does.

Figures (microseconds, steps where all B requests decode and none waits):
- gap: from the end of one forward to the start of the next (everything the thread does between two forwards:
  scheduling, cache bookkeeping, sampling, stop checks, events, metrics); gap_cpu is the thread's CPU time in
  it (time.thread_time), the rest of the gap is waiting (for the GIL, on this 2-core machine for a core).
- serve_http: the real app and uvicorn in this process, B streaming clients in another; serve_loop: the engine
  loop alone, its events drained by an asyncio loop in this process (no HTTP); llm: LLM.generate.
- phases: the gap taken apart by timing the step's parts (a wrapper each, ~0.3 us apiece, counted in the part);
  profile: cProfile of the engine thread over the same steps, the forward left out (cProfile's per-call cost
  inflates small functions: read its figures as shares, the gap's as the truth).
- sleep_loop / sleep_http: the model replaced by a --sleep-ms wait with the GIL released, as the engine thread
  waits for a GPU step: the handlers then run during the wait, as they do on the GPU.
- --fill N serves N short requests first, so that the prefix cache holds what a server that has run a while holds.

    PYTHONSAFEPATH=1 .venv/bin/python bench/engine_thread_overhead.py OUT.json [--batches 1 8 16] [--tokens 128]
        [--prompt-len 256] [--repeats 3] [--fill 0] [--sleep-ms 4]
        [--parts llm serve_loop serve_http phases_loop phases_http profile_loop sleep_loop sleep_http]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import platform
import pstats
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

CLIENT = textwrap.dedent("""
    import asyncio, json, sys, httpx
    url, prompts, tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    async def one(client, prompt):
        body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0}
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
        return n
    async def main():
        async with httpx.AsyncClient() as client:
            print(json.dumps(await asyncio.gather(*[one(client, p) for p in prompts])))
    asyncio.run(main())
""")


class ForwardClock:
    """Wraps runner.forward: per forward (start, end, thread CPU at start and end, rows, decode-only)."""

    def __init__(self, runner, profiler: cProfile.Profile | None = None):
        self.records: list[tuple[float, float, float, float, int, bool]] = []
        self.profiler = profiler
        self.profiling = False
        inner = runner.forward

        def forward(items, *args, **kwargs):
            if self.profiling:
                self.profiler.disable()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(items, *args, **kwargs)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                self.records.append((t0, t1, c0, c1, len(items), all(len(i.token_ids) == 1 for i in items)))
                if self.profiling:
                    self.profiler.enable()

        runner.forward = forward

    def gaps(self, batch: int) -> dict:
        """The gaps between consecutive decode-only forwards of `batch` rows."""
        gaps, cpu, fwd = [], [], []
        for a, b in zip(self.records, self.records[1:], strict=False):
            if a[4] == b[4] == batch and a[5] and b[5]:
                gaps.append((b[0] - a[1]) * 1e6)
                cpu.append((b[2] - a[3]) * 1e6)
                fwd.append((a[1] - a[0]) * 1e3)
        if not gaps:
            return {"steps": 0}
        return {"steps": len(gaps), "forward_ms_median": statistics.median(fwd),
                "gap_us_median": statistics.median(gaps), "gap_us_mean": statistics.fmean(gaps),
                "gap_cpu_us_median": statistics.median(cpu), "gap_us_per_request": statistics.median(gaps) / batch}


class Phases:
    """Times the parts of the engine loop's steps where all `batch` requests decode (instance wrappers)."""

    TOP = ("drain_inbox", "schedule", "reserve", "forward", "sample", "publish_captures", "checkpoint",
           "finish_reason", "emit", "complete", "release", "on_step")

    def __init__(self, loop):
        import headroom.engine.loop.step as step_module

        self.loop, self.batch = loop, 0
        self.current: dict[str, float] | None = None
        self.cycle_start = 0.0
        self.cycles: list[dict[str, float]] = []
        steps, cache = loop.steps, loop.steps.cache
        for owner, name, key in ((loop, "drain_inbox", "drain_inbox"), (steps.scheduler, "schedule", "schedule"),
                                 (steps.capacity, "free_kv_tokens", "schedule: capacity.free_kv_tokens"),
                                 (steps, "_reserve", "reserve"), (loop.runner, "forward", "forward"),
                                 (cache, "publish_captures", "publish_captures"), (cache, "checkpoint", "checkpoint"),
                                 (steps, "_finish_reason", "finish_reason"), (steps, "emit", "emit"),
                                 (steps.scheduler, "complete", "complete"), (steps, "_release", "release"),
                                 (loop, "on_step", "on_step")):
            setattr(owner, name, self._timed(getattr(owner, name), key))
        step_module.sample = self._timed(step_module.sample, "sample")
        inner_step = loop._step

        def step():
            self._cycle_boundary()
            return inner_step()

        loop._step = step

    def _timed(self, inner, key):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - t0
        return timed

    def _cycle_boundary(self) -> None:
        now = time.perf_counter()
        scheduler = self.loop.scheduler
        full = self.batch > 0 and not scheduler.waiting and len(scheduler.running) == self.batch and all(
            r.phase.value == "decode" for r in scheduler.running)
        if self.current is not None and full:
            # A cycle counts when the next step is a full one too (the last one's end may be an idle wait).
            self.current["cycle"] = now - self.cycle_start
            self.cycles.append(self.current)
        self.current, self.cycle_start = ({} if full else None), now

    def summary(self) -> dict:
        cycles = self.cycles
        if not cycles:
            return {"steps": 0}
        mean = {key: statistics.fmean(c.get(key, 0.0) for c in cycles) * 1e6 for key in {k for c in cycles for k in c}}
        outside = mean["cycle"] - mean.get("forward", 0.0)
        mean["other (loop, _run's own lines)"] = outside - sum(mean.get(k, 0.0) for k in self.TOP if k != "forward")
        return {"steps": len(cycles), "cycle_us": mean["cycle"], "outside_forward_us": outside,
                "us_per_step": {k: round(v, 2) for k, v in sorted(mean.items(), key=lambda kv: -kv[1])},
                "us_per_request_per_step": {k: round(v / self.batch, 2) for k, v in sorted(
                    mean.items(), key=lambda kv: -kv[1]) if k not in ("cycle", "forward")}}


def _serve(args, with_http: bool):
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.server.factory import ServeOptions, build_state, start_warm_up

    state = build_state(ServeOptions(model=str(ensure_default_model()), context_length=2048, max_total_tokens=32768,
                                     chunked_prefill_size=512, max_running_requests=max(args.batches),
                                     max_new_tokens=args.tokens, cpu_threads=1))
    start_warm_up(state).join()
    if state.warmup_error:
        raise RuntimeError(state.warmup_error)
    if not with_http:
        return state, None, None
    # The sibling bench script; PYTHONSAFEPATH (the Makefile's) keeps the script's folder off sys.path.
    sys.path.insert(0, str(Path(__file__).parent))
    from http_token_path import serve_in_thread

    server, url = serve_in_thread(state)
    return state, server, url


def _drive_loop(state, prompts: list[list[int]], tokens: int) -> None:
    """B requests through EngineLoop.submit, their events drained by an asyncio loop (no HTTP)."""
    from headroom.engine.loop.engine_loop import RequestStream
    from headroom.engine.sequence import SamplingParams, Sequence

    async def run() -> None:
        async def one(i: int, prompt: list[int]) -> None:
            stream = RequestStream(asyncio.get_running_loop(), asyncio.Queue())
            seq = Sequence(f"bench-{time.monotonic_ns()}-{i}", prompt, SamplingParams(max_new_tokens=tokens,
                                                                                     ignore_eos=True))
            state.loop.submit(seq, state.tokenizer.eos_token_ids, stream)
            while (await stream.events.get()).finish_reason is None:
                pass
        await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    asyncio.run(run())


def _drive_http(url: str, prompts: list[list[int]], tokens: int) -> None:
    out = subprocess.run([sys.executable, "-c", CLIENT, url, json.dumps(prompts), str(tokens)], capture_output=True,
                         text=True, timeout=900, check=True)
    counts = json.loads(out.stdout)
    if len(counts) != len(prompts) or min(counts) < 1:
        raise RuntimeError(f"streams came back short: {counts}")


def _radix_nodes(state) -> int:
    radix = state.loop.steps.cache.radix
    if radix is None:
        return 0
    count, stack = 0, [radix.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        count += 1
    return count - 1


def _sleeping_forward(runner, sleep_s: float) -> None:
    """The model replaced by a wait of sleep_s with the GIL released, as the engine thread waits for a GPU step
    (a CUDA graph's replay, then the sampled tokens' copy): positions advance, every row's logits pick byte 65."""
    import torch

    logits_row = torch.zeros(runner.vocab_size)
    logits_row[65] = 1.0

    def forward(items, all_positions=False, between_layers=None):
        time.sleep(sleep_s)
        for item in items:
            item.seq.num_computed_tokens += len(item.token_ids)
        return logits_row.expand(len(items), -1)

    runner.forward = forward


def measure_serve(args, rng: random.Random, mode: str, instrument: str) -> dict:
    """mode http | loop; instrument gaps | phases | profile | sleep (gaps with the model a sleep of --sleep-ms)."""
    state, server, url = _serve(args, with_http=mode == "http")
    loop, out = state.loop, {}
    if instrument == "sleep":
        _sleeping_forward(loop.runner, args.sleep_ms / 1000)
    profiler = cProfile.Profile() if instrument == "profile" else None
    clock = ForwardClock(loop.runner, profiler) if instrument != "phases" else None
    phases = Phases(loop) if instrument == "phases" else None
    if profiler is not None:
        inner_step = loop._step

        def step():
            # Only the steps where all B decode (the loop's drain_inbox between them is in the phases).
            scheduler = loop.scheduler
            full = not scheduler.waiting and len(scheduler.running) == batch_now[0] and all(
                r.phase.value == "decode" for r in scheduler.running)
            if not full:
                return inner_step()
            steps_profiled[0] += 1
            clock.profiling = True
            profiler.enable()
            try:
                return inner_step()
            finally:
                profiler.disable()
                clock.profiling = False

        loop._step = step
    batch_now, steps_profiled = [0], [0]
    for begin in range(0, args.fill, 16):
        # A server that has served for a while: its prefix cache holds what earlier requests left.
        _drive_loop(state, [[rng.randrange(32, 128) for _ in range(32)] for _ in range(min(16, args.fill - begin))], 1)
    try:
        for batch in args.batches:
            nodes = _radix_nodes(state)
            if clock is not None:
                clock.records.clear()
            if phases is not None:
                phases.cycles.clear()
            batch_now[0] = batch
            if phases is not None:
                phases.batch = batch
            steps_profiled[0] = 0
            if profiler is not None:
                profiler.clear()
            gaps = []
            for _ in range(args.repeats):
                prompts = [[rng.randrange(32, 128) for _ in range(args.prompt_len)] for _ in range(batch)]
                _drive_http(url, prompts, args.tokens) if mode == "http" else _drive_loop(state, prompts, args.tokens)
                if clock is not None:
                    gaps.append(clock.gaps(batch))
                    clock.records.clear()
            batch_now[0] = 0
            row: dict = {"radix_nodes_before": nodes}
            if clock is not None:
                row.update(_pool(gaps))
            if phases is not None:
                row.update(phases.summary())
            if profiler is not None:
                row["profiled_steps"] = steps_profiled[0]
                row["top"] = _profile_top(profiler, steps_profiled[0], batch, args.profile_top)
            out[str(batch)] = row
    finally:
        if server is not None:
            server.should_exit = True
        loop.stop()
    return out


def _pool(runs: list[dict]) -> dict:
    """One row from several runs' gap summaries: medians of their medians, steps summed."""
    runs = [r for r in runs if r["steps"]]
    if not runs:
        return {"steps": 0}
    row = {"steps": sum(r["steps"] for r in runs)}
    for key in ("forward_ms_median", "gap_us_median", "gap_us_mean", "gap_cpu_us_median", "gap_us_per_request"):
        row[key] = round(statistics.median(r[key] for r in runs), 2)
    row["gap_us_median_per_run"] = [round(r["gap_us_median"], 1) for r in runs]
    return row


def _profile_top(profiler: cProfile.Profile, steps: int, batch: int, top: int) -> list[dict]:
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}({name})" if line else name
        rows.append({"function": where, "calls_per_step": round(calls / max(steps, 1), 2),
                     "tottime_us_per_step": round(tottime / max(steps, 1) * 1e6, 2),
                     "tottime_us_per_request": round(tottime / max(steps, 1) / batch * 1e6, 2),
                     "cumtime_us_per_step": round(cumtime / max(steps, 1) * 1e6, 2)})
    rows.sort(key=lambda r: -r["tottime_us_per_step"])
    return rows[:top]


def measure_llm(args, rng: random.Random, config) -> dict:
    """LLM.generate at each batch on the server's EngineConfig, in a thread as the engine's (one intra-op thread)."""
    out: dict = {}

    def run() -> None:
        import torch
        from headroom.engine.llm import LLM

        torch.set_num_threads(config.cpu_threads)
        llm = LLM(config.model_path, config=config)
        clock = ForwardClock(llm.runner)
        llm.generate([[rng.randrange(32, 128) for _ in range(args.prompt_len)]], max_new_tokens=4, ignore_eos=True)
        for batch in args.batches:
            runs = []
            for _ in range(args.repeats):
                clock.records.clear()
                llm.generate([[rng.randrange(32, 128) for _ in range(args.prompt_len)] for _ in range(batch)],
                             max_new_tokens=args.tokens, ignore_eos=True)
                runs.append(clock.gaps(batch))
            out[str(batch)] = _pool(runs)

    thread = threading.Thread(target=run, name="llm")
    thread.start()
    thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-top", type=int, default=40)
    parser.add_argument("--sleep-ms", type=float, default=4.0, help="sleep_*: the model's step as a GIL-free wait")
    parser.add_argument("--fill", type=int, default=0,
                        help="requests of 32 distinct tokens served before measuring (what the prefix cache holds)")
    parser.add_argument("--parts", nargs="+", default=["llm", "serve_loop", "serve_http", "phases_http",
                                                       "phases_loop", "profile_loop", "sleep_loop", "sleep_http"])
    args = parser.parse_args()
    import torch

    rng = random.Random(9)
    result: dict = {"command": "PYTHONSAFEPATH=1 .venv/bin/python bench/engine_thread_overhead.py "
                    + " ".join(sys.argv[1:]),
                    "machine": {"cpus": len(__import__("os").sched_getaffinity(0)), "python": platform.python_version(),
                                "torch": torch.__version__, "processor": platform.processor() or platform.machine()},
                    "settings": {"batches": args.batches, "tokens": args.tokens, "prompt_len": args.prompt_len,
                                 "repeats": args.repeats, "fill": args.fill,
                                 "sleep_ms": args.sleep_ms}}
    config = None
    for part in args.parts:
        started = time.perf_counter()
        if part == "llm":
            if config is None:
                state, _, _ = _serve(args, with_http=False)
                config = state.loop.runner.config
                state.loop.stop()
            result[part] = measure_llm(args, rng, config)
        else:
            kind, mode = part.split("_")
            result[part] = measure_serve(args, rng, mode, {"serve": "gaps"}.get(kind, kind))
        print(f"{part}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        Path(args.out).write_text(json.dumps(result, indent=1))
    for part in args.parts:
        for batch, row in result[part].items():
            brief = {k: row[k] for k in ("gap_us_median", "gap_cpu_us_median", "gap_us_per_request", "forward_ms_median",
                                         "outside_forward_us", "radix_nodes_before") if k in row}
            print(part, batch, json.dumps(brief))


if __name__ == "__main__":
    main()
