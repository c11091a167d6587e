"""Tokenizers: a Hugging Face tokenizer.json with its chat template, or the byte-level one of the default model.

Both expose encode / decode / eos_token_ids / apply_chat_template, so the server does not care which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

# 256 byte values, then end-of-sequence and two chat markers.
BYTE_VOCAB_SIZE = 259


class Tokenizer(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; ids >= 256 are special and decode to nothing."""

    EOS = 256
    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self) -> None:
        self.eos_token_ids = frozenset({self.EOS})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        lines = [f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages]
        return "".join(lines) + "<|assistant|>\n"


class HFTokenizer:
    """tokenizer.json via `tokenizers`; the chat template (Jinja) and EOS from tokenizer_config.json."""

    def __init__(self, model_dir: Path, extra_eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size()
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if self._template is None and template_file.is_file():
            self._template = template_file.read_text()
        self._compiled: Any = None
        eos = {int(i) for i in extra_eos_ids}
        eos_token = config.get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        eos_id = self._tok.token_to_id(eos_token) if isinstance(eos_token, str) else None
        if eos_id is not None:
            eos.add(int(eos_id))
        self.eos_token_ids = frozenset(eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not self._template:
            return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant: "
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self._compiled is None:
            # The template comes with the model files: untrusted. The sandbox refuses attribute walks such as
            # ''.__class__.__mro__ that a plain Environment would follow to arbitrary code.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            try:
                self._compiled = env.from_string(self._template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"chat template does not compile: {exc}") from exc
        try:
            return str(self._compiled.render(messages=messages, add_generation_prompt=True))
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template: {exc}") from exc


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def load_tokenizer(model_dir: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The model directory's tokenizer.json, or the byte tokenizer when there is none (the default model)."""
    if (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir, eos_token_ids)
    return ByteTokenizer()
