"""Joint solver (being written in this session's first commits)."""

from headroom.engine.plan.types import Plan, PlanRequest


def make_plan(request: PlanRequest) -> Plan:
    raise NotImplementedError("planner solver lands in the next commit")
