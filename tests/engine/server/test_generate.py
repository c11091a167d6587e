"""generate(): a client that leaves is noticed while tokens flow, not only when the stream goes quiet."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from headroom.engine.loop.step import TokenEvent
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.generate import ServerState, Usage, generate
from headroom.engine.server.metrics import EngineMetrics
from headroom.engine.server.tokenizer import ByteTokenizer

from tests.engine.server_fixtures import running_server


class EndlessLoop:
    """Stands in for EngineLoop: a token every few milliseconds until the request is aborted."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self._task: asyncio.Task | None = None

    def submit(self, seq, eos_token_ids, stream) -> None:
        async def feed() -> None:
            while seq.request_id not in self.aborted:
                stream.events.put_nowait(TokenEvent([ord("a")], None, None, seq.num_prompt_tokens))
                await asyncio.sleep(0.005)

        self._task = asyncio.get_running_loop().create_task(feed())

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class GoneClient:
    def __init__(self) -> None:
        self.checks = 0

    async def is_disconnected(self) -> bool:
        self.checks += 1
        return True


def test_a_client_gone_during_a_steady_token_flow_is_aborted():
    loop = EndlessLoop()
    state = ServerState(loop=loop, tokenizer=ByteTokenizer(), model_name="m", context_length=10_000,  # type: ignore[arg-type]
                        metrics=EngineMetrics(with_gpu=False))
    seq = Sequence("cmpl-0", [104, 105], SamplingParams(max_new_tokens=5000))
    client = GoneClient()

    async def consume() -> int:
        return len([d async for d in generate(state, client, seq, [], Usage())])  # type: ignore[arg-type]

    # Tokens never pause for the 0.25 s poll: the request must still leave within a few checks.
    num_deltas = asyncio.run(asyncio.wait_for(consume(), timeout=5.0))
    assert loop.aborted == ["cmpl-0"]
    assert client.checks >= 1
    assert num_deltas < 5000


def test_a_stream_whose_client_left_before_the_first_token_ends_without_a_server_error(tmp_path):
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    # No warm-up: the engine thread is not running, so no first token ever comes.
    with running_server(tmp_path, warm=False) as server:
        # After uvicorn's own logging setup, which replaces the handlers of its loggers.
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            body = {"prompt": "hello", "max_tokens": 4, "stream": True}
            with pytest.raises(httpx.TimeoutException):
                httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.3)
            deadline = time.monotonic() + 10
            # generate notices the departure at its next poll and queues the abort.
            while server.state.loop._inbox.qsize() < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.state.loop._inbox.qsize() == 2
            time.sleep(0.5)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not [r for r in errors if "Exception in ASGI application" in r.getMessage()]


def test_an_engine_failure_mid_stream_is_reported_in_the_stream(tmp_path):
    with running_server(tmp_path) as server:
        runner = server.state.loop.steps.runner

        def failing_forward(batch, all_positions=False):
            raise RuntimeError("CUDA out of memory (simulated)")

        body = {"prompt": "tell me a long story", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            assert '"choices"' in next(lines)
            runner.forward = failing_forward
            rest = list(lines)
        errors = [line for line in rest if '"error"' in line]
        assert len(errors) == 1 and "CUDA out of memory (simulated)" in errors[0] and '"type": "server_error"' in errors[0]
        assert rest[-1] == "data: [DONE]"


class FallingHitLoop:
    """Stands in for EngineLoop: the cached-token count falls between events, as after a preemption."""

    def submit(self, seq, eos_token_ids, stream) -> None:
        stream.events.put_nowait(TokenEvent([], None, None, seq.num_prompt_tokens, 64))
        stream.events.put_nowait(TokenEvent([ord("a")], None, None, seq.num_prompt_tokens, 32))
        stream.events.put_nowait(TokenEvent([ord("b")], "length", None, seq.num_prompt_tokens, 32))

    def abort(self, request_id: str) -> None:
        pass


class PresentClient:
    async def is_disconnected(self) -> bool:
        return False


def test_a_falling_cached_token_count_never_decrements_the_counter():
    """Seen once in about 180 preempted requests: Counter.inc(-32) raised and the request answered HTTP 500."""
    metrics = EngineMetrics(with_gpu=False)
    state = ServerState(loop=FallingHitLoop(), tokenizer=ByteTokenizer(), model_name="m", context_length=10_000,  # type: ignore[arg-type]
                        metrics=metrics)
    usage = Usage()

    async def consume() -> list[str]:
        seq = Sequence("cmpl-1", list(range(100)), SamplingParams(max_new_tokens=2))
        return [d.text async for d in generate(state, PresentClient(), seq, [], usage)]  # type: ignore[arg-type]

    assert "".join(asyncio.run(consume())) == "ab"
    assert usage.cached_tokens == 64
    assert metrics.cached_tokens._value.get() == 64


def test_queued_events_are_taken_as_one_delta():
    """A handler behind the engine takes every queued event at once: tokens in order, the last one's end."""
    import asyncio

    from headroom.engine.loop.step import TokenEvent
    from headroom.engine.server.generate import _take_queued

    events: asyncio.Queue[TokenEvent] = asyncio.Queue()
    assert _take_queued(events) is None
    for event in (TokenEvent([1], None, None, 5, 2), TokenEvent([2, 3]), TokenEvent([4], "length", None, 5, 3)):
        events.put_nowait(event)
    merged = _take_queued(events)
    assert merged == TokenEvent([1, 2, 3, 4], "length", None, 5, 3)
    assert events.empty()
