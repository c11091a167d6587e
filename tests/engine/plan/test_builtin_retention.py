"""The builtin plan's prefix-reuse promise: checkpoint slots sized to the sessions the pool retains, targets
honoured exactly, and a refusal naming kv_pool when the sessions do not fit."""

from __future__ import annotations

import pytest
from headroom.engine.plan import PlanRefused, PlanRequest, Targets, geometry_from_config, make_plan
from headroom.engine.plan.engines.builtin import CHECKPOINT_STOPS_PER_REQUEST, CHECKPOINTS_PER_SESSION
from headroom.engine.plan.presets import preset_config

GiB = 1024**3


def _request(gib: int = 24, kv_dtype: str = "bf16", **targets) -> PlanRequest:
    geometry = geometry_from_config(preset_config("qwen3.5-4b")[0])
    return PlanRequest(geometry=geometry, gpu_memory_bytes=gib * GiB, kv_dtype=kv_dtype, engine="builtin",
                       targets=Targets(max_new_tokens=256, **targets))


@pytest.mark.parametrize("kv_dtype", ["bf16", "int2"])
def test_default_plan_retains_the_pool_in_sessions_whose_checkpoints_stay_a_quarter_of_their_memory(kv_dtype):
    plan = make_plan(_request(kv_dtype=kv_dtype, context_length=32768))
    states = CHECKPOINTS_PER_SESSION * plan.ssm_slot_bytes
    kv = plan.session_tokens * plan.kv_bytes_per_token
    # A quarter context at least, longer until the states take <= 25% (bf16: 14,148 tokens), at most the context
    # (int2: its KV is so small that even a full context's states outweigh a third of it).
    assert plan.context_length // 4 <= plan.session_tokens <= plan.context_length
    assert states <= 0.25 * (states + kv) + plan.kv_bytes_per_token or plan.session_tokens == plan.context_length
    assert (kv_dtype == "int2") == (plan.session_tokens == plan.context_length)
    assert plan.retained_sessions == plan.max_total_tokens // plan.session_tokens >= 1
    # Every retained session keeps its checkpoints, on top of one prefill's stops and the running requests:
    # the plan's own policy never has to evict a retained session's last state to serve its promise.
    assert plan.ssm_slots == (plan.retained_sessions * CHECKPOINTS_PER_SESSION + CHECKPOINT_STOPS_PER_REQUEST
                              + plan.max_running_requests)
    assert f"retains {plan.retained_sessions} sessions x {plan.session_tokens} tokens" in plan.checks["prefix_reuse"]
    # Tail checkpoints sit on 64-token multiples, which are whole pages of every KV dtype.
    assert plan.reuse_interval_tokens == 64


def test_retained_session_targets_are_honoured_exactly():
    plan = make_plan(_request(context_length=32768, retained_sessions=3, session_tokens=16016))
    assert (plan.retained_sessions, plan.session_tokens) == (3, 16016)
    assert plan.ssm_slots == 3 * CHECKPOINTS_PER_SESSION + CHECKPOINT_STOPS_PER_REQUEST + plan.max_running_requests
    assert plan.max_total_tokens >= 3 * 16016


def test_sessions_that_do_not_fit_the_pool_are_refused_naming_kv_pool():
    # Field report 004's shape: 3 chains that together exceed what the memory holds.
    with pytest.raises(PlanRefused) as refused:
        make_plan(_request(gib=12, context_length=32768, retained_sessions=3, session_tokens=32000))
    assert refused.value.binding_constraint == "kv_pool"
    assert any(alt.change.startswith("retained_sessions 3 ->") for alt in refused.value.alternatives)
