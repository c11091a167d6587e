"""--api-key: every route but the probes and /metrics needs `Authorization: Bearer <key>`, as in vLLM and SGLang.

Open without the key: /health and /ready (the kubelet's probes carry no credentials) and /metrics
(Prometheus scrapers; pool sizes and GPU gauges, no prompts), unless --metrics-need-key. Everything
else - /v1/*, /plan, unknown paths - answers 401 before the body is read. docs/security.md
has the whole exposure model.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from headroom.engine.server.errors import error_response

API_KEY_ENV = "HEADROOM_API_KEY"
PROBE_PATHS = frozenset({"/health", "/ready"})


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else $HEADROOM_API_KEY; an empty value means no key (and is refused when given as a flag)."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    if flag is not None and not flag.strip():
        raise ValueError("--api-key is empty; leave it out to serve without a key")
    return key or None


class ApiKeyGuard:
    """Pure ASGI (so the body is never read for a refused request); constant-time comparison."""

    def __init__(self, app: Any, api_key: str | None, metrics_need_key: bool = False):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = PROBE_PATHS if metrics_need_key else PROBE_PATHS | {"/metrics"}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        reason = "missing Authorization: Bearer <api key> header" if not given else "invalid API key"
        response = error_response(401, f"{reason} (this server was started with --api-key)",
                                  {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
