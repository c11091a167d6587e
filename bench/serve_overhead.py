"""What `headroom serve` adds to a decode step: decode tok/s of B concurrent requests through the HTTP API
(non-streaming and streaming) against the LLM API's step time at the same batch, in one run.

    python3 bench/serve_overhead.py OUT.json [--model DIR] [--device cpu|cuda] [--port N]

Default model: the demo's generated one (engine/default_model.py), on the CPU. Each HTTP figure is
batch x 64 / (t65 - t1): B requests of 65 new tokens against B of 1 (same prompt length), so the prefill and
the request overhead cancel. The server and the handlers share the GIL with the engine thread, so per-token work
in the event loop (queue hand-off, detokenizing, metrics, SSE) shows as lost decode speed."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

RNG = random.Random(11)
BATCHES = (1, 8, 16)


def _llm_steps(model: str, device: str) -> dict[str, float]:
    """Median decode step (ms) through the LLM API at each batch, 65 new tokens, prompts of 32 tokens."""
    from headroom.engine.llm import LLM

    llm = LLM(model, device=device, max_total_tokens=8192, ssm_slots=24, chunked_prefill_size=512,
              max_running_requests=16)
    runner, inner, steps = llm.runner, llm.runner.forward, []

    def forward(items, all_positions=False, **kwargs):
        started = time.perf_counter()
        out = inner(items, all_positions, **kwargs)
        if all(len(i.token_ids) == 1 for i in items):
            steps.append((len(items), started))
        return out

    runner.forward = forward
    out = {}
    for batch in BATCHES:
        llm.generate([[RNG.randrange(32, 128) for _ in range(32)] for _ in range(batch)], max_new_tokens=4,
                     ignore_eos=True)
        steps.clear()
        llm.generate([[RNG.randrange(32, 128) for _ in range(32)] for _ in range(batch)], max_new_tokens=65,
                     ignore_eos=True)
        starts = [t for b, t in steps if b == batch]
        out[str(batch)] = statistics.median(b - a for a, b in zip(starts, starts[1:], strict=False)) * 1000
    return out


def _http(base: str, batch: int, max_tokens: int, stream: bool) -> float:
    def one(_: int) -> None:
        body = {"prompt": [RNG.randrange(32, 128) for _ in range(32)], "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        with httpx.Client(base_url=base, timeout=600) as client:
            if stream:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    for _ in response.iter_lines():
                        pass
            else:
                response = client.post("/v1/completions", json=body)
                response.raise_for_status()

    started = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        list(pool.map(one, range(batch)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--port", type=int, default=18123)
    args = parser.parse_args()
    if args.model is None:
        from headroom.engine.default_model import ensure_default_model

        args.model = str(ensure_default_model(Path("/tmp/headroom-serve-overhead-model")))
    result: dict = {"command": "python3 bench/serve_overhead.py " + " ".join(sys.argv[1:]), "model": args.model,
                    "device": args.device, "llm_step_ms": _llm_steps(args.model, args.device), "http": {}}
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from headroom.main import main; sys.exit(main())", "serve", "--model",
         args.model, "--device", args.device, "--port", str(args.port), "--max-running-requests", "16",
         "--context-length", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{args.port}"
    try:
        with httpx.Client(base_url=base) as client:
            for _ in range(1200):
                try:
                    if client.get("/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit("headroom serve exited")
                time.sleep(0.25)
        for stream in (False, True):
            for batch in BATCHES:
                _http(base, batch, 4, stream)
                t1, t65 = _http(base, batch, 1, stream), _http(base, batch, 65, stream)
                tok_s = batch * 64 / (t65 - t1)
                step_ms = result["llm_step_ms"][str(batch)]
                result["http"][f"{'stream' if stream else 'whole'}_bs{batch}"] = {
                    "t1_s": t1, "t65_s": t65, "tok_per_s": tok_s, "step_ms": batch * 1000 / tok_s,
                    "llm_tok_per_s": batch * 1000 / step_ms, "ratio_to_llm": tok_s / (batch * 1000 / step_ms)}
    finally:
        server.terminate()
        server.wait(60)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, row in result["http"].items():
        print(f"{name:12} {row['tok_per_s']:8.1f} tok/s  step {row['step_ms']:6.2f} ms  LLM {row['llm_tok_per_s']:8.1f}"
              f"  ratio {row['ratio_to_llm']:.3f}")


if __name__ == "__main__":
    main()
