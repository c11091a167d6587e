"""`headroom plan`: derive every memory setting together, or check pinned ones. Exit 2 on refusal."""

from __future__ import annotations

import argparse
import json
import sys

from headroom.engine.plan.engines.profiles import profile_labels
from headroom.engine.plan.geometry import GeometryError, geometry_from_config, load_geometry
from headroom.engine.plan.kv_format import KV_DTYPES, SSM_DTYPES
from headroom.engine.plan.presets import PRESETS, preset_config
from headroom.engine.plan.report import render_plan, render_refusal
from headroom.engine.plan.solver import make_plan
from headroom.engine.plan.types import ENGINE_FLAVOURS, ENGINES, Pinned, PlanRefused, PlanRequest, Targets
from headroom.engine.plan.units import parse_size

EXIT_REFUSED = 2


def _context(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--context-length must be an integer or 'auto', got {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--context-length must be positive, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-config", help="config.json or a model directory")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model geometry")
    parser.add_argument("--gpu-memory", help="memory of one GPU, e.g. 12GiB (default: read with pynvml)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size; the ledger is per GPU")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    parser.add_argument("--ssm-dtype", choices=SSM_DTYPES, help="recurrent-state dtype (default: the engine's)")
    parser.add_argument("--engine", choices=ENGINES, default="builtin")
    parser.add_argument(
        "--engine-version", help=f"the engine release the plan is for (default: the newest profile; {profile_labels()})"
    )
    parser.add_argument(
        "--engine-flavour", choices=ENGINE_FLAVOURS,
        help="a fork's capability: int-kv is the field report's SGLang with integer KV (never the default)",
    )
    parser.add_argument("--weight-bytes", help="weights of the whole model when the checkpoint is not at hand, e.g. 16GB")
    parser.add_argument("--context-length", type=_context, default=None, help="tokens, or 'auto'")
    parser.add_argument("--retained-sessions", type=int, default=0)
    parser.add_argument("--session-tokens", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--mem-fraction-static", type=float, help="pin it (checked, not derived)")
    parser.add_argument("--max-total-tokens", type=int, help="pin it (checked, not derived)")
    parser.add_argument("--chunked-prefill-size", type=int, help="pin it (checked, not derived)")
    parser.add_argument("--output", choices=("table", "json"), default="table")


def gpu_memory_from_nvml() -> int:
    """Total memory of GPU 0 in bytes; a clear error when no NVIDIA driver is present."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        raise ValueError(f"--gpu-memory not given and no GPU could be read with pynvml ({exc})") from exc


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    weight_bytes = parse_size(args.weight_bytes, "--weight-bytes") if args.weight_bytes else None
    if args.preset:
        config, preset_weights = preset_config(args.preset)
        geometry = geometry_from_config(config)
        weight_bytes = weight_bytes or preset_weights
        geometry = geometry.with_weight_bytes(weight_bytes) if weight_bytes else geometry
    else:
        geometry = load_geometry(args.model_config, weight_bytes)
    gpu_memory = parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory else gpu_memory_from_nvml()
    return PlanRequest(
        geometry=geometry, gpu_memory_bytes=gpu_memory, kv_dtype=args.kv_dtype, engine=args.engine,
        engine_version=args.engine_version, engine_flavour=args.engine_flavour, tp=args.tp, ssm_dtype=args.ssm_dtype,
        targets=Targets(
            context_length=args.context_length, retained_sessions=args.retained_sessions,
            session_tokens=args.session_tokens, max_running_requests=args.max_running_requests,
            max_new_tokens=args.max_new_tokens,
        ),
        pinned=Pinned(
            mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
        ),
    )


def run(args: argparse.Namespace) -> int:
    as_json = args.output == "json"
    try:
        plan = make_plan(request_from_args(args))
    except PlanRefused as refusal:
        print(json.dumps(refusal.to_dict(), indent=2) if as_json else render_refusal(refusal))
        return EXIT_REFUSED
    except (ValueError, GeometryError) as exc:
        message = {"error": str(exc), "binding_constraint": "invalid_input", "alternatives": []}
        print(json.dumps(message, indent=2) if as_json else f"headroom plan: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps(plan.to_dict(), indent=2) if as_json else render_plan(plan))
    return 0
