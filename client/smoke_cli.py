"""`headroom smoke`: run the smoke test, write the JSON report, exit 0 (passed) / 1 (failed) / 2 (usage)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from headroom.client.retention_target import retention_settings
from headroom.client.smoke_types import SmokeReport, SmokeSettings, SmokeThresholds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://localhost:8000")
    parser.add_argument("--plan", help="plan.json from `headroom plan` (context, max_new_tokens, retention targets; "
                        "default: the server's GET /plan)")
    parser.add_argument("--context-length", type=int, help="the server's context length in tokens")
    parser.add_argument("--max-new-tokens", type=int, help="output tokens the plan reserves per request")
    parser.add_argument("--model", help="model name to send (default: first of /v1/models)")
    parser.add_argument("--tokenizer", help="local tokenizer.json choosing prompt token ids (default: /tokenize)")
    parser.add_argument("--token-id-range", type=int, nargs=2, metavar=("LOW", "HIGH"), help="prompt ids LOW..HIGH-1")
    parser.add_argument("--output", help="write the JSON report here (default: stdout)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--wait-ready-s", type=float, default=0.0, help="first wait this long for /ready to answer 200")
    parser.add_argument("--api-key", default=None,
                        help="Bearer key of a server started with --api-key (default: $HEADROOM_API_KEY)")
    sizes = parser.add_argument_group("probe sizes")
    sizes.add_argument("--margin-tokens", type=int, default=16, help="long prompt = context - max_new_tokens - margin")
    sizes.add_argument("--short-delay-s", type=float, default=0.5, help="send the short prompt this long after the long one")
    sizes.add_argument("--retention-sessions", type=int,
                       help="sessions revisited (default: what the plan retains, at most 2; no plan: 2; 0 disables)")
    sizes.add_argument("--retention-tokens", type=int, help="tokens per session (default: plan's, else context/4)")
    sizes.add_argument("--checkpoint-interval", type=int,
                       help="hybrid engines: reusable prefixes round down to this (default: plan's reuse interval)")
    sizes.add_argument("--saturation-requests", type=int, help="concurrent requests (default: --plan's running; 0 off)")
    sizes.add_argument("--saturation-prompt-tokens", type=int, help="prompt tokens each (default: 2x pool shared)")
    sizes.add_argument("--saturation-deadline-s", type=float, default=300.0, help="all must finish within this")
    sizes.add_argument("--metrics-interval-s", type=float, default=1.0, help="/metrics polling period")
    sizes.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers that reject it)")
    limits = parser.add_argument_group("thresholds")
    limits.add_argument("--max-short-ttft-s", type=float, default=2.0, help="short prompt's TTFT limit during the long prefill")
    limits.add_argument("--min-prefill-tok-s", type=float, help="minimum long-prefill rate (default: reported only)")
    limits.add_argument("--min-retention-hit-rate", type=float, default=0.9, help="minimum revisit hit rate, 0..1")
    limits.add_argument("--cliff-util-percent", type=float, default=95.0, help="utilisation counted as busy")
    limits.add_argument("--cliff-power-ratio", type=float, default=0.4, help="busy below this x reference power = cliff")
    limits.add_argument("--allow-clamped-output", action="store_true", help="accept servers that shorten max_tokens at the boundary")


class UsageError(ValueError):
    """Bad arguments or plan file: exit code 2."""


def load_plan_targets(path: str) -> dict[str, Any]:
    """The plan's fields (context_length, max_new_tokens, retained_sessions, session_tokens, ...) from a JSON file."""
    from headroom.engine.plan import Plan

    try:
        data: Any = json.loads(Path(path).read_text())
        plan = Plan.from_dict(data["plan"] if isinstance(data, dict) and isinstance(data.get("plan"), dict) else data)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"--plan {path}: {error}") from error
    return plan.to_dict()


def fetch_server_plan(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    """The plan `headroom serve` reports at GET /plan; {} when the server has none (a peer engine)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/plan", timeout=timeout_s, headers=headers)
        data = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return data if isinstance(data, dict) and "context_length" in data else {}


def api_key_from_args(args: argparse.Namespace) -> str | None:
    return getattr(args, "api_key", None) or os.environ.get("HEADROOM_API_KEY") or None


def settings_from_args(args: argparse.Namespace) -> SmokeSettings:
    targets = load_plan_targets(args.plan) if args.plan else {}
    if not targets and not (args.context_length and args.max_new_tokens):
        targets = fetch_server_plan(args.url, api_key=api_key_from_args(args))
    context = args.context_length or targets.get("context_length")
    max_new = args.max_new_tokens or targets.get("max_new_tokens")
    if not context or not max_new:
        raise UsageError("give --plan plan.json, or both --context-length and --max-new-tokens "
                         "(the server has no /plan to read them from)")
    try:
        settings = SmokeSettings(
            context_length=context, max_new_tokens=max_new, margin_tokens=args.margin_tokens,
            short_delay_s=args.short_delay_s, retention_sessions=args.retention_sessions,
            metrics_interval_s=args.metrics_interval_s, ignore_eos=not args.no_ignore_eos,
            checkpoint_interval_tokens=args.checkpoint_interval,
            # Saturation at the plan's sizes: on with --plan (the promise the user hands over), else on request.
            saturation_requests=(args.saturation_requests if args.saturation_requests is not None
                                 else targets.get("max_running_requests", 0) if args.plan else 0),
            saturation_prompt_tokens=args.saturation_prompt_tokens, pool_tokens=targets.get("max_total_tokens"),
            saturation_deadline_s=args.saturation_deadline_s,
        )
        if targets:
            # The plan's promise (file, or the server's /plan); the probe tests nothing it did not make.
            settings = retention_settings(settings, targets)
        if args.retention_tokens is not None:
            settings = replace(settings, retention_tokens=min(args.retention_tokens, settings.retention_room))
        settings.retention_context_tokens  # noqa: B018 - validates the sizes, naming the numbers
    except ValueError as error:
        raise UsageError(str(error)) from error
    return settings


def thresholds_from_args(args: argparse.Namespace) -> SmokeThresholds:
    if not 0.0 <= args.min_retention_hit_rate <= 1.0:
        raise UsageError(f"--min-retention-hit-rate must be within [0, 1], got {args.min_retention_hit_rate}")
    return SmokeThresholds(
        max_short_ttft_s=args.max_short_ttft_s, min_prefill_tokens_per_s=args.min_prefill_tok_s,
        min_retention_hit_rate=args.min_retention_hit_rate, cliff_util_percent=args.cliff_util_percent,
        cliff_power_ratio=args.cliff_power_ratio, allow_clamped_output=args.allow_clamped_output,
    )


def print_summary(report: SmokeReport) -> None:
    for name, check in report.checks.items():
        print(f"  {check.status.upper():4}  {name}: {check.reason}", file=sys.stderr)
    print(f"smoke {'PASSED' if report.passed else 'FAILED'} against {report.url}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from headroom.client.smoke import smoke

    try:
        settings = settings_from_args(args)
        thresholds = thresholds_from_args(args)
        id_range = tuple(args.token_id_range) if args.token_id_range else None
        report = asyncio.run(
            smoke(args.url, settings, thresholds, model=args.model, tokenizer_path=args.tokenizer,
                  token_id_range=id_range, request_timeout_s=args.timeout_s, wait_ready_s=args.wait_ready_s,  # type: ignore[arg-type]
                  api_key=api_key_from_args(args))
        )
    except (UsageError, ValueError) as error:
        print(f"headroom smoke: {error}", file=sys.stderr)
        return 2
    text = json.dumps(report.to_dict(), indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    print_summary(report)
    return 0 if report.passed else 1
