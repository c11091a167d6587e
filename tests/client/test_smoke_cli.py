"""`headroom smoke` exit codes and --plan reading (servers: the fault-injection stub)."""

from __future__ import annotations

import json

from headroom.engine.plan import Plan
from headroom.main import main

from tests.client.client_stub_server import StubConfig, StubServer

FAST = ["--short-delay-s", "0.01", "--metrics-interval-s", "0.05"]


def write_plan(path, **overrides):
    fields = dict(
        engine="builtin", kv_dtype="bf16", tp=1, mem_fraction_static=0.8, max_total_tokens=4096,
        chunked_prefill_size=256, context_length=512, max_running_requests=8, max_new_tokens=32, ssm_slots=16,
        ssm_dtype="fp32", kv_bytes_per_token=64, ssm_slot_bytes=1024, gpu_memory_bytes=2**30, static_bytes=2**29,
        ledger={}, binding_constraint="none", checks={}, engine_args=[], retained_sessions=3, session_tokens=100,
    )
    fields.update(overrides)
    path.write_text(json.dumps(Plan(**fields).to_dict()))
    return str(path)


def test_plan_file_drives_the_probe_sizes_and_a_faulty_server_exits_1(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.json")
    report_path = tmp_path / "report.json"
    with StubServer(StubConfig(faults={"boundary_empty"})) as url:
        code = main(["smoke", "--url", url, "--plan", plan, "--output", str(report_path), *FAST])
    assert code == 1
    report = json.loads(report_path.read_text())
    assert report["passed"] is False
    assert report["settings"]["context_length"] == 512 and report["settings"]["retention_sessions"] == 3
    assert report["figures"]["retention"]["session_tokens"] == 100
    # The plan's chunk is the hybrid checkpoint spacing: 100-token sessions hold no reusable checkpoint.
    assert report["settings"]["checkpoint_interval_tokens"] == 256
    assert report["checks"]["retention"]["status"] == "skip"
    assert report["checks"]["boundary_no_room_for_output"]["status"] == "fail"
    assert "FAIL  boundary_no_room_for_output" in capsys.readouterr().err


def test_healthy_stub_exits_0_with_json_on_stdout(capsys):
    with StubServer(StubConfig()) as url:
        code = main(["smoke", "--url", url, "--context-length", "512", "--max-new-tokens", "32",
                     "--retention-tokens", "64", *FAST])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["smoke", "--url", "http://127.0.0.1:9"]) == 2
    assert "--context-length" in capsys.readouterr().err
    assert main(["smoke", "--url", "http://127.0.0.1:9", "--context-length", "40", "--max-new-tokens", "32"]) == 2
    assert "leaves no room" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"context_length": 5, "surprise": 1}))
    assert main(["smoke", "--url", "http://127.0.0.1:9", "--plan", str(bad)]) == 2
    assert "unknown keys" in capsys.readouterr().err
    assert main(["smoke", "--url", "ftp://x", "--context-length", "512", "--max-new-tokens", "8"]) == 2
    assert "http://" in capsys.readouterr().err
