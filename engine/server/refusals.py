"""Options OpenAI, vLLM and SGLang clients send that this server does not honour: 400 naming the field.

Each is accepted only at the value that means "off" (what a client sends when it does not use the
feature); anything else is refused rather than answered as if it had been applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_Off = Callable[[Any], bool]


def _unset(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _zero(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


def _one(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and value == 1)


def _no_top_k(value: Any) -> bool:
    return value is None or (type(value) is int and value in (0, -1))


def _no_tool_call(value: Any) -> bool:
    return value is None or value in ("none", "auto")


def _text_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


def _false(value: Any) -> bool:
    return value is None or value is False


# field -> (is off, what to say); shared by completions and chat.
SAMPLING_REFUSALS: dict[str, tuple[_Off, str]] = {
    "presence_penalty": (_zero, "presence penalties are not applied by this server (send 0 or leave it unset)"),
    "frequency_penalty": (_zero, "frequency penalties are not applied by this server (send 0 or leave it unset)"),
    "repetition_penalty": (_one, "repetition penalties are not applied by this server (send 1 or leave it unset)"),
    "logit_bias": (_empty, "logit_bias is not applied by this server (leave it unset)"),
    "top_k": (_no_top_k, "top-k sampling is not supported (send -1 or 0, or leave it unset)"),
    "min_p": (_zero, "min-p sampling is not supported (send 0 or leave it unset)"),
    "min_tokens": (_zero, "min_tokens is not supported (send 0 or leave it unset)"),
    "response_format": (_text_format, "structured output is not supported: only {'type': 'text'}"),
    "guided_json": (_unset, "guided decoding is not supported"),
    "guided_regex": (_unset, "guided decoding is not supported"),
    "guided_choice": (_unset, "guided decoding is not supported"),
    "guided_grammar": (_unset, "guided decoding is not supported"),
    "structured_outputs": (_unset, "structured output is not supported"),
    "regex": (_unset, "constrained decoding is not supported"),
    "json_schema": (_unset, "constrained decoding is not supported"),
    "ebnf": (_unset, "constrained decoding is not supported"),
    "prompt_logprobs": (_unset, "prompt_logprobs are not computed by this server (leave it unset)"),
}
COMPLETION_REFUSALS: dict[str, tuple[_Off, str]] = {
    "suffix": (_empty, "suffix (insertion) is not supported (leave it unset)"),
}
CHAT_REFUSALS: dict[str, tuple[_Off, str]] = {
    "tools": (_empty, "tool calling is not supported (leave tools unset)"),
    "functions": (_empty, "function calling is not supported (leave functions unset)"),
    "tool_choice": (_no_tool_call, "tool calling is not supported (tool_choice 'none' or unset)"),
    "function_call": (_no_tool_call, "function calling is not supported (function_call 'none' or unset)"),
    "chat_template": (_unset, "a per-request chat template is not accepted; the model's own template is used"),
    "continue_final_message": (_false, "continue_final_message is not supported"),
}


def check_off(table: dict[str, tuple[_Off, str]], name: str, value: Any) -> Any:
    """`value` when it means "off"; otherwise ValueError with the reason (pydantic puts the field in front)."""
    is_off, reason = table[name]
    if not is_off(value):
        raise ValueError(f"{reason}; got {_short(value)}")
    return value


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:
        # Python refuses to print integers of more than 4,300 digits.
        return "an integer too long to print"
    return text if len(text) <= 60 else text[:57] + "..."
