"""What `headroom serve`'s HTTP path costs the engine per token, with the model taken out: the real app, uvicorn
config and handlers (generate, SSE), fed by a stand-in engine thread that pushes one token to every running
request per step the way EngineLoop does (RequestStream), sleeping STEP_MS between steps with the GIL released
as a GPU step would. B streaming clients read in another process.

Why: on the H200 decode through HTTP ran at 0.72 of the library API at batch 16 (session 8 call A). The engine
thread shares the GIL with the event loop that formats and writes every token; each step it waits for that.
This measures, on any machine, how long the stand-in's steps really take against STEP_MS + HOST_MS (its own
Python per step, holding the GIL): the excess is the wait a real engine would add to each step, for one stream
and for B, so a change to the per-token path shows up in numbers a 2-core CPU resolves.

    python3 bench/http_token_path.py OUT.json [--batch 16] [--tokens 400] [--step-ms 4] [--host-ms 1]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time, httpx
    url, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    async def one(client, i):
        body = {"prompt": [1, 2, 3], "max_tokens": tokens, "stream": True, "ignore_eos": True}
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
        return n
    async def main():
        async with httpx.AsyncClient() as client:
            t = time.perf_counter()
            counts = await asyncio.gather(*[one(client, i) for i in range(batch)])
            print(json.dumps({"chunks": sum(counts), "seconds": time.perf_counter() - t}))
    asyncio.run(main())
""")


class StandInLoop:
    """EngineLoop's surface the server uses (submit, abort, stats for /metrics), producing tokens without a
    model: every step_s, one token for each running request, then a finish after its max_tokens."""

    def __init__(self, step_s: float, host_s: float = 0.0):
        self.step_s, self.host_s = step_s, host_s
        self.running: dict[str, tuple[object, object, int]] = {}
        self.lock = threading.Lock()
        self.periods: list[float] = []
        self.stopped = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="stand-in-engine").start()

    def submit(self, seq, eos_token_ids, stream) -> None:
        with self.lock:
            self.running[seq.request_id] = (seq, stream, 0)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.running.pop(request_id, None)

    def _run(self) -> None:
        from headroom.engine.loop.step import TokenEvent

        last = time.perf_counter()
        while not self.stopped.is_set():
            time.sleep(self.step_s)  # the GPU step: the GIL is free meanwhile
            # The engine's own Python per step (scheduling, sampling, the batch's bookkeeping): holds the GIL.
            spin_until = time.perf_counter() + self.host_s
            while time.perf_counter() < spin_until:
                pass
            with self.lock:
                items = list(self.running.items())
            for request_id, (seq, stream, done) in items:
                done += 1
                final = done >= seq.sampling.max_new_tokens
                stream.push(TokenEvent([65 + done % 26], "length" if final else None,
                                       num_prompt_tokens=seq.num_prompt_tokens))
                with self.lock:
                    if final:
                        self.running.pop(request_id, None)
                    elif request_id in self.running:
                        self.running[request_id] = (seq, stream, done)
            now = time.perf_counter()
            if items:
                self.periods.append(now - last)
            last = now


def _serve(step_s: float, host_s: float):
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.server.generate import ServerState
    from headroom.engine.server.metrics import EngineMetrics
    from headroom.engine.server.tokenizer import load_tokenizer

    loop = StandInLoop(step_s, host_s)
    state = ServerState(loop=loop, tokenizer=load_tokenizer(ensure_default_model(), [0]), model_name="stand-in",
                        context_length=4096, metrics=EngineMetrics())
    state.ready.set()
    server, url = serve_in_thread(state)
    return loop, server, url


def serve_in_thread(state):
    """The real app over a ServerState on a free loopback port, uvicorn in a daemon thread: (server, url).
    Also bench/engine_thread_overhead.py's."""
    import uvicorn
    from headroom.engine.server.app import build_app
    from headroom.engine.server.transport import HTTPLimits, uvicorn_config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    limits = HTTPLimits()
    server = uvicorn.Server(uvicorn_config(build_app(state, limits=limits), "127.0.0.1", port, limits,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}"


def run_case(step_ms: float, host_ms: float, batch: int, tokens: int) -> dict:
    loop, server, url = _serve(step_ms / 1000, host_ms / 1000)
    out = subprocess.run([sys.executable, "-c", CLIENT, url, str(batch), str(tokens)], capture_output=True,
                         text=True, timeout=600, check=True)
    client = json.loads(out.stdout)
    loop.stopped.set()
    server.should_exit = True
    periods = loop.periods[5:-5] or loop.periods
    return {"step_ms": step_ms, "host_ms": host_ms, "batch": batch, "tokens": tokens, "chunks": client["chunks"],
            "chunks_per_s": client["chunks"] / client["seconds"],
            "step_period_ms_median": statistics.median(periods) * 1000,
            "step_period_ms_mean": statistics.fmean(periods) * 1000,
            "engine_wait_per_step_ms": statistics.fmean(periods) * 1000 - step_ms - host_ms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--host-ms", type=float, default=1.0, help="the stand-in engine's own Python per step")
    args = parser.parse_args()
    # One request alone first: the same engine thread with one stream, the baseline of the step period.
    cases = [run_case(args.step_ms, args.host_ms, 1, args.tokens),
             run_case(args.step_ms, args.host_ms, args.batch, args.tokens)]
    result = {"command": "python3 bench/http_token_path.py " + " ".join(sys.argv[1:]), "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for case in cases:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in case.items()}))


if __name__ == "__main__":
    main()
