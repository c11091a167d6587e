"""Deterministic prompts of an exact token count, sent as token ids.

Why token ids: /v1/completions accepts a list of ints on headroom, vLLM and SGLang, and the server then
sees exactly the tokens sent, so "a prompt of N tokens" means N tokens for any tokenizer, with no
template or BOS to guess. Which ids to use is the only tokenizer question; in order of preference:
1. a local tokenizer.json (--tokenizer), encoding a fixed English text;
2. the server's /tokenize on that same text (vLLM, SGLang);
3. a fixed id range (--token-id-range, default 32..126: printable bytes, present in byte-level BPE
   vocabularies such as Qwen's and in byte tokenizers).
Each (session, part) pair seeds its own generator, so sessions share no prefix and a revisit repeats
its session's prefix exactly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from headroom.client.http import OpenAIClient

DEFAULT_ID_RANGE = (32, 127)
MIN_VOCABULARY = 16

SOURCE_TEXT = " ".join(
    "the river carried letters from the northern valley to a city of bridges where clerks sorted "
    "every page by the colour of its ink and the weight of its paper while engineers measured tides "
    "counted lanterns wrote reports about memory budgets chunked schedules patient queues quiet "
    "kernels long documents short questions and the small machines that answered them all day".split()
)


@dataclass(frozen=True)
class PromptFactory:
    """Builds prompts from a pool of token ids. source says where the pool came from (for the report)."""

    vocabulary: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        if len(set(self.vocabulary)) < MIN_VOCABULARY:
            raise ValueError(f"prompt vocabulary has {len(set(self.vocabulary))} distinct ids; need >= {MIN_VOCABULARY}")

    def make(self, num_tokens: int, *, session: int | str, part: str = "body") -> list[int]:
        """num_tokens ids, the same for the same (session, part), different across sessions."""
        if num_tokens < 1:
            raise ValueError(f"prompt length must be >= 1 token, got {num_tokens}")
        generator = random.Random(f"headroom/{session}/{part}")
        return [generator.choice(self.vocabulary) for _ in range(num_tokens)]

    def session_prompt(self, context_tokens: int, question_tokens: int, *, session: int | str, visit: int | str) -> list[int]:
        """A session's fixed context followed by a question that differs per visit (the 004 chains)."""
        return self.make(context_tokens, session=session) + self.make(question_tokens, session=session, part=f"q{visit}")

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source, "distinct_ids": len(set(self.vocabulary))}


def from_id_range(low: int, high: int) -> PromptFactory:
    """Ids low..high-1."""
    if not 0 <= low < high:
        raise ValueError(f"--token-id-range must satisfy 0 <= low < high, got {low}..{high}")
    return PromptFactory(tuple(range(low, high)), f"id range {low}..{high - 1}")


def from_tokenizer_file(path: str | Path) -> PromptFactory:
    """Ids of SOURCE_TEXT under a local tokenizer.json (the `tokenizers` library, no torch)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path)).encode(SOURCE_TEXT, add_special_tokens=False).ids
    return PromptFactory(_distinct(ids), f"tokenizer file {path}")


async def build_prompt_factory(
    client: OpenAIClient, *, tokenizer_path: str | None = None, id_range: Sequence[int] | None = None
) -> PromptFactory:
    """The preferred source available: tokenizer file, then the server's /tokenize, then the id range."""
    if tokenizer_path:
        return from_tokenizer_file(tokenizer_path)
    if id_range is None:
        ids = await client.tokenize(SOURCE_TEXT)
        if ids and len(set(ids)) >= MIN_VOCABULARY:
            return PromptFactory(_distinct(ids), f"server /tokenize ({client.base_url})")
    low, high = id_range if id_range is not None else DEFAULT_ID_RANGE
    return from_id_range(low, high)


def _distinct(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(set(ids)))
