"""Where a lone long prompt's time goes inside `headroom serve` (issue 18's HTTP prefill rows).

The server is built in this process exactly as `headroom serve` builds it (its own argument parser, build_state,
the warm-up, the app under uvicorn in a thread), so that one prompt can be sent over HTTP under torch's profiler.
From each profiled request: its wall time, the GPU's busy time (the union of kernel and copy intervals), the
idle gaps between them (the largest, with the kernels on either side), and the CUDA runtime calls that blocked
the host (event and stream synchronizations, blocking copies) by total host time. Each prompt is also timed
unprofiled (best of three distinct prompts), at the default interjection lag and at a lag past the model's layer
count (the host never waits), so the lag's own cost reads off one server.
"""

from __future__ import annotations

import argparse
import gc
import random
import threading
import time
from pathlib import Path

import torch

PORT = 18090
RNG = random.Random(31)


def _prompt(n: int) -> list[int]:
    # The byte tokenizer's ids (the random model has no tokenizer of its own).
    return [RNG.randrange(32, 128) for _ in range(n)]


def _start_server(model: Path, extra: list[str]):
    import uvicorn
    from headroom.engine.server.app import build_app
    from headroom.engine.server.cli import (
        add_arguments,
        apply_gil_switch,
        http_limits_from_args,
        options_from_args,
    )
    from headroom.engine.server.factory import build_state, warm_up
    from headroom.engine.server.transport import uvicorn_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--device", "cuda", "--gpu-memory", "24GiB", "--context-length",
                              "32768", "--max-new-tokens", "512", "--max-running-requests", "16", "--port", str(PORT),
                              "--uvicorn-log-level", "warning", *extra])
    apply_gil_switch(args.gil_switch_ms)
    state = build_state(options_from_args(args))
    gc.collect()
    gc.freeze()
    warm_up(state)
    app = build_app(state, limits=http_limits_from_args(args))
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", PORT, http_limits_from_args(args), "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return state, server, thread


def _blocking_calls(prof, top: int = 12) -> dict:
    """CUDA runtime and copy calls by total host time: a synchronization or a blocking copy in the pass shows
    here as milliseconds the host spent waiting for the GPU instead of launching."""
    names = ("cuda", "aten::to", "aten::copy_", "aten::item", "aten::_local_scalar_dense", "aten::nonzero")
    rows = [e for e in prof.key_averages() if e.key.startswith(names)]
    rows.sort(key=lambda e: -e.cpu_time_total)
    return {e.key[:60]: {"calls": e.count, "ms": round(e.cpu_time_total / 1000, 3)} for e in rows[:top]}


def _allocator() -> dict[str, int]:
    """The caching allocator's device allocations, frees, retries (a cudaFree of every cached block, then again)
    and reserved bytes so far (CUDA; zeros elsewhere)."""
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "reserved_bytes.all.current")
    return {key: int(stats.get(key, 0)) for key in keys}


def serve_trace(model: Path, lengths: tuple[int, ...] = (8192, 32000), extra: tuple[str, ...] = ()) -> dict:
    import httpx
    from decode_parts import gpu_timeline
    from gpu_engine import kernels_by_name

    state, server, thread = _start_server(model, list(extra))
    layers = state.loop.runner.model_config.num_layers
    default_lag = state.loop.runner.interjection_lag
    out: dict = {"flags": list(extra), "default_lag": default_lag}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=600) as client:
            def complete(n: int) -> float:
                t0 = time.perf_counter()
                response = client.post("/v1/completions", json={"prompt": _prompt(n), "max_tokens": 1,
                                                                "ignore_eos": True, "temperature": 0})
                response.raise_for_status()
                return time.perf_counter() - t0

            for lag in (default_lag, layers + 1):
                state.loop.set_interjection_lag(lag)
                for n in lengths:
                    before = _allocator()
                    out[f"lag{lag}_{n}_first_ms"] = round(complete(n) * 1000, 2)
                    # What a first call at this length cost the caching allocator (cudaMalloc/cudaFree of new blocks).
                    after = _allocator()
                    out[f"lag{lag}_{n}_first_allocator"] = {key: after[key] - before[key] for key in after}
                    out[f"lag{lag}_{n}_ms"] = [round(complete(n) * 1000, 2) for _ in range(3)]
            state.loop.set_interjection_lag(default_lag)
            for n in lengths:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as profiler:
                    wall = complete(n)
                out[f"profiled_{n}"] = {"wall_ms": wall * 1000, "timeline": gpu_timeline(profiler, top=25),
                                        "kernels": kernels_by_name(profiler, top=25),
                                        "blocking": _blocking_calls(profiler)}
    finally:
        server.should_exit = True
        thread.join(30)
        state.loop.stop()
    return out
