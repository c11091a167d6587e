"""Shared requests for planner tests: the seed-004 case and small random geometries."""

from __future__ import annotations

import pytest
from headroom.engine.plan import PlanRequest, Targets, geometry_from_config
from headroom.engine.plan.presets import preset_config

SEED_GPU_BYTES = 12227 * 1024**2


def seed_request(**pinned_and_targets) -> PlanRequest:
    """Seed 004: 27B hybrid, 2-bit weights, TP2 on 2 x 12 GB, INT2 KV, SGLang, 3 chains of 66K."""
    from headroom.engine.plan import Pinned

    config, weight_bytes = preset_config("seed-27b-int2")
    assert weight_bytes is not None
    geometry = geometry_from_config(config).with_weight_bytes(weight_bytes)
    pin_keys = {"mem_fraction_static", "max_total_tokens", "chunked_prefill_size"}
    pinned = Pinned(**{k: v for k, v in pinned_and_targets.items() if k in pin_keys})
    target_args = dict(context_length=114688, retained_sessions=3, session_tokens=66000, max_running_requests=4)
    target_args.update({k: v for k, v in pinned_and_targets.items() if k not in pin_keys})
    return PlanRequest(
        geometry=geometry, gpu_memory_bytes=SEED_GPU_BYTES, kv_dtype="int2", engine="sglang", engine_flavour="int-kv", tp=2,
        ssm_dtype="fp16", targets=Targets(**target_args), pinned=pinned,
    )


@pytest.fixture
def seed():
    return seed_request
