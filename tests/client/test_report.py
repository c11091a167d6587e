import json

import pytest
from headroom.client.bench import WorkloadRun, question_overlaps, run_to_dict
from headroom.client.plots import plot_distributions
from headroom.client.report import SCHEMA, markdown_table, read_result, write_result
from headroom.client.result import RequestResult
from headroom.client.workloads import builtin_workloads
from headroom.main import main


def fake_request(label: str, sent: float, first: float, gaps: list[float], cached: int = 0) -> RequestResult:
    times = [first]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestResult(
        label=label, sent_prompt_tokens=100, max_tokens=len(times), status=200, sent_at=sent, done_at=times[-1],
        token_times=times, text="x" * len(times), finish_reason="length", prompt_tokens=100,
        completion_tokens=len(times), cached_tokens=cached,
    )


def fake_result(config: str, ttft_s: float) -> dict:
    workload = builtin_workloads()["long1_short_mid"]
    run = WorkloadRun(workload, origin=0.0, wall_s=2.0)
    long_spec, question_spec = workload.requests
    run.results = [
        (0, long_spec, fake_request("long", 0.0, 1.5, [0.02, 0.03])),
        (0, question_spec, fake_request("question", 1.0, 1.0 + ttft_s, [0.01], cached=50)),
    ]
    return {"schema": SCHEMA, "config": config, "workloads": {workload.name: run_to_dict(run)}}


def test_summary_figures_of_a_run():
    data = fake_result("a", 0.2)["workloads"]["long1_short_mid"]
    summary = data["summary"]
    assert summary["requests"] == 2 and summary["errors"] == 0
    assert summary["ttft"]["max_ms"] == pytest.approx(1500.0)
    assert summary["itl"]["count"] == 3 and summary["itl"]["max_ms"] == pytest.approx(30.0)
    assert summary["aggregate_tokens_per_s"] == pytest.approx(5 / 2.0)
    assert summary["cached_token_ratio"] == pytest.approx(50 / 200)
    assert data["classes"]["question"]["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert data["questions_sent_during_prefill"] == "1/1"


def test_question_after_the_long_first_token_is_not_an_overlap():
    workload = builtin_workloads()["long1_short_mid"]
    run = WorkloadRun(workload, origin=0.0)
    run.results = [(0, workload.requests[0], fake_request("long", 0.0, 0.5, [])),
                   (0, workload.requests[1], fake_request("question", 1.0, 1.1, []))]
    assert question_overlaps(run) == [False]


def test_markdown_puts_configurations_side_by_side():
    table = markdown_table([fake_result("vllm_base", 2.3), fake_result("headroom", 0.2)])
    rows = [line for line in table.splitlines() if line.startswith("| long1_short_mid |")]
    assert [row.split(" | ")[1] for row in rows] == ["vllm_base", "headroom"]
    assert "| long1_short_mid / question | headroom |" in table
    assert "question sent during a long prefill in 1/1 runs" in table


def test_plots_and_compare_mode(tmp_path, capsys):
    paths = [write_result(fake_result(name, ttft), tmp_path / f"{name}.json") for name, ttft in (("a", 0.2), ("b", 2.0))]
    assert read_result(paths[0])["config"] == "a"
    (png,) = plot_distributions([read_result(p) for p in paths], tmp_path / "plots")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "compare"
    assert main(["bench", "--compare", *map(str, paths), "--out", str(out)]) == 0
    assert (out / "long1_short_mid.png").exists()
    assert "| long1_short_mid | b |" in (out / "table.md").read_text()
    assert "| long1_short_mid | a |" in capsys.readouterr().out


def test_result_files_are_checked(tmp_path):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="schema 'other'"):
        read_result(wrong)
    with pytest.raises(ValueError, match="cannot read"):
        read_result(tmp_path / "missing.json")
