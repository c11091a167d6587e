"""`headroom bench`: run workloads and write result.json, table.md and one PNG per workload;
`headroom bench --compare a.json b.json ...` puts several result files side by side.
Exit 0 when every request succeeded, 1 when some failed, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from headroom.client.report import SCHEMA, markdown_table, read_result, write_result
from headroom.client.workloads import builtin_workloads, check_fits, find_workload, scale_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(builtin_workloads())
    parser.add_argument("--url", help="server base URL, e.g. http://localhost:8000")
    parser.add_argument("--workload", action="append", help=f"workload name, repeatable, or 'all' ({names}; chains_k<K>_revisit for any K)")
    parser.add_argument("--repeat", type=int, default=1, help="run each workload N times")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply prompt and output lengths (e.g. 0.1)")
    parser.add_argument("--max-prompt-tokens", type=int, help="cap every prompt at this many tokens")
    parser.add_argument("--question-delay-s", type=float, default=1.0, help="when the mid-prefill question is sent")
    parser.add_argument("--context-length", type=int, help="refuse workloads that cannot fit (default: /v1/models max_model_len)")
    parser.add_argument("--label", help="configuration name in tables and plots (default: model@host)")
    parser.add_argument("--out", help="output folder (default: bench/results/<label>)")
    parser.add_argument("--model", help="model name to send (default: first of /v1/models)")
    parser.add_argument("--tokenizer", help="local tokenizer.json choosing prompt token ids (default: /tokenize)")
    parser.add_argument("--token-id-range", type=int, nargs=2, metavar=("LOW", "HIGH"), help="prompt ids LOW..HIGH-1")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per-request timeout in seconds")
    parser.add_argument("--compare", nargs="+", metavar="RESULT", help="result.json files to put side by side (no --url)")


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected workloads; returns the result document (schema headroom.bench/v1)."""
    from headroom.client.bench import run_to_dict, run_workload
    from headroom.client.http import OpenAIClient
    from headroom.client.prompts import build_prompt_factory

    wanted = list(builtin_workloads()) if "all" in args.workload else args.workload
    chosen = [find_workload(name, args.question_delay_s) for name in wanted]
    workloads = [scale_workload(workload, args.scale, args.max_prompt_tokens) for workload in chosen]
    extra = {} if args.no_ignore_eos else {"ignore_eos": True}
    async with OpenAIClient(args.url, model=args.model, timeout_s=args.timeout_s) as client:
        model = await client.resolve_model()
        context = args.context_length or await _served_context_length(client)
        if context is not None:
            for workload in workloads:
                check_fits(workload, context)
        id_range = tuple(args.token_id_range) if args.token_id_range else None
        factory = await build_prompt_factory(client, tokenizer_path=args.tokenizer, id_range=id_range)
        result: dict[str, Any] = {
            "schema": SCHEMA, "config": args.label or f"{model}@{client.base_url.split('//')[-1]}",
            "url": client.base_url, "model": model, "started_at": datetime.now(timezone.utc).isoformat(),
            "context_length": context, "scale": args.scale, "max_prompt_tokens": args.max_prompt_tokens,
            "repeat": args.repeat, "prompt_tokens_source": factory.to_dict(), "workloads": {},
        }
        for workload in workloads:
            run = await run_workload(client, factory, workload, repeat=args.repeat, extra=extra, show_progress=not args.no_progress)
            result["workloads"][workload.name] = run_to_dict(run)
    return result


async def _served_context_length(client: Any) -> int | None:
    # vLLM lists max_model_len in /v1/models; other servers may not, and then nothing is checked here.
    response = await client.get("/v1/models")
    if response is None or response.status_code != 200:
        return None
    for entry in response.json().get("data") or []:
        if entry.get("id") == client.model and isinstance(entry.get("max_model_len"), int):
            return int(entry["max_model_len"])
    return None


def write_outputs(results: list[dict[str, Any]], out: Path) -> str:
    from headroom.client.plots import plot_distributions

    table = markdown_table(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table)
    for path in plot_distributions(results, out):
        print(f"wrote {path}", file=sys.stderr)
    return table


def run(args: argparse.Namespace) -> int:
    try:
        if args.compare:
            results = [read_result(path) for path in args.compare]
            print(write_outputs(results, Path(args.out or "bench/results/compare")))
            return 0
        if not args.url or not args.workload:
            raise ValueError("give --url and --workload (or --compare RESULT ...)")
        result = asyncio.run(run_bench(args))
    except ValueError as error:
        print(f"headroom bench: {error}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, RuntimeError, OSError) as error:
        print(f"headroom bench: server {args.url} unusable: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    out = Path(args.out or Path("bench/results") / result["config"].replace("/", "_").replace(":", "_"))
    write_result(result, out / "result.json")
    print(write_outputs([result], out))
    print(f"wrote {out / 'result.json'}", file=sys.stderr)
    errors = sum(w["summary"]["errors"] for w in result["workloads"].values())
    return 1 if errors else 0
