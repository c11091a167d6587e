"""OpenAI-compatible request bodies (pydantic): validation at the edge, errors that name the field.

Unknown fields are ignored (clients send many); fields we accept but cannot honour (n > 1, logprobs,
top_logprobs, echo, best_of > 1) are refused with 422.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    # Not computed here: refused when asked for, rather than answered with null logprobs or no echo.
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    # vLLM extensions.
    ignore_eos: bool = False
    return_token_ids: bool = False

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
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError(f"stop takes at most 4 non-empty strings, got {stops!r}")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """/v1/completions: prompt as text, or as token ids (one prompt per request)."""

    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt is an empty list")
            if isinstance(value[0], str) and len(value) != 1:
                raise ValueError(f"prompt lists {len(value)} strings; one prompt per request is supported")
        elif not value:
            raise ValueError("prompt is empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content part of type {part.get('type')!r}: only 'text' is supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    """/v1/chat/completions: the chat template turns messages into the prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
