"""Async streaming client for OpenAI-compatible servers (headroom, vLLM, SGLang), timing every token.

Times come from time.perf_counter() (seconds). A "token event" is a streamed chunk carrying generated
text or token ids; TTFT is the first one, ITL the gaps between the following ones (as the field report
002 measured them: per chunk, so a chunk carrying several tokens counts once).
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

import httpx
from headroom.client.result import RequestResult
from headroom.client.sse import SSEDecodeError, aiter_events

ERROR_BODY_CHARS = 500


def normalize_base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000'; paths are appended per endpoint."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    trimmed = url.rstrip("/")
    return trimmed[: -len("/v1")] if trimmed.endswith("/v1") else trimmed


class OpenAIClient:
    """One connection pool to one server. Use as `async with OpenAIClient(url) as client:`."""

    def __init__(self, url: str, *, model: str | None = None, timeout_s: float = 600.0, api_key: str | None = None):
        self.base_url = normalize_base_url(url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        await self._http.aclose()

    async def get(self, path: str) -> httpx.Response | None:
        """GET path; None when the server cannot be reached at all."""
        try:
            return await self._http.get(path)
        except httpx.HTTPError:
            return None

    async def resolve_model(self) -> str:
        """The model name to send: --model if given, else the first entry of /v1/models."""
        if self.model:
            return self.model
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        entries = response.json().get("data") or []
        if not entries:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model; pass --model")
        self.model = str(entries[0]["id"])
        return self.model

    async def tokenize(self, text: str) -> list[int] | None:
        """Token ids of text via the server's /tokenize (vLLM, SGLang); None where it has none."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        try:
            response = await self._http.post("/tokenize", json=body)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        payload = response.json()
        for key in ("tokens", "token_ids", "input_ids"):
            ids = payload.get(key)
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                return ids
        return None

    async def stream_completion(
        self, prompt: list[int] | str, max_tokens: int, *, label: str = "", extra: dict[str, Any] | None = None
    ) -> RequestResult:
        """POST /v1/completions with stream=True; prompt as token ids (exact length) or text."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        sent_tokens = len(prompt) if isinstance(prompt, list) else None
        return await self._stream("/v1/completions", body, label, sent_tokens, extra)

    async def stream_chat(
        self, messages: list[dict[str, str]], max_tokens: int, *, label: str = "", extra: dict[str, Any] | None = None
    ) -> RequestResult:
        """POST /v1/chat/completions with stream=True."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens}
        return await self._stream("/v1/chat/completions", body, label, None, extra)

    async def _stream(
        self, path: str, body: dict[str, Any], label: str, sent_tokens: int | None, extra: dict[str, Any] | None
    ) -> RequestResult:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0, **(extra or {})}
        result = RequestResult(label=label, sent_prompt_tokens=sent_tokens, max_tokens=int(body["max_tokens"]))
        result.sent_at = time.perf_counter()
        try:
            async with self._http.stream("POST", path, json=body) as response:
                result.status = response.status_code
                if response.status_code >= 300:
                    text = (await response.aread()).decode("utf-8", "replace")
                    result.error = f"HTTP {response.status_code}: {text[:ERROR_BODY_CHARS]}"
                    return result
                async for event in aiter_events(response.aiter_lines()):
                    result.absorb(event, time.perf_counter())
        except (httpx.HTTPError, SSEDecodeError) as error:
            result.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        finally:
            result.done_at = time.perf_counter()
        return result
