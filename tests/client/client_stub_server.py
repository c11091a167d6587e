"""A tiny OpenAI-compatible server for fault injection only (the real engine is tested elsewhere).

It streams max_tokens 'x' tokens per request, reports usage with cached_tokens from an LRU of prompts
holding at most pool_tokens tokens, and misbehaves as `faults` asks:
- "boundary_empty": a prompt that cannot fit is answered '' with finish_reason=stop (the 004 trap);
- "truncate": a prompt over the context is silently cut to its first context tokens;
- "die_on_long": prompts longer than die_over_tokens get HTTP 500 and the server stops being healthy;
- "no_usage": usage is never reported;
- "serial_prefill": one prefill at a time, so a short prompt waits behind a long one (head-of-line);
- "no_tokenize": /tokenize answers 404;
- "gpu_cliff": /metrics reports 100% utilisation at 45 W of a 250 W limit.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class StubConfig:
    context_length: int = 512
    pool_tokens: int = 4096
    token_delay_s: float = 0.002
    prefill_s_per_token: float = 0.0
    die_over_tokens: int = 10**9
    # Like a hybrid engine: a prefix is reusable only up to a multiple of this many tokens.
    checkpoint_every: int = 1
    faults: set[str] = field(default_factory=set)


def build_app(config: StubConfig) -> FastAPI:
    app = FastAPI()
    cache: list[list[int]] = []
    state = {"healthy": True}
    prefill_lock = asyncio.Lock()

    def cached_prefix(prompt: list[int]) -> int:
        best = 0
        for seen in cache:
            common = 0
            for a, b in zip(seen, prompt, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        cache.append(prompt)
        while sum(len(p) for p in cache) > config.pool_tokens:
            cache.pop(0)
        return best // config.checkpoint_every * config.checkpoint_every

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        if "no_tokenize" in config.faults:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        text = (await request.json())["prompt"]
        # A word-level toy tokenizer: ids 1000 + position of the word's first occurrence.
        words = text.split()
        return {"tokens": [1000 + words.index(word) for word in words], "count": len(words)}

    @app.get("/health")
    async def health():
        return JSONResponse({"ok": state["healthy"]}, status_code=200 if state["healthy"] else 503)

    @app.get("/metrics")
    async def metrics():
        if "gpu_cliff" not in config.faults:
            return PlainTextResponse("# TYPE stub_requests gauge\nstub_requests 1\n")
        return PlainTextResponse(
            "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\nDCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} 100\n"
            "# TYPE DCGM_FI_DEV_POWER_USAGE gauge\nDCGM_FI_DEV_POWER_USAGE{gpu=\"0\"} 45\n"
            "# TYPE DCGM_FI_DEV_POWER_MGMT_LIMIT gauge\nDCGM_FI_DEV_POWER_MGMT_LIMIT{gpu=\"0\"} 250\n"
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        max_tokens = int(body.get("max_tokens", 16))
        if not isinstance(prompt, list):
            return JSONResponse({"error": {"message": "stub takes token ids only"}}, status_code=400)
        if len(prompt) > config.die_over_tokens and "die_on_long" in config.faults:
            state["healthy"] = False
            return JSONResponse({"error": {"message": "CUDA driver error: device not ready"}}, status_code=500)
        over = len(prompt) + max_tokens > config.context_length
        if over and "truncate" in config.faults:
            prompt = prompt[: config.context_length - max_tokens]
        elif over and "boundary_empty" not in config.faults:
            message = f"prompt {len(prompt)} + max_tokens {max_tokens} > context {config.context_length}"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        num_tokens = 0 if over and "boundary_empty" in config.faults else max_tokens
        cached = cached_prefix(prompt)
        return StreamingResponse(stream(len(prompt), cached, num_tokens), media_type="text/event-stream")

    async def stream(prompt_tokens: int, cached: int, num_tokens: int):
        if "serial_prefill" in config.faults:
            async with prefill_lock:
                await asyncio.sleep(config.prefill_s_per_token * (prompt_tokens - cached))
        else:
            await asyncio.sleep(config.prefill_s_per_token * (prompt_tokens - cached))
        for _ in range(num_tokens):
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}) + "\n\n"
            await asyncio.sleep(config.token_delay_s)
        yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length" if num_tokens else "stop"}]}) + "\n\n"
        if "no_usage" not in config.faults:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    return app


class AppThread:
    """Runs an ASGI app with uvicorn in a thread on a free port; `with AppThread(app) as url:`."""

    def __init__(self, app: FastAPI):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        uv_config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("test server did not start within 10 s")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class StubServer(AppThread):
    def __init__(self, config: StubConfig):
        super().__init__(build_app(config))
