"""`headroom demo` (make demo): the operator's story from a source checkout (tests/e2e/demo.py); with
--engine-only the engine alone: plan -> serve the embedded model on CPU -> one long and several short
streaming requests at once -> per-request TTFT/ITL and the metrics that matter -> clean shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

PLAN_FIELDS = ("context_length", "max_total_tokens", "chunked_prefill_size", "max_running_requests", "ssm_slots",
               "kv_dtype", "mem_fraction_static", "binding_constraint")
METRICS_SHOWN = ("headroom_kv_used_tokens", "headroom_kv_total_tokens", "headroom_ssm_used_slots",
                 "headroom_ssm_total_slots", "headroom_prefix_cache_tokens", "headroom_cached_prompt_tokens_total",
                 "headroom_forward_passes_total", "headroom_preemptions", "headroom_admission_rejections",
                 "headroom_time_to_first_token_seconds_count", "headroom_time_to_first_token_seconds_sum")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-only", action="store_true",
                        help="the engine alone (the default is the operator's story, from a source checkout)")
    parser.add_argument("--long-tokens", type=int, default=3000, help="length of the long prompt (bytes = tokens)")
    parser.add_argument("--num-short", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunked-prefill-size", type=int, default=256)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _stream(client: Any, name: str, prompt: str, max_tokens: int, delay_s: float) -> dict[str, Any]:
    await asyncio.sleep(delay_s)
    started = time.perf_counter()
    times: list[float] = []
    usage = None
    stream = await client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, stream=True,
                                             temperature=0, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"name": name, "prompt_tokens": usage.prompt_tokens if usage else 0, "ttft_s": times[0] - started,
            "itl_mean_s": sum(gaps) / len(gaps) if gaps else 0.0, "itl_max_s": max(gaps, default=0.0),
            "tokens": usage.completion_tokens if usage else len(times)}


async def _workload(base_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="demo")
    long_prompt = ("The quick brown fox jumps over the lazy dog. " * (args.long_tokens // 45 + 1))[: args.long_tokens]
    jobs = [_stream(client, "long", long_prompt, args.max_tokens, 0.0)]
    # The short questions arrive while the long prompt is prefilling: the seed's situation.
    jobs += [_stream(client, f"short{i}", f"Question {i}: what is {i} + {i}?", args.max_tokens, 0.05 + 0.05 * i)
             for i in range(args.num_short)]
    results = await asyncio.gather(*jobs)
    await client.close()
    return list(results)


def story_script() -> Path:
    """The operator's story (emulator, operator, node agent, engine) lives with the tests of a source checkout."""
    return Path(__file__).resolve().parents[1] / "tests" / "e2e" / "demo.py"


def run(args: argparse.Namespace) -> int:
    if not args.engine_only:
        script = story_script()
        if not script.is_file():
            print(f"headroom demo: the operator's story needs a source checkout ({script} is absent); "
                  "`headroom demo --engine-only` runs the engine alone", file=sys.stderr)
            return 2
        import runpy

        runpy.run_path(str(script), run_name="__main__")
        return 0
    return run_engine_tour(args)


def run_engine_tour(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn
    from headroom.engine.server.app import build_app
    from headroom.engine.server.factory import ServeOptions, build_state, start_warm_up

    started = time.perf_counter()
    options = ServeOptions(device="cpu", context_length=8192, max_total_tokens=32768, max_new_tokens=64,
                           chunked_prefill_size=args.chunked_prefill_size, max_running_requests=8)
    state = build_state(options)
    plan = state.plan or {}
    print("plan (builtin engine, embedded model, CPU):")
    for name in PLAN_FIELDS:
        print(f"  {name:<22} {plan.get(name)}")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="headroom-demo-server", daemon=True)
    thread.start()
    start_warm_up(state).join()
    while not server.started:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    print(f"serving on {base}: /ready -> {httpx.get(base + '/ready').json()}")
    try:
        results = asyncio.run(_workload(base + "/v1", args))
        print(f"\n{'request':<8} {'prompt':>7} {'TTFT s':>8} {'ITL mean s':>11} {'ITL max s':>10} {'tokens':>7}")
        for r in results:
            print(f"{r['name']:<8} {r['prompt_tokens']:>7} {r['ttft_s']:>8.3f} {r['itl_mean_s']:>11.4f}"
                  f" {r['itl_max_s']:>10.4f} {r['tokens']:>7}")
        print("\nmetrics:")
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.startswith(METRICS_SHOWN):
                print(f"  {line}")
    finally:
        server.should_exit = True
        thread.join(10)
        state.loop.stop()
    print(f"\nserver stopped cleanly; demo took {time.perf_counter() - started:.1f} s")
    return 0
