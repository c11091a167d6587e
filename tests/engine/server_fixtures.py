"""A real uvicorn server on a free port around the embedded tiny model, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from headroom.engine.default_model import ensure_default_model
from headroom.engine.server.app import build_app
from headroom.engine.server.factory import ServeOptions, build_state, start_warm_up
from headroom.engine.server.generate import ServerState
from headroom.engine.server.transport import HTTPLimits, uvicorn_config


@dataclass
class RunningServer:
    base_url: str
    state: ServerState


@contextmanager
def running_server(model_root: Path, warm: bool = True, api_key: str | None = None,
                   limits: HTTPLimits | None = None, **overrides) -> Iterator[RunningServer]:
    """The server as `headroom serve` runs it (its uvicorn config and transport), on a free loopback port."""
    fields = dict(model=str(ensure_default_model(model_root / "default-model")), context_length=2048,
                  max_total_tokens=8192, chunked_prefill_size=128, max_running_requests=4, max_new_tokens=64)
    fields.update(overrides)
    state = build_state(ServeOptions(**fields))
    if warm:
        start_warm_up(state).join()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    limits = limits or HTTPLimits()
    app = build_app(state, api_key=api_key, limits=limits)
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(10)
        state.loop.stop()
