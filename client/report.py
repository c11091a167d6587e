"""Bench result files: write/read JSON, and render several configurations side by side as markdown.

A result file is one configuration (one server, one set of flags) over one or more workloads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = "headroom.bench/v1"


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=2) + "\n")
    return target


def read_result(path: str | Path) -> dict[str, Any]:
    """A result file, checked for the fields the table and plots read."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read a bench result ({error})") from error
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a bench result (schema {data.get('schema') if isinstance(data, dict) else None!r}, want {SCHEMA!r})")
    for field in ("config", "workloads"):
        if field not in data:
            raise ValueError(f"{path}: bench result lacks {field!r}")
    return data


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


HEADER = (
    "| workload | config | reqs | errors | agg tok/s | TTFT p50 | TTFT p95 | TTFT max "
    "| ITL p50 | ITL p95 | ITL max | e2e p95 | cached |"
)


def _row(workload: str, config: str, s: dict[str, Any]) -> str:
    ttft, itl, e2e = s["ttft"], s["itl"], s["e2e"]
    cells = [
        workload, config, str(s["requests"]), str(s["errors"]), _rate(s["aggregate_tokens_per_s"]),
        _ms(ttft["p50_ms"]), _ms(ttft["p95_ms"]), _ms(ttft["max_ms"]),
        _ms(itl["p50_ms"]), _ms(itl["p95_ms"]), _ms(itl["max_ms"]), _ms(e2e["p95_ms"]),
        _percent(s["cached_token_ratio"]),
    ]
    return "| " + " | ".join(cells) + " |"


def workload_names(results: list[dict[str, Any]]) -> list[str]:
    """Workloads in first-seen order across the result files."""
    names: list[str] = []
    for result in results:
        names += [name for name in result["workloads"] if name not in names]
    return names


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per (workload, configuration), then per request class; latencies in ms."""
    lines = ["Latencies in ms; agg tok/s = generated tokens / wall time; cached = cached / prompt tokens.", "", HEADER]
    lines.append("|" + "---|" * HEADER.count(" | ") + "---|")
    class_lines: list[str] = []
    for name in workload_names(results):
        for result in results:
            workload = result["workloads"].get(name)
            if workload is None:
                continue
            lines.append(_row(name, result["config"], workload["summary"]))
            for label, summary in workload["classes"].items():
                class_lines.append(_row(f"{name} / {label}", result["config"], summary))
    lines += ["", "Per request class:", "", HEADER, "|" + "---|" * HEADER.count(" | ") + "---|", *class_lines]
    notes = [
        f"- {result['config']} / {name}: question sent during a long prefill in {data['questions_sent_during_prefill']} runs"
        for result in results
        for name, data in result["workloads"].items()
        if "questions_sent_during_prefill" in data
    ]
    mismatches = [
        f"- {result['config']} / {name}: {data['summary']['prompt_count_mismatches']} requests counted other than sent (truncation?)"
        for result in results
        for name, data in result["workloads"].items()
        if data["summary"]["prompt_count_mismatches"]
    ]
    if notes or mismatches:
        lines += ["", *notes, *mismatches]
    return "\n".join(lines) + "\n"
