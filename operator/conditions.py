"""status.conditions: Planned, Deployed, Validated, Ready, Degraded, each with a reason.

lastTransitionTime changes only when a condition's status flips, as Kubernetes conventions ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

CONDITION_TYPES = ("Planned", "Deployed", "Validated", "Ready", "Degraded")
Truth = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Condition:
    type: str
    status: Truth
    reason: str
    message: str = ""


def merge_conditions(
    existing: list[dict[str, Any]], updates: list[Condition], *, now: str, generation: int | None
) -> list[dict[str, Any]]:
    """Apply `updates` over `existing` (a status.conditions list); order follows CONDITION_TYPES."""
    by_type = {c.get("type"): dict(c) for c in existing if c.get("type")}
    for update in updates:
        if update.type not in CONDITION_TYPES:
            raise ValueError(f"unknown condition type {update.type!r}; known: {CONDITION_TYPES}")
        old = by_type.get(update.type, {})
        flipped = old.get("status") != update.status
        by_type[update.type] = {
            "type": update.type,
            "status": update.status,
            "reason": update.reason,
            "message": update.message,
            "lastTransitionTime": now if flipped else old.get("lastTransitionTime", now),
            **({"observedGeneration": generation} if generation is not None else {}),
        }
    return [by_type[t] for t in CONDITION_TYPES if t in by_type]


def condition_status(conditions: list[dict[str, Any]], type_: str) -> str | None:
    for condition in conditions:
        if condition.get("type") == type_:
            return str(condition.get("status"))
    return None
