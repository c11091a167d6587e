"""The builtin engine model's non-static lines: decode-graph memory follows the graphs the engine captures."""

from __future__ import annotations

import pytest
from headroom.engine.plan import PlanRequest, Targets, geometry_from_config, make_plan
from headroom.engine.plan.engines.builtin import DECODE_GRAPH_MAX_BATCH
from headroom.engine.plan.presets import preset_config

MiB = 1024**2


def _plan(preset: str, kv_dtype: str, running: int, gib: int = 48, tp: int = 1):
    geometry = geometry_from_config(preset_config(preset)[0])
    return make_plan(PlanRequest(
        geometry=geometry, gpu_memory_bytes=gib * 1024**3, kv_dtype=kv_dtype, engine="builtin", tp=tp,
        targets=Targets(context_length=8192, max_running_requests=running, max_new_tokens=256),
    ))


@pytest.mark.parametrize("running", [1, 8, 64, 100])
def test_graph_reserve_grows_with_the_graphs_captured(running):
    graphs = min(running, DECODE_GRAPH_MAX_BATCH)
    reserve = _plan("qwen3.5-4b", "bf16", running).ledger["graph_reserve"]
    assert reserve == 320 * MiB + graphs * 8 * MiB


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int2"])
def test_kivi_pools_are_graphed_and_reserved_for_like_the_others(kv_dtype):
    """KIVI decode steps are graphed since their open pages sit in a static window buffer (KVPool)."""
    assert _plan("qwen3.5-4b", kv_dtype, 8).ledger["graph_reserve"] == 320 * MiB + 8 * 8 * MiB


def test_sparse_moe_models_capture_no_graphs():
    assert _plan("qwen3-next-80b-a3b", "fp8", 8, gib=141, tp=2).ledger["graph_reserve"] == 0


def test_allocator_slack_is_a_multiple_of_the_activations():
    for kv_dtype, scale in (("bf16", 0.85), ("int2", 1.2)):
        ledger = _plan("qwen3.5-4b", kv_dtype, 8).ledger
        assert ledger["fragmentation"] == int(scale * ledger["activations"])
