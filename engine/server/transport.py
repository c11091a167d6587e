"""The HTTP/1.1 transport (uvicorn + h11) with the limits uvicorn leaves out: a deadline for the request
head and a cap on open connections, both answered rather than left hanging.

uvicorn times out idle keep-alive connections, but a client that connects and sends half a header
holds its connection forever, and `limit_concurrency` counts tasks too and answers in plain text.
Here every connection must finish its request head within header_timeout_s (408, then closed), and
a connection beyond max_connections gets 503 in the OpenAI error shape and is closed at once. The
body's deadline and byte limit are enforced where it is read (body.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from headroom.engine.server.errors import error_body
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HTTPLimits:
    """Seconds and counts for one server; the defaults are safe for an exposed port."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024
    # h11's cap on the request head (bytes); larger heads are answered 400 by h11.
    max_header_bytes: int = 32 * 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus the head deadline and the connection cap; `limits` is set per server."""

    limits: HTTPLimits = HTTPLimits()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(_raw_response(503, "Service Unavailable",
                                          f"too many open connections (max_connections={self.limits.max_connections})"))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            # A request head has begun (or a kept-alive connection started the next one): it has a deadline.
            if self._head_timer is None and not self.transport.is_closing():
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_raw_response(408, "Request Timeout",
                                                   f"request head not received within {self.limits.header_timeout_s:g} s"))
            self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, limits: HTTPLimits, log_level: str = "info") -> uvicorn.Config:
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, loop="asyncio",
                          timeout_keep_alive=int(max(1, limits.keep_alive_s)),
                          h11_max_incomplete_event_size=limits.max_header_bytes)
