"""Server limits: readiness before warm-up, 429 with Retry-After, a disconnecting client frees its resources."""

from __future__ import annotations

import threading
import time

import httpx

from tests.engine.server_fixtures import running_server


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_not_ready_until_warm_up_and_429_when_the_queue_is_full(tmp_path):
    # No warm-up: the engine thread is not running, so the first request stays queued.
    with running_server(tmp_path, warm=False, max_waiting_requests=1) as server:
        assert httpx.get(server.base_url + "/health").status_code == 200
        assert httpx.get(server.base_url + "/ready").status_code == 503
        body = {"prompt": "first", "max_tokens": 2}
        first = threading.Thread(target=lambda: httpx.post(server.base_url + "/v1/completions", json=body, timeout=30))
        first.start()
        assert _wait_for(lambda: server.state.loop._inbox.qsize() == 1)
        refused = httpx.post(server.base_url + "/v1/completions", json={"prompt": "second", "max_tokens": 2})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert "max_waiting_requests=1" in refused.json()["error"]["message"]
        from headroom.engine.server.factory import warm_up

        warm_up(server.state)
        assert httpx.get(server.base_url + "/ready").json() == {"ready": True}
        first.join(30)
        assert not first.is_alive()


def test_client_disconnect_frees_slot_and_pages(tmp_path):
    with running_server(tmp_path) as server:
        steps = server.state.loop.steps
        ssm = steps.cache.ssm_allocator
        assert ssm is not None
        body = {"prompt": "tell me a long story", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert len(steps.sequences) == 1
        # The stream is closed after a few tokens of 1,500: the request must leave the engine at once.
        assert _wait_for(lambda: not steps.sequences and not steps.scheduler.has_work, timeout_s=5)
        radix = steps.cache.radix
        assert radix is not None
        kv = steps.cache.kv_allocator
        cached = radix.num_cached_tokens
        # SSM slots still in use are prefix-cache checkpoints only.
        assert ssm.num_used == radix.num_checkpoints
        # Whatever is still in use belongs to the prefix cache, not to a running request.
        assert kv.num_used_tokens == cached
        finished = [s for s in server.state.metrics.requests.collect()[0].samples if s.name.endswith("_total")]
        assert not any(s.labels["finish_reason"] == "length" and s.value for s in finished)


def test_a_failed_warm_up_is_never_ready_and_not_live(tmp_path, monkeypatch):
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.server.app import build_app
    from headroom.engine.server.factory import ServeOptions, build_state, warm_up
    from starlette.testclient import TestClient

    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=1024,
                                     max_total_tokens=4096, chunked_prefill_size=128, max_running_requests=4,
                                     max_new_tokens=64))

    def broken_forward(*_args, **_kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(state.loop.steps.runner, "forward", broken_forward)
    warm_up(state)
    client = TestClient(build_app(state))
    assert client.get("/ready").status_code == 503
    health = client.get("/health")
    assert health.status_code == 503
    assert "CUDA out of memory (simulated)" in health.json()["reason"]


def test_an_oversized_body_is_refused_before_reading(tmp_path):
    import httpx
    from headroom.engine.server.body import max_body_bytes

    from tests.engine.server_fixtures import running_server

    with running_server(tmp_path, warm=False) as server:
        limit = max_body_bytes(2048)
        too_big = b'{"model": "x", "prompt": "' + b"a" * limit + b'"}'
        answer = httpx.post(f"{server.base_url}/v1/completions", content=too_big,
                            headers={"content-type": "application/json"})
        assert answer.status_code == 413
        assert f"exceeds {limit} bytes" in answer.json()["error"]["message"]
        assert answer.json()["error"]["code"] == "request_too_large"


def test_warm_up_freezes_the_start_up_heap(tmp_path):
    """After warm-up the start-up objects (imports, model) are out of the collector's sight: a full collection
    set off by a request then scans only the request's objects (on this machine a full collection of a CPU
    server's 230K start-up objects took 174 ms, a pause of every thread; /health once took 645 ms during the
    hostile-body test)."""
    import gc

    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.server.factory import ServeOptions, build_state, warm_up

    state = build_state(ServeOptions(model=str(ensure_default_model(tmp_path / "m")), context_length=1024,
                                     max_total_tokens=4096, chunked_prefill_size=128, max_running_requests=4,
                                     max_new_tokens=64))
    gc.unfreeze()
    warm_up(state)
    try:
        assert state.ready.is_set()
        assert gc.get_freeze_count() > 100_000
    finally:
        state.loop.stop()
        gc.unfreeze()
