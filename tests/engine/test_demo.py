"""`headroom demo --engine-only` end to end on CPU: plan, serve, long + short streams, metrics, clean stop.

The operator's story (`headroom demo` without the flag) is tests/e2e/demo.py, run by tests/e2e/test_demo.py."""

from __future__ import annotations

import argparse

from headroom import demo


def test_demo_runs_and_reports_ttft_and_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEADROOM_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--engine-only", "--long-tokens", "1200", "--num-short", "2", "--max-tokens", "4"])) == 0
    out = capsys.readouterr().out
    assert "chunked_prefill_size   256" in out
    for name in ("long", "short0", "short1"):
        assert any(line.startswith(name) for line in out.splitlines())
    assert "headroom_kv_total_tokens 32768.0" in out
    assert "server stopped cleanly" in out
    assert (tmp_path / "default-model" / "model.safetensors").is_file()
