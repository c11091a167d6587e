"""--api-key through the official openai client: 401 without the key, 200 with it; probes and /metrics open."""

from __future__ import annotations

import httpx
import openai
import pytest
from headroom.engine.server.auth import API_KEY_ENV, resolve_api_key

from tests.engine.server_fixtures import running_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("model"), api_key=KEY) as running:
        yield running


def test_without_the_key_the_openai_client_gets_401(server):
    for key in ("wrong", KEY + "x", KEY[:-1]):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as error:
            client.completions.create(model="m", prompt="hi", max_tokens=2)
        assert error.value.code == "invalid_api_key"


def test_with_the_key_the_openai_client_is_served(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == [server.state.model_name]


def test_probes_and_metrics_are_open_and_everything_else_needs_the_key(server):
    base = server.base_url
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/ready").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200
    for path in ("/plan", "/v1/models", "/v1/nothing", "/anything", "/openapi.json"):
        answer = httpx.get(base + path)
        assert answer.status_code == 401, path
        assert answer.headers["www-authenticate"] == "Bearer" and answer.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/plan", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_refused_request_is_not_read(server):
    # 401 comes before the body: a client without the key cannot make the server read or parse anything.
    hostile = b'{"prompt": [' + b",".join([b"{}"] * 300_000) + b"]}"
    answer = httpx.post(server.base_url + "/v1/completions", content=hostile, headers={"content-type": "application/json"})
    assert answer.status_code == 401


def test_metrics_can_need_the_key_too(tmp_path):
    from headroom.engine.server.app import build_app
    from starlette.testclient import TestClient

    with running_server(tmp_path, warm=False) as running:
        client = TestClient(build_app(running.state, api_key=KEY, metrics_need_key=True))
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get("/health").status_code == 200


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-flag") == "from-flag"
    with pytest.raises(ValueError, match="--api-key is empty"):
        resolve_api_key(" ")


def test_headroom_smoke_reads_the_plan_with_the_key(server):
    from headroom.client.smoke_cli import fetch_server_plan

    assert fetch_server_plan(server.base_url) == {}
    assert fetch_server_plan(server.base_url, api_key=KEY)["context_length"] == server.state.context_length
