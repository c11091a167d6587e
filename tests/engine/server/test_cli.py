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
            runner.decode_graphs.run = lambda items, *rest, graphed=graphed, n=static_passes: n.append(1) or graphed(items, *rest)
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


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_vllm_and_sglang_spellings_mean_the_same_as_headrooms(tmp_path):
    ours = options_from_args(_parse(["--model", "/m", "--device", "cpu", "--context-length", "4096",
                                     "--max-running-requests", "6", "--cuda-graph-max-batch", "4",
                                     "--kv-cache-dtype", "bf16", "--dtype", "bfloat16", "--tensor-parallel-size", "1"]))
    vllm = options_from_args(_parse(["--model", "/m", "--device", "cpu", "--max-model-len", "4096",
                                     "--max-num-seqs", "6", "--cuda-graph-max-batch", "4",
                                     "--kv-cache-dtype", "auto", "--dtype", "bfloat16", "--tensor-parallel-size", "1",
                                     "--trust-remote-code"]))
    sglang = options_from_args(_parse(["--model-path", "/m", "--device", "cpu", "--context-length", "4096",
                                       "--max-running-requests", "6", "--cuda-graph-max-bs", "4",
                                       "--kv-cache-dtype", "bfloat16", "--dtype", "bfloat16", "--tp", "1"]))
    assert ours == vllm == sglang
    assert options_from_args(_parse(["--device", "cpu", "--dtype", "half", "--kv-cache-dtype", "fp8_e4m3"])).dtype == "float16"
    assert options_from_args(_parse(["--device", "cpu", "--kv-cache-dtype", "fp8_e4m3"])).kv_dtype == "fp8"


def test_help_is_grouped_like_vllms_and_sglangs():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups}
    assert {"model", "HTTP server", "memory and plan", "scheduling", "diagnostics"} <= set(groups)
    assert "--api-key" in groups["HTTP server"] and "--served-model-name" in groups["model"]
    assert "--kv-cache-dtype" in groups["memory and plan"] and "--max-waiting-requests" in groups["scheduling"]


def test_served_model_name_and_dtype_reach_the_server(rendered):
    model_dir, plan = rendered
    args = _serve_args(model_dir, [*plan.engine_args, "--served-model-name", "my-model", "--dtype", "float32",
                                   "--kv-cache-dtype", "auto"])
    state = build_state(options_from_args(args))
    assert state.model_name == "my-model" and state.plan["kv_dtype"] == "bf16"
    assert str(state.loop.runner.dtype) == "torch.float32"
    state.loop.stop()


def test_http_flags_become_the_transports_limits():
    from headroom.engine.server.cli import http_limits_from_args

    limits = http_limits_from_args(_parse(["--header-timeout", "3", "--body-timeout", "7", "--max-connections", "50",
                                           "--timeout-keep-alive", "2"]))
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.max_connections, limits.keep_alive_s) == (3, 7, 50, 2)
    defaults = http_limits_from_args(_parse([]))
    assert defaults.header_timeout_s == 10 and defaults.body_timeout_s == 60 and defaults.max_connections == 1024


@pytest.mark.parametrize("flags,interjects", [([], True), (["--no-interjection"], False),
                                              (["--scheduler-policy", "fair"], False), (["--strict-fcfs"], False)])
def test_interjection_is_the_default_and_its_flag_switches_it_off(rendered, flags, interjects):
    from headroom.engine.scheduler.types import ScheduledPass

    model_dir, plan = rendered
    state = build_state(options_from_args(_serve_args(model_dir, [*plan.engine_args, *flags])))
    config = state.loop.scheduler.config
    long_pass = ScheduledPass()
    long_pass.add_item(_long_request(config.short_limit + 1), config.short_limit + 1)
    assert state.loop.scheduler.is_interruptible(long_pass) is interjects
    state.loop.stop()


def _long_request(tokens: int):
    from headroom.engine.scheduler.types import SchedRequest

    return SchedRequest("long", prompt_len=tokens, max_new_tokens=1)


@pytest.mark.parametrize("flags,lag", [([], 2), (["--interjection-lag", "6"], 6)])
def test_interjection_lag_reaches_the_runner(rendered, flags, lag):
    model_dir, plan = rendered
    state = build_state(options_from_args(_serve_args(model_dir, [*plan.engine_args, *flags])))
    assert state.loop.runner.interjection_lag == lag
    state.loop.stop()


def test_an_interjection_lag_below_one_layer_is_refused_before_loading(rendered):
    model_dir, plan = rendered
    with pytest.raises(ValueError, match=r"--interjection-lag 0 must be at least 1"):
        build_state(options_from_args(_serve_args(model_dir, [*plan.engine_args, "--interjection-lag", "0"])))


@pytest.mark.parametrize("value", ["0", "-1", "250"])
def test_a_gil_switch_interval_out_of_range_is_refused_before_loading(rendered, monkeypatch, capsys, value):
    import sys

    from headroom.engine.server import cli, factory

    def must_not_load(options):
        raise AssertionError("the model was loaded before --gil-switch-ms was checked")

    monkeypatch.setattr(factory, "build_state", must_not_load)
    before = sys.getswitchinterval()
    model_dir, plan = rendered
    assert cli.run(_serve_args(model_dir, [*plan.engine_args, "--gil-switch-ms", value])) == 2
    assert f"--gil-switch-ms must be above 0 and at most 100 ms, got {float(value):g}" in capsys.readouterr().err
    assert sys.getswitchinterval() == before


def test_the_gil_switch_interval_is_set_from_the_flag(monkeypatch):
    import sys

    from headroom.engine.server.cli import GIL_SWITCH_MS, apply_gil_switch

    monkeypatch.setattr(sys, "setswitchinterval", lambda s: calls.append(s))
    calls: list[float] = []
    apply_gil_switch(0.5)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    apply_gil_switch(parser.parse_args([]).gil_switch_ms)
    assert calls == [0.0005, GIL_SWITCH_MS / 1000]


def test_cpu_threads_reach_the_engine_thread(rendered):
    """--cpu-threads sets torch's intra-op threads in the engine loop's own thread, before its first step."""
    import threading
    import time

    import torch

    model_dir, plan = rendered
    state = build_state(options_from_args(_serve_args(model_dir, [*plan.engine_args, "--cpu-threads", "3"])))
    runner, seen = state.loop.runner, []
    prepare = runner.prepare_thread

    def recording() -> None:
        prepare()
        seen.append((threading.current_thread().name, torch.get_num_threads()))

    runner.prepare_thread = recording
    try:
        state.loop.start()
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [("headroom-engine", 3)]
    finally:
        state.loop.stop()


def test_cpu_threads_below_one_are_refused_before_loading(rendered):
    model_dir, plan = rendered
    with pytest.raises(ValueError, match="cpu_threads must be >= 1, got 0"):
        build_state(options_from_args(_serve_args(model_dir, [*plan.engine_args, "--cpu-threads", "0"])))
