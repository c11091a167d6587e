"""bench's accounting when the server misbehaves (stub); the real engine's runs are in test_real_engine.py."""

from __future__ import annotations

import json

from headroom.client.bench_cli import run as bench_run
from headroom.main import main

from tests.client.client_stub_server import StubConfig, StubServer


def test_truncating_server_is_flagged_and_failures_exit_1(tmp_path, capsys):
    config = StubConfig(context_length=300, die_over_tokens=10**9, faults={"truncate"})
    with StubServer(config) as url:
        code = main([
            "bench", "--url", url, "--workload", "prefill_heavy_c4_4k_each", "--scale", "0.1",
            "--out", str(tmp_path), "--no-progress", "--label", "truncating",
        ])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    summary = result["workloads"]["prefill_heavy_c4_4k_each"]["summary"]
    assert summary["prompt_count_mismatches"] == 4
    assert "counted other than sent" in (tmp_path / "table.md").read_text()


def test_failed_requests_are_counted_and_exit_1(tmp_path):
    config = StubConfig(die_over_tokens=100, faults={"die_on_long"})
    with StubServer(config) as url:
        code = main(["bench", "--url", url, "--workload", "mix_short6_long2_c8", "--scale", "0.1",
                     "--out", str(tmp_path), "--no-progress"])
    assert code == 1
    classes = json.loads((tmp_path / "result.json").read_text())["workloads"]["mix_short6_long2_c8"]["classes"]
    assert classes["long"]["errors"] == 2 and classes["short"]["errors"] == 0


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", "--workload", "nope"]) == 2
    assert main(["bench", "--workload", "all"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "--compare", str(bad)]) == 2
    assert "not a bench result" in capsys.readouterr().err
    assert bench_run  # the module main() dispatches to
