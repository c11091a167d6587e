"""From a validated request to a stream of text deltas: context check, submit, detokenize, stop strings.

The HTTP shapes live in app.py; this module knows tokens, text and the engine loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from headroom.engine.loop.engine_loop import EngineLoop, QueueFull, RequestStream
from headroom.engine.loop.step import TokenEvent
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.errors import APIError
from headroom.engine.server.metrics import EngineMetrics
from headroom.engine.server.protocol import SamplingFields
from headroom.engine.server.tokenizer import Tokenizer

# Seconds between checks that the client is still there (the request is aborted when it is not).
_DISCONNECT_CHECK_S = 0.25


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    context_length: int
    metrics: EngineMetrics
    plan: dict[str, Any] | None = None
    default_max_tokens: int = 256
    ready: threading.Event = field(default_factory=threading.Event)
    # Set when warm-up failed: /health then answers 503 so the orchestrator restarts the server.
    warmup_error: str | None = None
    request_ids: itertools.count = field(default_factory=itertools.count)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def make_sequence(state: ServerState, prefix: str, prompt_ids: list[int], body: SamplingFields,
                  max_tokens: int | None, *, prompt_field: str = "prompt",
                  max_tokens_field: str = "max_tokens") -> Sequence:
    """Validate the prompt against the context and the vocabulary; 400 with the numbers otherwise."""
    if not prompt_ids:
        raise APIError(400, "prompt is empty after tokenization", param=prompt_field)
    vocab = state.tokenizer.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab}", param=prompt_field)
    num_prompt, context = len(prompt_ids), state.context_length
    if max_tokens is not None and max_tokens >= context:
        # Nothing is left for the prompt: say so, rather than a negative prompt budget.
        raise APIError(400, (
            f"{max_tokens_field} is {max_tokens} but context_length is {context}: prompt and completion share the"
            f" context, so with this {num_prompt}-token prompt {max_tokens_field} can be at most"
            f" {max(0, context - num_prompt)}"), param=max_tokens_field)
    max_new = max_tokens or min(state.default_max_tokens, max(1, context - num_prompt))
    if num_prompt + max_new > context:
        field = max_tokens_field if max_tokens is not None and num_prompt < context else prompt_field
        raise APIError(400, (
            f"prompt has {num_prompt} tokens and max_tokens is {max_new}: {num_prompt + max_new} exceeds"
            f" context_length {context} (at most {context - max_new} prompt tokens for this max_tokens)"
        ), param=field)
    sampling = SamplingParams(max_new_tokens=max_new, temperature=body.temperature, top_p=body.top_p,
                              seed=body.seed, ignore_eos=body.ignore_eos)
    return Sequence(f"{prefix}-{next(state.request_ids)}", list(prompt_ids), sampling)


class TextAssembler:
    """Incremental detokenization; holds back a partial UTF-8 character and a possible stop-string prefix.

    Each step decodes only the tokens since the last commit plus the window before it (the context a
    tokenizer needs for spacing), so a long output costs linear, not quadratic, decoding.
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        # token_ids[prefix_offset:read_offset] is the window already turned into text.
        self.prefix_offset = 0
        self.read_offset = 0

    def _commit(self, final: bool) -> None:
        known = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        # A trailing replacement character is a UTF-8 sequence still cut in half: wait for its last byte.
        if len(window) > len(known) and (final or not window.endswith("\ufffd")):
            self.text += window[len(known):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    def add(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """New text to send, and whether a stop string ended it."""
        self.token_ids += token_ids
        self._commit(final)
        text = self.text
        hits = [i for i in (text.find(s, max(0, self.emitted - self.hold)) for s in self.stops) if i >= 0]
        if hits:
            delta, self.emitted = text[self.emitted:min(hits)], len(text)
            return delta, True
        end = len(text) if final else len(text) - self.hold
        delta = text[self.emitted:max(self.emitted, end)]
        self.emitted += len(delta)
        return delta, False


def _take_queued(events: asyncio.Queue[TokenEvent]) -> TokenEvent | None:
    """The events already in the queue as one (None when it is empty)."""
    taken: TokenEvent | None = None
    while not events.empty():
        taken = _merged(taken, events.get_nowait())
    return taken


def _merged(first: TokenEvent | None, then: TokenEvent | None) -> TokenEvent | None:
    """Two consecutive events of one request as one: tokens in order, the later one's end (a finish or an
    error is always a request's last event), the larger cached count."""
    if first is None or then is None:
        return then if first is None else first
    return TokenEvent(first.token_ids + then.token_ids, then.finish_reason, then.error,
                      then.num_prompt_tokens or first.num_prompt_tokens,
                      max(first.num_cached_tokens, then.num_cached_tokens))


async def generate(state: ServerState, request: Request, seq: Sequence, stops: list[str],
                   usage: Usage) -> AsyncIterator[Delta]:
    """Submit `seq` and yield deltas; a client that goes away is aborted at once (slot and pages freed)."""
    stream = RequestStream(asyncio.get_running_loop(), asyncio.Queue())
    try:
        state.loop.submit(seq, state.tokenizer.eos_token_ids, stream)
    except QueueFull as exc:
        raise APIError(429, str(exc), {"Retry-After": "1"}) from exc
    usage.prompt_tokens = seq.num_prompt_tokens
    state.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
    assembler = TextAssembler(state.tokenizer, stops)
    started = last = time.perf_counter()
    next_check = started + _DISCONNECT_CHECK_S
    done = engine_done = False
    try:
        while not done:
            # Everything already queued in one go: a handler that fell behind the engine catches up in one
            # delta (one detokenize, one SSE write) instead of paying per token on the thread the engine shares.
            event = _take_queued(stream.events)
            if event is None:
                try:
                    event = _merged(await asyncio.wait_for(stream.events.get(), timeout=_DISCONNECT_CHECK_S),
                                    _take_queued(stream.events))
                except asyncio.TimeoutError:
                    event = None
            now = time.perf_counter()
            # Also while tokens flow: a non-streaming handler is never cancelled when its client leaves.
            if now >= next_check:
                next_check = now + _DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    return
            if event is None:
                continue
            if event.token_ids:
                (state.metrics.itl if usage.completion_tokens else state.metrics.ttft).observe(
                    now - (last if usage.completion_tokens else started))
                # Tokens that reached the handler together went out together: no gap between them.
                for _ in event.token_ids[1:]:
                    state.metrics.itl.observe(0.0)
                last = now
                usage.completion_tokens += len(event.token_ids)
                state.metrics.generated_tokens.inc(len(event.token_ids))
            if event.num_cached_tokens > usage.cached_tokens:
                # Only upwards: a request preempted before its first token may be re-admitted with a
                # shorter hit, and a Prometheus counter cannot go down (inc(-n) raised, HTTP 500).
                state.metrics.cached_tokens.inc(event.num_cached_tokens - usage.cached_tokens)
                usage.cached_tokens = event.num_cached_tokens
            if event.error is not None:
                raise APIError(500, f"request {seq.request_id} failed in the engine: {event.error}", code="engine_error")
            text, stopped = assembler.add(event.token_ids, final=event.finish_reason is not None)
            reason = "stop" if stopped else event.finish_reason
            engine_done = event.finish_reason is not None
            done = reason is not None
            if done:
                state.metrics.requests.labels(finish_reason=reason).inc()
            yield Delta(text, event.token_ids, reason)
    finally:
        # Client gone, or a stop string ended it before the engine did: free the slot and pages now.
        if not engine_done:
            state.loop.abort(seq.request_id)
