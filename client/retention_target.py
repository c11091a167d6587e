"""What the retention probe tests: the plan's promise (its retained sessions and their length), never more.

Explicit sizes (--retention-sessions / --retention-tokens, or SmokeSettings fields) win. Otherwise the plan,
given (--plan, the operator's revision) or read from the server's /plan (headroom serve), says how many
sessions of what length it keeps reusable; the probe revisits at most MAX_PROBED_SESSIONS of them, no
longer than promised, and judges hits against the plan's reuse interval. A plan that retains nothing gets no
retention check; a server without a plan (a peer engine) gets the old default, DEFAULT_SESSIONS sessions of
a quarter of the context.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from headroom.client.http import OpenAIClient
from headroom.client.smoke_types import SmokeSettings

# Sessions probed without a plan: enough to see one session's prefix survive another's.
DEFAULT_SESSIONS = 2
# Sessions of a plan's promise probed at most (field report 004 revisits 3 chains).
MAX_PROBED_SESSIONS = 3


async def server_plan(client: OpenAIClient) -> dict[str, Any] | None:
    """The server's plan from GET /plan, or None (no such route, no plan, not JSON)."""
    response = await client.get("/plan")
    if response is None or response.status_code != 200:
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) and "retained_sessions" in data else None


def retention_settings(settings: SmokeSettings, plan: dict[str, Any] | None) -> SmokeSettings:
    """settings with retention_sessions, retention_tokens and checkpoint_interval_tokens resolved."""
    if plan is None:
        sessions = DEFAULT_SESSIONS if settings.retention_sessions is None else settings.retention_sessions
        return replace(settings, retention_sessions=sessions)
    interval = settings.checkpoint_interval_tokens
    if interval is None:
        interval = int(plan.get("reuse_interval_tokens") or plan.get("chunked_prefill_size") or 0) or None
    settings = replace(settings, checkpoint_interval_tokens=interval)
    if settings.retention_sessions is not None:
        return settings
    promised = int(plan.get("retained_sessions") or 0)
    if promised == 0:
        return replace(settings, retention_sessions=0)
    tokens = int(plan.get("session_tokens") or 0)
    if settings.retention_tokens is not None:
        tokens = min(tokens, settings.retention_tokens)
    return replace(
        settings, retention_sessions=min(promised, MAX_PROBED_SESSIONS),
        retention_tokens=max(1, min(tokens, settings.retention_room)),
    )
