"""The OpenAI-compatible server through the official `openai` client, against a real uvicorn server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.engine.server_fixtures import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("model")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="test", max_retries=0)


def test_completion_text_prompt_honours_max_tokens_and_reports_usage(client):
    result = client.completions.create(model="m", prompt="hello world", max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(b"hello world")
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompt_returns_token_ids(client):
    result = client.completions.create(model="m", prompt=[104, 105, 33], max_tokens=5, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = result.choices[0].model_dump()
    assert choice["prompt_token_ids"] == [104, 105, 33]
    assert len(choice["token_ids"]) == 5


def test_streaming_chat_matches_non_streaming_and_sends_usage(client):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_same_seed_same_sample(client):
    runs = [client.completions.create(model="m", prompt="abc", max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}) for _ in range(2)]
    assert runs[0].choices[0].model_dump()["token_ids"] == runs[1].choices[0].model_dump()["token_ids"]


def test_stop_string_cuts_the_text(client):
    free = client.completions.create(model="m", prompt="stop test", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(free[i:i + 2] for i in range(2, len(free) - 1) if "\ufffd" not in free[i:i + 2])
    cut = client.completions.create(model="m", prompt="stop test", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[:free.index(stop)]


def test_a_follow_up_turn_reports_cached_tokens(client):
    prompt = list(range(40, 140))
    first = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    follow_up = prompt + first.choices[0].model_dump()["token_ids"] + [50, 51, 52]
    second = client.completions.create(model="m", prompt=follow_up, max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert second.usage.prompt_tokens_details.cached_tokens >= len(prompt)


def test_prompt_that_cannot_fit_gets_400_with_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="m", prompt=[65] * 2000, max_tokens=100)
    assert "2000 tokens" in error.value.message and "max_tokens is 100" in error.value.message
    assert "context_length 2048" in error.value.message and "at most 1948" in error.value.message


@pytest.mark.parametrize("body, param", [
    (b"{not json", None), (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"), (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"max_tokens": 3}', "prompt"), (b"[1, 2]", None),
])
def test_malformed_bodies_get_400_in_openais_shape(server, body, param):
    answer = httpx.post(server.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and isinstance(error["code"], str)
    assert error["message"]


def test_engine_refusals_name_the_field_and_the_server_keeps_serving(server):
    out_of_vocab = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, 99999], "max_tokens": 2})
    assert out_of_vocab.status_code == 400 and "99999" in out_of_vocab.json()["error"]["message"]
    assert out_of_vocab.json()["error"]["param"] == "prompt"
    chat = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": []})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert httpx.get(server.base_url + "/health").json() == {"status": "live"}


def test_models_ready_plan_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [server.state.model_name]
    assert httpx.get(server.base_url + "/ready").json() == {"ready": True}
    assert httpx.get(server.base_url + "/plan").json()["chunked_prefill_size"] == 128
    text = httpx.get(server.base_url + "/metrics").text
    assert "headroom_kv_total_tokens 8192.0" in text
    count = next(line for line in text.splitlines() if line.startswith("headroom_time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1
    # No GPU here: the telemetry collector exports nothing rather than failing.
    assert "headroom_gpu_power_watts{" not in text
