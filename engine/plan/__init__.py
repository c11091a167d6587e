"""The joint memory planner: pure Python, no torch, fast enough for admission webhooks.

make_plan(PlanRequest) -> Plan, or raises PlanRefused naming the binding constraint.
"""

from headroom.engine.plan.geometry import (
    GeometryError,
    ModelGeometry,
    geometry_from_config,
    load_geometry,
)
from headroom.engine.plan.kv_format import (
    KV_DTYPES,
    KVFormat,
    kv_bytes_per_token,
    kv_format,
    ssm_slot_bytes,
)
from headroom.engine.plan.solver import make_plan
from headroom.engine.plan.types import ENGINES, Alternative, Pinned, Plan, PlanRefused, PlanRequest, Targets
from headroom.engine.plan.units import format_bytes, parse_size

__all__ = [
    "ENGINES",
    "KV_DTYPES",
    "Alternative",
    "GeometryError",
    "KVFormat",
    "ModelGeometry",
    "Pinned",
    "Plan",
    "PlanRefused",
    "PlanRequest",
    "Targets",
    "format_bytes",
    "geometry_from_config",
    "kv_bytes_per_token",
    "kv_format",
    "load_geometry",
    "make_plan",
    "parse_size",
    "ssm_slot_bytes",
]
