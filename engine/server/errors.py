"""One error shape for every route: OpenAI's `{"error": {"message", "type", "param", "code"}}`.

The official openai client maps the status to its exception class (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 429 RateLimitError) and reads `param` from the body, so every
refusal - a field, the body, the route, the key, a full queue - answers in this shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

# OpenAI's error types and codes by status (its 429 is typed "requests"); a refusal may name a more specific code.
_TYPES = {429: "requests"}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
          411: "length_required", 413: "request_too_large", 429: "rate_limit_exceeded", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as HTTP `status`; the message says the numbers, `param` names the field."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.param, self.code = param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or _CODES.get(status)}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None, *,
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


# Union members and wrappers that pydantic puts into an error's location; never a field name.
_BRANCH_MARKS = ("[", "-", "constrained")
# What a field accepts, for errors that come from no union member matching.
_EXPECTED = {
    "prompt": "a string, a list of token ids (integers) or a list of one string",
    "stop": "a string or a list of up to 4 strings",
    "content": "a string, null or a list of text parts",
}


def _path(loc: tuple[Any, ...]) -> tuple[str | None, bool]:
    """('messages', 0, 'content', 'str') -> ('messages[0].content', True): the param, and whether a union branch showed."""
    parts: list[str] = []
    branched = False
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif any(mark in item for mark in _BRANCH_MARKS) or item in {"str", "int", "float", "bool", "none"}:
            branched = True
        else:
            parts.append(("." if parts else "") + item)
    return ("".join(parts) or None), branched


def _code(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "unsupported":
        return "unsupported_parameter"
    if kind.endswith(("_type", "_parsing")) or kind in {"json_invalid", "literal_error"}:
        return "invalid_type" if kind != "json_invalid" else "invalid_json"
    return "invalid_value"


def field_is_small(error: Any) -> bool:
    """A list whose bound is a protocol rule (stop: 4, a prompt's strings: 1), not the context length."""
    return int((error.get("ctx") or {}).get("max_length", 0)) <= 4


def from_validation_error(exc: ValidationError) -> APIError:
    """400 naming one failing field (its path as `param`); the other failing fields are counted, not listed.

    When no member of a union matched (prompt, stop, content), the most telling error is a value error
    (our own message), else the deepest one; the field's accepted shapes are appended.
    """
    errors = exc.errors(include_url=False, include_input=False)
    paths = [_path(e["loc"]) for e in errors]
    # Our own messages first, then a list too long (its numbers), then the deepest error.
    chosen = next((i for i, e in enumerate(errors) if e["type"] == "value_error"), None)
    if chosen is None:
        chosen = next((i for i, e in enumerate(errors) if e["type"] == "too_long" and not field_is_small(e)), None)
    if chosen is None:
        chosen = max(range(len(errors)), key=lambda i: (len(errors[i]["loc"]), -i))
    first, (param, branched) = errors[chosen], paths[chosen]
    root = param.split(".")[0].split("[")[0] if param else None
    message = first["msg"].removeprefix("Value error, ")
    context_bound = first["type"] == "too_long" and not field_is_small(first)
    if context_bound:
        ctx = first.get("ctx") or {}
        message = (f"{ctx.get('actual_length')} items exceed the {ctx.get('max_length')} this server takes"
                   " (its context length: more cannot fit)")
    text = f"{param}: {message}" if param else f"request body: {message}"
    field = param.rsplit(".", 1)[-1].split("[")[0] if param else None
    if branched and field in _EXPECTED and not context_bound:
        text += f" ({field} takes {_EXPECTED[field]})"
    others = {p.split(".")[0].split("[")[0] for p, _ in paths if p} - {root}
    if others:
        text += f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''}: {', '.join(sorted(others)[:5])})"
    return APIError(400, text, param=param, code=_code(first["type"]))


def install_error_handlers(app: FastAPI) -> None:
    """APIError, unknown routes and methods (404/405) and anything unexpected answer in the one shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.headers, param=exc.param, code=exc.code)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, dict(exc.headers or {}))


class CatchUnexpected:
    """A bug answers 500 in the one shape and the connection stays usable.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then resets a keep-alive
    connection; this middleware sits inside it and swallows the exception once it is logged.
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                # Half an answer is already out: only closing the connection tells the client.
                raise
            await error_response(500, "internal error; the server log has the details")(scope, receive, send)
