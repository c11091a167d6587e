"""`headroom serve` takes the flags `headroom plan` renders for the builtin engine, and checks them."""

from __future__ import annotations

import argparse

import pytest
from headroom.engine.default_model import ensure_default_model
from headroom.engine.plan import PlanRequest, Targets, load_geometry, make_plan, parse_size
from headroom.engine.server.cli import add_arguments, options_from_args
from headroom.engine.server.factory import build_state


def _serve_args(model_dir, engine_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", str(model_dir), "--device", "cpu", "--gpu-memory", "2GiB",
                              "--max-new-tokens", "64", *engine_args])


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    model_dir = ensure_default_model(tmp_path_factory.mktemp("serve") / "default-model")
    plan = make_plan(PlanRequest(
        geometry=load_geometry(model_dir), gpu_memory_bytes=parse_size("2GiB"), engine="builtin",
        targets=Targets(context_length=2048, max_running_requests=4, max_new_tokens=64),
    ))
    return model_dir, plan


def test_the_plans_builtin_flags_start_the_same_plan(rendered):
    model_dir, plan = rendered
    state = build_state(options_from_args(_serve_args(model_dir, plan.engine_args)))
    served = state.plan
    for key in ("max_total_tokens", "chunked_prefill_size", "context_length", "max_running_requests", "ssm_slots"):
        assert served[key] == getattr(plan, key), key
    state.loop.stop()


def test_ssm_slots_that_disagree_with_the_plan_are_refused(rendered):
    model_dir, plan = rendered
    args = [*plan.engine_args]
    args[args.index("--ssm-slots") + 1] = str(plan.ssm_slots + 1)
    with pytest.raises(ValueError, match=f"--ssm-slots {plan.ssm_slots + 1} disagrees with the plan's {plan.ssm_slots}"):
        build_state(options_from_args(_serve_args(model_dir, args)))


def test_a_plan_file_whose_context_exceeds_the_kv_pool_is_refused(rendered, tmp_path):
    import dataclasses
    import json

    model_dir, plan = rendered
    edited = dataclasses.replace(plan, context_length=plan.max_total_tokens + 1)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited.to_dict()))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--device", "cpu", "--plan", str(path)])
    expected = f"context_length {plan.max_total_tokens + 1} exceeds its max_total_tokens {plan.max_total_tokens}"
    with pytest.raises(ValueError, match=expected):
        build_state(options_from_args(args))


def test_a_cuda_plan_is_sized_by_the_memory_cuda_reports(monkeypatch):
    """NVML's total exceeds what CUDA can allocate (H200: 150.75 vs 150.11 GB); planning for NVML's
    figure made ModelRunner refuse the plan at start-up."""
    import torch
    from headroom.engine.server.factory import ServeOptions, resolve_plan

    cuda_total = 150_109_880_320
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (cuda_total - 10**9, cuda_total))
    plan = resolve_plan(ServeOptions(device="cuda"), ensure_default_model())
    assert plan.gpu_memory_bytes == cuda_total


def test_cuda_graph_max_batch_reaches_the_engine_and_its_static_passes_serve_requests(rendered):
    """--cuda-graph-max-batch on the CPU runs the graphs' static decode pass (no capture) inside the server's
    engine loop: outputs equal the eager server's, and every finished request gives its table row back."""
    from headroom.engine.sequence import SamplingParams, Sequence

    model_dir, plan = rendered
    outputs = {}
    for flag in ("0", "3"):
        state = build_state(options_from_args(_serve_args(model_dir, [*plan.engine_args, "--cuda-graph-max-batch", flag])))
        runner = state.loop.runner
        assert runner.config.cuda_graph_max_batch == int(flag)
        assert (runner.decode_graphs is not None) == (flag != "0")
        static_passes = []
        if runner.decode_graphs is not None:
            graphed = runner.decode_graphs.run
            runner.decode_graphs.run = lambda items, graphed=graphed, n=static_passes: n.append(1) or graphed(items)
        tokens: dict[str, list[int]] = {}
        state.loop.steps.emit = lambda rid, event, tokens=tokens: tokens.setdefault(rid, []).extend(event.token_ids)
        for i, length in enumerate((5, 40, 9)):
            prompt = [(11 * j + i) % 200 + 3 for j in range(length)]
            state.loop.steps.add(Sequence(f"r{i}", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)),
                                 frozenset())
        state.loop.run_until_idle()
        outputs[flag] = tokens
        if runner.decode_graphs is not None:
            assert runner.decode_graphs.leased_rows == 0 and len(static_passes) >= 5
        state.loop.stop()
    assert outputs["0"] == outputs["3"] and all(len(t) == 12 for t in outputs["3"].values())
