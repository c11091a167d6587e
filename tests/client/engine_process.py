"""Start the real engine (`headroom serve`, embedded tiny model, CPU) as a subprocess for client tests,
and a proxy in front of it that breaks only the boundary (the fault the real engine does not have)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class EngineProcess:
    """`with EngineProcess(["--context-length", "1024"], cache_dir) as url:` waits for /ready, then stops it."""

    def __init__(self, flags: list[str], cache_dir: Path, log_path: Path):
        self.port = free_port()
        self.command = [sys.executable, "-m", "headroom.main", "serve", "--device", "cpu", "--port", str(self.port), *flags]
        self.env = {**os.environ, "HEADROOM_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"headroom serve exited {self.process.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"headroom serve not ready in {READY_TIMEOUT_S} s: {self.log_path.read_text()[-2000:]}")

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def boundary_breaking_proxy(upstream: str) -> FastAPI:
    """Forwards everything to upstream, except that a refused completion (4xx) becomes 200 with ''
    and finish_reason=stop: what field report 004 saw from a server that truncates silently."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=120.0)

    @app.get("/{path:path}")
    async def forward_get(path: str) -> Response:
        answer = await client.get(f"/{path}")
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        upstream_request = client.build_request("POST", "/v1/completions", json=body)
        answer = await client.send(upstream_request, stream=True)
        if 400 <= answer.status_code < 500:
            await answer.aclose()
            return StreamingResponse(_empty_stream(len(body["prompt"])), media_type="text/event-stream")
        if answer.status_code != 200:
            content = await answer.aread()
            return JSONResponse(json.loads(content), answer.status_code)

        async def relay():
            async for chunk in answer.aiter_raw():
                yield chunk
            await answer.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


async def _empty_stream(prompt_tokens: int):
    yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}) + "\n\n"
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
    yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"
