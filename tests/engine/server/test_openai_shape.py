"""What an OpenAI-client user sees: BadRequestError with `param` for what is not honoured or mistyped, one
error shape on every route, max_tokens beyond the context explained, the role once per chat stream."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.engine.server_fixtures import running_server

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("model")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("param, options", [
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("functions", {"functions": [{"name": "f", "parameters": {}}]}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": -1.0}),
    ("logit_bias", {"logit_bias": {"65": 10}}),
])
def test_chat_options_that_are_not_honoured_are_bad_requests_naming_the_param(client, param, options):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, **options)
    assert error.value.param == param and error.value.code == "invalid_value"
    assert param.split("_")[0] in error.value.message


def test_their_off_values_are_accepted(client):
    answer = client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, presence_penalty=0,
                                            frequency_penalty=0, logit_bias={}, tools=[], tool_choice="none",
                                            response_format={"type": "text"})
    assert answer.choices[0].message.role == "assistant"


@pytest.mark.parametrize("param, body", [
    ("stream", {"prompt": "x", "stream": "yes"}),
    ("max_tokens", {"prompt": "x", "max_tokens": True}),
    ("temperature", {"prompt": "x", "temperature": "0.5"}),
    ("prompt[1]", {"prompt": [1, "2"]}),
    ("suffix", {"prompt": "x", "suffix": "y"}),
    ("top_k", {"prompt": "x", "top_k": 5}),
])
def test_completion_fields_are_strictly_typed(client, param, body):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="m", prompt=body.pop("prompt"), extra_body=body)
    assert error.value.param == param, error.value.message


def test_a_text_part_whose_text_is_an_object_is_a_bad_request(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": {"nested": "object"}}]}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert error.value.param == "messages[0].content[0].text"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=image, max_tokens=2)
    assert error.value.param == "messages[0].content[0].type" and "only 'text'" in error.value.message


def test_max_tokens_beyond_the_context_says_what_fits(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="m", prompt="hello", max_tokens=10**12)
    message = error.value.message
    assert error.value.param == "max_tokens"
    assert "max_tokens is 1000000000000 but context_length is 2048" in message and "at most 2043" in message
    assert "-" not in message.split("at most")[1]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=CHAT, max_completion_tokens=5000)
    assert error.value.param == "max_completion_tokens"


def test_a_token_list_longer_than_the_context_gets_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="m", prompt=[65] * 2049, max_tokens=2)
    assert error.value.param == "prompt" and "2049 items exceed the 2048" in error.value.message


def test_chat_streams_send_the_role_only_in_the_first_delta(client):
    chunks = [c for c in client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, stream=True,
                                                        extra_body={"ignore_eos": True}) if c.choices]
    assert len(chunks) >= 2
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])


def test_every_route_answers_errors_in_one_shape(server):
    def shape(answer: httpx.Response) -> dict:
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return error

    base = server.base_url
    missing = httpx.get(base + "/v1/nothing-here")
    assert missing.status_code == 404 and "GET /v1/nothing-here" in shape(missing)["message"]
    wrong_method = httpx.get(base + "/v1/completions")
    assert wrong_method.status_code == 405 and shape(wrong_method)["code"] == "method_not_allowed"
    unparsable = httpx.post(base + "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert unparsable.status_code == 400 and shape(unparsable)["code"] == "invalid_json"
    assert httpx.get(base + "/openapi.json").status_code == 404


def test_a_full_queue_is_a_rate_limit_error_in_openais_shape(tmp_path):
    import threading

    with running_server(tmp_path, warm=False, max_waiting_requests=1) as server:
        first = threading.Thread(target=lambda: httpx.post(server.base_url + "/v1/completions",
                                                           json={"prompt": "a", "max_tokens": 2}, timeout=60))
        first.start()
        while server.state.loop._inbox.qsize() < 1:
            pass
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as error:
            client.completions.create(model="m", prompt="b", max_tokens=2)
        assert error.value.body["type"] == "requests" and error.value.code == "rate_limit_exceeded"
        from headroom.engine.server.factory import warm_up

        warm_up(server.state)
        first.join(60)
