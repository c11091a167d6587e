"""`headroom plan`: table and JSON output, exit 2 with the binding constraint on refusal."""

from __future__ import annotations

import json

import pytest
from headroom.main import main

SEED_ARGS = [
    "plan", "--preset", "seed-27b-int2", "--gpu-memory", "12227MiB", "--tp", "2", "--kv-dtype", "int2",
    "--ssm-dtype", "fp16", "--engine", "sglang", "--engine-flavour", "int-kv", "--retained-sessions", "3", "--session-tokens", "66000",
    "--max-running-requests", "4",
]
REQUIRED_KEYS = {
    "mem_fraction_static", "max_total_tokens", "chunked_prefill_size", "context_length", "max_running_requests",
    "ssm_slots", "kv_bytes_per_token", "ssm_slot_bytes", "gpu_memory_bytes", "static_bytes", "ledger",
    "binding_constraint", "engine_args",
}


def test_json_plan_has_every_key(capsys):
    assert main([*SEED_ARGS, "--context-length", "auto", "--output", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert REQUIRED_KEYS <= set(plan)
    for key in ("weights", "kv_pool", "ssm_pool", "activations", "dequant_transient"):
        assert key in plan["ledger"]
    assert "--max-mamba-cache-size" in plan["engine_args"]


def test_refusal_exits_2_with_constraint_and_alternatives(capsys):
    code = main([*SEED_ARGS, "--context-length", "114688", "--mem-fraction-static", "0.78",
                 "--max-total-tokens", "150000", "--chunked-prefill-size", "4096", "--output", "json"])
    assert code == 2
    refusal = json.loads(capsys.readouterr().out)
    assert set(refusal) == {"error", "binding_constraint", "alternatives"}
    assert refusal["binding_constraint"] == "kv_pool"
    assert refusal["alternatives"]


def test_table_output_names_ledger_and_args(capsys):
    assert main([*SEED_ARGS, "--context-length", "65536"]) == 0
    out = capsys.readouterr().out
    assert "binding constraint" in out and "dequant_transient" in out and "--mem-fraction-static" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpu-memory", "twelve"], "--gpu-memory 'twelve' is not a size"),
        (["--mem-fraction-static", "1.5"], "mem_fraction_static must be in (0, 1), got 1.5"),
        (["--tp", "0"], "tp must be >= 1, got 0"),
    ],
)
def test_bad_input_is_named(capsys, extra, message):
    assert main([*SEED_ARGS, *extra]) == 2
    assert message in capsys.readouterr().err


def test_vllm_refuses_int2_and_offers_fp8(capsys):
    args = ["plan", "--preset", "qwen3.5-4b", "--gpu-memory", "12GiB", "--engine", "vllm", "--kv-dtype", "int2",
            "--context-length", "8192", "--output", "json"]
    assert main(args) == 2
    refusal = json.loads(capsys.readouterr().out)
    assert refusal["binding_constraint"] == "kv_dtype"


def test_model_directory_is_read(tmp_path, capsys):
    from headroom.engine.plan.presets import preset_config

    (tmp_path / "config.json").write_text(json.dumps(preset_config("qwen3.5-4b")[0]))
    assert main(["plan", "--model-config", str(tmp_path), "--gpu-memory", "24GiB", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "builtin"
