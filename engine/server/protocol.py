"""OpenAI-compatible request bodies (pydantic): strict types, size bounds, errors that name the field.

Strict: `stream: "yes"`, `max_tokens: true` or a text part whose text is an object are 400, never
coerced. Bounded: bounded_models(max_items) caps every list (prompt ids, messages, content parts) at
the context length, so pydantic refuses an oversized list before validating its items. Unknown
fields are ignored (clients send many); options that change the answer but are not honoured here
(refusals.py; n > 1, logprobs, echo, best_of > 1) are refused with the field named.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from headroom.engine.server.refusals import CHAT_REFUSALS, COMPLETION_REFUSALS, SAMPLING_REFUSALS, check_off
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator

# Lists in models built without bounded_models (the library and unit tests).
DEFAULT_MAX_ITEMS = 1 << 20
# Integers a client sends are bounded, so that no message ever prints a 5,000-digit number (Python refuses to).
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Count = Annotated[int, Field(ge=1, lt=1 << 63)]
_STRICT = ConfigDict(strict=True, extra="ignore")


def valid_text(value: str, field: str) -> str:
    """A lone UTF-16 surrogate (e.g. from json.loads of "\\ud800") cannot be encoded: refuse it here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} holds a lone surrogate {value[exc.start]!r} at character {exc.start}; "
                         "text must be valid Unicode") from None
    return value


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    # Not computed here: refused when asked for, rather than answered with null logprobs or no echo.
    logprobs: bool | Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    # vLLM extensions.
    ignore_eos: bool = False
    return_token_ids: bool = False
    # Accepted only at their "off" value (refusals.py).
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    prompt_logprobs: Any = None

    @field_validator(*SAMPLING_REFUSALS)
    @classmethod
    def _off(cls, value: Any, info: ValidationInfo) -> Any:
        return check_off(SAMPLING_REFUSALS, str(info.field_name), value)

    @field_validator("logprobs", "top_logprobs", "echo")
    @classmethod
    def _not_supported(cls, value: bool | int | None, info: ValidationInfo) -> bool | int | None:
        if value:
            raise ValueError(f"{info.field_name}={value!r} is not supported by this server (leave it unset)")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"best_of={value} is not supported: one candidate per request (best_of 1)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        for s in stops:
            valid_text(s, "stop")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """/v1/completions: prompt as text, or as token ids (one prompt per request)."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1, max_length=DEFAULT_MAX_ITEMS, fail_fast=True)] | \
        Annotated[list[str], Field(min_length=1, max_length=1)]
    suffix: Any = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        return check_off(COMPLETION_REFUSALS, "suffix", value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _as_python(cls, value: Any) -> Any:
        # One conversion to Python, not one per failing union member (see ChatMessage._as_python).
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt is empty")
            return valid_text(value, "prompt")
        if isinstance(value[0], str):
            valid_text(value[0], "prompt")
        return value

    @property
    def prompt_text(self) -> str | None:
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if isinstance(self.prompt[0], str) else None


class TextPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"content part of type {value[:40]!r}: only 'text' is supported")
        return value

    @field_validator("text")
    @classmethod
    def _valid(cls, value: str) -> str:
        return valid_text(value, "text")


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[TextPart], Field(max_length=DEFAULT_MAX_ITEMS, fail_fast=True)] | None = None
    tool_calls: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _as_python(cls, value: Any) -> Any:
        # Taken as one Python value first: otherwise each union member that fails copies the whole JSON
        # list into its error, under the GIL (a 33k-object content list stalled the event loop 0.5 s).
        return value

    @field_validator("content")
    @classmethod
    def _valid(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        return valid_text(value, "content") if isinstance(value, str) else value

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value: Any) -> Any:
        return check_off(CHAT_REFUSALS, "tools", value)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """/v1/chat/completions: the chat template turns messages into the prompt."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=DEFAULT_MAX_ITEMS, fail_fast=True)]
    max_completion_tokens: Count | None = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    chat_template: Any = None
    continue_final_message: Any = None

    @field_validator(*CHAT_REFUSALS)
    @classmethod
    def _chat_off(cls, value: Any, info: ValidationInfo) -> Any:
        return check_off(CHAT_REFUSALS, str(info.field_name), value)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def bounded_models(max_items: int) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The two request models with every list capped at max_items (a server's context length): a list
    that long holds more tokens than the context, and pydantic refuses it before looking at its items."""
    ids = Annotated[list[TokenId], Field(min_length=1, max_length=max_items, fail_fast=True)]
    texts = Annotated[list[str], Field(min_length=1, max_length=1)]
    completion = create_model("CompletionRequest", __base__=CompletionRequest,
                              prompt=(str | ids | texts, ...))
    message = create_model("ChatMessage", __base__=ChatMessage,
                           content=(str | Annotated[list[TextPart], Field(max_length=max_items, fail_fast=True)] | None, None))
    # Any: mypy cannot follow a list of a model class made at run time.
    messages: Any = Annotated[list[message], Field(min_length=1, max_length=max_items, fail_fast=True)]  # type: ignore[valid-type]
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, messages=(messages, ...))
    return completion, chat
