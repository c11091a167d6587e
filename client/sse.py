"""Server-sent events, as OpenAI-compatible servers stream them: `data: <json>` blocks, `data: [DONE]` last.

Only the data field matters for these APIs; comments (`: keep-alive`) and `event:`/`id:` fields are ignored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Iterable, Iterator
from typing import Any

DONE = "[DONE]"


class SSEDecodeError(ValueError):
    """A data block that is not JSON (and not [DONE])."""


def data_blocks(lines: Iterable[str]) -> Iterator[str]:
    """Group lines into events and yield each event's data (multi-line data joined with newlines)."""
    pending: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if line == "":
            if pending:
                yield "\n".join(pending)
                pending = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            # The spec strips exactly one space after the colon.
            pending.append(value[1:] if value.startswith(" ") else value)
    if pending:
        yield "\n".join(pending)


def decode_block(block: str) -> dict[str, Any] | None:
    """One data block as a JSON object; None for the [DONE] sentinel."""
    if block.strip() == DONE:
        return None
    try:
        decoded = json.loads(block)
    except json.JSONDecodeError as error:
        raise SSEDecodeError(f"stream event is not JSON: {block[:200]!r}") from error
    if not isinstance(decoded, dict):
        raise SSEDecodeError(f"stream event is not a JSON object: {block[:200]!r}")
    return decoded


async def aiter_events(lines: AsyncIterable[str]) -> Any:
    """Async generator of decoded JSON events from an async line iterator; stops at [DONE]."""
    pending: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if line != "":
            pending.append(line)
            continue
        for block in data_blocks(pending):
            event = decode_block(block)
            if event is None:
                return
            yield event
        pending = []
    for block in data_blocks(pending):
        event = decode_block(block)
        if event is None:
            return
        yield event
