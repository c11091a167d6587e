"""What the planner is asked (PlanRequest) and what it answers (Plan, or PlanRefused)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from headroom.engine.plan.geometry import ModelGeometry

ENGINES = ("builtin", "sglang", "vllm")
# Forks with a capability their upstream release lacks; a profile the user names (engines/profiles.py).
ENGINE_FLAVOURS = ("int-kv",)


@dataclass(frozen=True)
class Targets:
    """What the user wants served. context_length None means `auto` (as long as memory allows)."""

    context_length: int | None = None
    retained_sessions: int = 0
    session_tokens: int = 0
    max_running_requests: int | None = None
    max_new_tokens: int = 1024


@dataclass(frozen=True)
class Pinned:
    """Flags the user fixed; the planner checks them instead of deriving them."""

    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    context_length: int | None = None


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan depends on. gpu_memory_bytes is one GPU's total memory, in bytes."""

    geometry: ModelGeometry
    gpu_memory_bytes: int
    kv_dtype: str = "bf16"
    engine: str = "builtin"
    # The engine release and fork the plan is for; None: the newest stock profile of `engine`.
    engine_version: str | None = None
    engine_flavour: str | None = None
    tp: int = 1
    ssm_dtype: str | None = None
    targets: Targets = field(default_factory=Targets)
    pinned: Pinned = field(default_factory=Pinned)


@dataclass(frozen=True)
class Plan:
    """A consistent set of engine settings with its per-GPU byte ledger (all sizes in bytes)."""

    engine: str
    kv_dtype: str
    tp: int
    mem_fraction_static: float
    max_total_tokens: int
    chunked_prefill_size: int
    context_length: int
    max_running_requests: int
    max_new_tokens: int
    ssm_slots: int
    ssm_dtype: str
    kv_bytes_per_token: int
    ssm_slot_bytes: int
    gpu_memory_bytes: int
    static_bytes: int
    ledger: dict[str, int]
    binding_constraint: str
    checks: dict[str, str]
    engine_args: list[str]
    retained_sessions: int = 0
    session_tokens: int = 0
    # A revisit reuses its shared prefix rounded down to this many tokens (hybrid models: where SSM
    # checkpoints can sit; 0: not stated, as in plans written before it).
    reuse_interval_tokens: int = 0
    # The profile the plan was priced for, e.g. 'sglang 0.5.23' (engines/profiles.py).
    engine_profile: str = ""
    # How the weights are stored (geometry.weight_format): 'bf16/fp16', 'fp8 e4m3, 128x128 blocks', 'int4 W4A16, ...'.
    weight_format: str = "bf16/fp16"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"plan has unknown keys {unknown}")
        return cls(**data)


@dataclass(frozen=True)
class Alternative:
    """A nearby request that does plan: what changed, and the plan's headline numbers."""

    change: str
    context_length: int
    max_total_tokens: int
    chunked_prefill_size: int
    kv_dtype: str
    retained_sessions: int
    mem_fraction_static: float


class PlanRefused(Exception):
    """No plan satisfies every constraint; `binding_constraint` names the one that fails."""

    def __init__(self, message: str, binding_constraint: str, alternatives: list[Alternative] | None = None):
        super().__init__(message)
        self.message = message
        self.binding_constraint = binding_constraint
        self.alternatives = alternatives or []

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": self.message,
            "binding_constraint": self.binding_constraint,
            "alternatives": [asdict(a) for a in self.alternatives],
        }
