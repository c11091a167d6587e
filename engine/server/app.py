"""The OpenAI-compatible HTTP server (FastAPI): completions, chat, models, health, ready, metrics, plan.

Bodies are read and validated by body.py and protocol.py (400 naming the field); engine-level refusals are
APIError (400 context overflow, 429 queue full); every error has OpenAI's shape (errors.py); --api-key is
checked by auth.py before a body is read. Generation runs on the engine thread, never here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from headroom.engine.sequence import Sequence
from headroom.engine.server.auth import ApiKeyGuard
from headroom.engine.server.body import (
    COMPLETION_CONTAINERS,
    max_body_bytes,
    max_containers,
    parse_body,
    read_body,
)
from headroom.engine.server.errors import APIError, CatchUnexpected, error_body, install_error_handlers
from headroom.engine.server.generate import Delta, ServerState, Usage, generate, make_sequence
from headroom.engine.server.protocol import SamplingFields, bounded_models
from headroom.engine.server.transport import HTTPLimits


def build_app(state: ServerState, *, api_key: str | None = None, limits: HTTPLimits | None = None,
              metrics_need_key: bool = False) -> FastAPI:
    limits = limits or HTTPLimits()
    # No /docs, and no /openapi.json: the API is OpenAI's, and a schema endpoint only widens what is exposed.
    app = FastAPI(title="headroom", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.headroom = state
    install_error_handlers(app)
    # Pure ASGI, not @app.middleware: that wrapper hides client disconnects from the endpoints.
    # The last added runs first: the key is checked before anything else happens.
    app.add_middleware(CatchUnexpected)
    app.add_middleware(ApiKeyGuard, api_key=api_key, metrics_need_key=metrics_need_key)
    completion_model, chat_model = bounded_models(state.context_length)
    body_limit = max_body_bytes(state.context_length)

    async def body_of(request: Request, model: type[Any], container_limit: int) -> Any:
        body = await read_body(request, body_limit, limits.body_timeout_s)
        return await parse_body(model, body, container_limit)

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
    async def completions(request: Request) -> Response:
        body = await body_of(request, completion_model, COMPLETION_CONTAINERS)
        text = body.prompt_text
        # Tokenizing a long prompt takes a while: off the event loop, so running streams keep flowing.
        prompt_ids = list(body.prompt) if text is None else await _encode(state, text, "prompt")
        seq = make_sequence(state, "cmpl", prompt_ids, body, body.max_tokens, prompt_field="prompt")
        return await _respond(state, request, body, seq, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await body_of(request, chat_model, max_containers(state.context_length))
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = await asyncio.to_thread(state.tokenizer.apply_chat_template, messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        prompt_ids = await _encode(state, prompt, "messages")
        max_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        seq = make_sequence(state, "chatcmpl", prompt_ids, body, body.requested_max_tokens,
                            prompt_field="messages", max_tokens_field=max_field)
        return await _respond(state, request, body, seq, chat=True)

    return app


async def _encode(state: ServerState, text: str, field: str) -> list[int]:
    try:
        return await asyncio.to_thread(state.tokenizer.encode, text)
    except (UnicodeError, TypeError) as exc:
        # The edge refuses lone surrogates; this keeps any text a tokenizer cannot take a 400 as well.
        raise APIError(400, f"{field}: the tokenizer cannot encode this text ({type(exc).__name__})",
                       param=field) from exc


def _choice(delta: Delta, chat: bool, streaming: bool, body: SamplingFields, seq: Sequence,
            first: bool = True) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": delta.finish_reason, "logprobs": None}
    if chat and streaming:
        # OpenAI sends the role once, in the first delta; later deltas carry only content.
        choice["delta"] = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
    elif chat:
        choice["message"] = {"role": "assistant", "content": delta.text}
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
                choice = _choice(delta, chat, True, body, seq, first=delta is first)
                yield "data: " + json.dumps({**base, "object": kind, "choices": [choice]}) + "\n\n"
                delta = await anext(deltas, None)
        except APIError as exc:
            # The 200 is long sent: say what failed in the stream instead of cutting the connection.
            yield "data: " + json.dumps(error_body(exc.status, exc.message, exc.param, exc.code)) + "\n\n"
        finally:
            # A client that hung up cancels us here; closing `deltas` aborts the request in the engine.
            await deltas.aclose()
        if body.include_usage:
            yield "data: " + json.dumps({**base, "object": kind, "choices": [], "usage": usage.to_dict()}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")
