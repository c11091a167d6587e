"""The OpenAI-compatible HTTP server (FastAPI): completions, chat, models, health, ready, metrics, plan.

Bodies are validated by engine/server/protocol.py (422 on malformed JSON or fields); engine-level refusals are
APIError (400 context overflow, 429 queue full). Generation runs on the engine thread, never here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from headroom.engine.sequence import Sequence
from headroom.engine.server.generate import APIError, Delta, ServerState, Usage, generate, make_sequence
from headroom.engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


# Generous for any text or token-id prompt that can fit the context (JSON ids take about 7 bytes each).
_BODY_BYTES_PER_TOKEN = 64
_BODY_BYTES_FLOOR = 1024**2


def max_body_bytes(context_length: int) -> int:
    """Largest request body the server reads: 64 bytes per token of context, at least 1 MiB."""
    return max(_BODY_BYTES_FLOOR, _BODY_BYTES_PER_TOKEN * context_length)


class BodyLimit:
    """Bound what one request can make the server read and tokenize before the context check runs."""

    def __init__(self, app: Any, max_bytes: int, context_length: int):
        self.app, self.max_bytes, self.context_length = app, max_bytes, context_length

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            declared = dict(scope["headers"]).get(b"content-length")
            refusal = None
            if declared is None:
                refusal = _error(411, "a Content-Length header is required")
            elif not declared.isdigit() or int(declared) > self.max_bytes:
                refusal = _error(413, f"request body of {declared.decode(errors='replace')} bytes exceeds "
                                      f"{self.max_bytes} bytes ({_BODY_BYTES_PER_TOKEN} per token of context length "
                                      f"{self.context_length})")
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="headroom", docs_url=None, redoc_url=None)
    app.state.headroom = state
    # Pure ASGI, not @app.middleware: that wrapper hides client disconnects from the endpoints.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes(state.context_length), context_length=state.context_length)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return _error(422, f"invalid request body: {problems}")

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.warmup_error is not None:
            return JSONResponse({"status": "failed", "reason": state.warmup_error}, 503)
        return JSONResponse({"status": "live"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        is_ready = state.ready.is_set()
        return JSONResponse({"ready": is_ready}, 200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.refresh(state.loop)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/plan")
    async def plan() -> JSONResponse:
        return JSONResponse(state.plan if state.plan is not None else {"plan": None})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "headroom",
                "max_model_len": state.context_length}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        # Tokenizing a long prompt takes a while: off the event loop, so running streams keep flowing.
        if isinstance(body.prompt, str):
            prompt_ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt)
        elif isinstance(body.prompt[0], str):
            prompt_ids = await asyncio.to_thread(state.tokenizer.encode, str(body.prompt[0]))
        else:
            prompt_ids = [int(t) for t in body.prompt]
        seq = make_sequence(state, "cmpl", prompt_ids, body, body.max_tokens)
        return await _respond(state, request, body, seq, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = await asyncio.to_thread(state.tokenizer.apply_chat_template, messages)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        prompt_ids = await asyncio.to_thread(state.tokenizer.encode, prompt)
        seq = make_sequence(state, "chatcmpl", prompt_ids, body, body.requested_max_tokens)
        return await _respond(state, request, body, seq, chat=True)

    return app


def _choice(delta: Delta, chat: bool, streaming: bool, body: SamplingFields, seq: Sequence) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": delta.finish_reason, "logprobs": None}
    if chat:
        choice["delta" if streaming else "message"] = {"role": "assistant", "content": delta.text}
    else:
        choice["text"] = delta.text
    if body.return_token_ids:
        choice["token_ids"] = delta.token_ids
        choice["prompt_token_ids"] = seq.prompt_token_ids
    return choice


async def _respond(state: ServerState, request: Request, body: SamplingFields, seq: Sequence, chat: bool) -> Response:
    usage = Usage()
    deltas = generate(state, request, seq, body.stop_strings, usage)
    base = {"id": seq.request_id, "created": int(time.time()), "model": state.model_name}
    if not body.stream:
        parts = [d async for d in deltas]
        whole = Delta("".join(d.text for d in parts), [t for d in parts for t in d.token_ids],
                      parts[-1].finish_reason if parts else "abort")
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**base, "object": kind, "choices": [_choice(whole, chat, False, body, seq)],
                             "usage": usage.to_dict()})
    # Pull the first event before answering 200, so a full queue is still a 429.
    first = await anext(deltas, None)
    if first is None:
        # The client left before the first token (generate aborted the request): nobody reads an answer.
        return Response(status_code=499)

    async def sse() -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        delta: Delta | None = first
        try:
            while delta is not None:
                yield "data: " + json.dumps({**base, "object": kind, "choices": [_choice(delta, chat, True, body, seq)]}) + "\n\n"
                delta = await anext(deltas, None)
        except APIError as exc:
            # The 200 is long sent: say what failed in the stream instead of cutting the connection.
            kind_of_error = "invalid_request_error" if exc.status < 500 else "server_error"
            yield "data: " + json.dumps({"error": {"message": exc.message, "type": kind_of_error, "code": exc.status}}) + "\n\n"
        finally:
            # A client that hung up cancels us here; closing `deltas` aborts the request in the engine.
            await deltas.aclose()
        if body.include_usage:
            yield "data: " + json.dumps({**base, "object": kind, "choices": [], "usage": usage.to_dict()}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")
