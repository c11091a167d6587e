"""A request body from the socket to a validated model, bounded in bytes and seconds, off the event loop.

read_body: Content-Length or Transfer-Encoding: chunked, one byte limit for both (413 once it is passed,
before the rest is read), one deadline for the whole body (408: a client trickling its body cannot hold
a request open). parse_body: pydantic's JSON parser and the strict, bounded models (protocol.py) in a
worker thread, after a C-speed count of its JSON objects and arrays: validation holds the GIL for a
time in proportion to them, so the count is bounded per route before any parsing, and streams and
/health keep their pace while a large hostile body is refused.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from headroom.engine.server.errors import APIError, from_validation_error
from pydantic import BaseModel, ValidationError

# Generous for any text or token-id prompt that can fit the context (JSON ids take about 7 bytes each).
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_FLOOR = 1024**2

Model = TypeVar("Model", bound=BaseModel)


def max_body_bytes(context_length: int) -> int:
    """Largest request body the server reads: 64 bytes per token of context, at least 1 MiB."""
    return max(BODY_BYTES_FLOOR, BODY_BYTES_PER_TOKEN * context_length)


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise APIError(413, f"request body of {declared[:20]} bytes exceeds {max_bytes} bytes "
                            f"({BODY_BYTES_PER_TOKEN} per token of context length, at least {BODY_BYTES_FLOOR})")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(413, f"request body exceeds {max_bytes} bytes (chunked; {size} bytes so far)")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s ({size} bytes arrived)",
                       {"Connection": "close"}) from None
    return b"".join(chunks)


def count_containers(body: bytes, window: int = 1 << 16) -> int:
    """JSON objects and arrays in `body`: the `{` and `[` outside strings, by C-speed byte operations on
    64 KiB windows (each holds the GIL for a few milliseconds only)."""
    # Escaped backslashes first, then escaped quotes, so that every remaining quote opens or closes a string.
    plain = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    total, in_string = 0, False
    for start in range(0, len(plain), window):
        parts = plain[start:start + window].split(b'"')
        outside = b"".join(parts[1 if in_string else 0::2])
        total += outside.count(b"{") + outside.count(b"[")
        in_string ^= len(parts) % 2 == 0
    return total


# A completion body's prompt is text or token ids: it needs only a handful of objects and arrays.
COMPLETION_CONTAINERS = 1024


def max_containers(max_items: int) -> int:
    """Objects and arrays a chat body may hold: one per token of context, plus 1024. Every message costs its
    chat template's tokens (several) and holds at most a few containers (itself, its parts), so a body with
    more cannot fit the context; and validating a body costs time, under the GIL, in proportion to them."""
    return max_items + 1024


# jiter's words for a \ud800-style escape with no partner: the body is JSON a strict parser refuses.
_SURROGATE_ERROR = re.compile(r"surrogate|hex escape")


async def parse_body(model: type[Model], body: bytes, container_limit: int) -> Model:
    """Validate `body` as `model` in a worker thread; 400 naming the first bad field otherwise.

    A body with more than container_limit objects and arrays is refused before it is parsed."""
    if body.count(b"{") + body.count(b"[") > container_limit:
        containers = await asyncio.to_thread(count_containers, body)
        if containers > container_limit:
            raise APIError(400, f"request body holds {containers} JSON objects and arrays; at most {container_limit}"
                                " on this route", code="request_too_complex")
    try:
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        if first["type"] == "json_invalid" and _SURROGATE_ERROR.search(first["msg"]):
            # Find which field holds it: the standard library's parser keeps lone surrogates as text.
            raise await asyncio.to_thread(_locate_surrogate, body) from None
        raise from_validation_error(exc) from None


def _locate_surrogate(body: bytes) -> APIError:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return APIError(400, f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json")
    path = _first_surrogate(value, "")
    return APIError(400, f"{path or 'request body'}: holds a lone UTF-16 surrogate escape; text must be valid Unicode",
                    param=path or None, code="invalid_value")


def _first_surrogate(value: Any, path: str) -> str | None:
    """Path (messages[0].content) of the first string holding a lone surrogate, keys included."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((child, f"{where}.{key}" if where else key))
                stack.append((key, where))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None
