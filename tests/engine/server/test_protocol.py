"""Request bodies: what the server cannot honour is refused with the field named, not silently answered."""

from __future__ import annotations

import pytest
from headroom.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pydantic import ValidationError

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field, value", [("logprobs", 5), ("logprobs", True), ("top_logprobs", 2), ("echo", True),
                                          ("best_of", 3)])
def test_unsupported_options_are_refused_by_name(field, value):
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert field in str(error.value) and "not supported" in str(error.value)


def test_chat_logprobs_are_refused():
    with pytest.raises(ValidationError, match="logprobs=True is not supported"):
        ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 3})


@pytest.mark.parametrize("fields", [{}, {"logprobs": None}, {"logprobs": 0}, {"logprobs": False}, {"echo": False},
                                    {"best_of": 1}, {"top_logprobs": 0}])
def test_defaults_and_explicit_off_values_are_accepted(fields):
    assert CompletionRequest.model_validate({"prompt": "x", **fields}).prompt == "x"
    assert ChatCompletionRequest.model_validate({**CHAT, **fields}).messages[0].content == "hi"
