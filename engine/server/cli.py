"""`headroom serve`: plan (or read a plan), load the model, warm up, serve the OpenAI API with uvicorn.

Flags use the planner's vocabulary; without --plan the planner derives whatever is not pinned.
"""

from __future__ import annotations

import argparse
import logging
import sys

from headroom.engine.plan import KV_DTYPES, PlanRefused


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory (default: the embedded tiny hybrid model)")
    parser.add_argument("--plan", dest="plan_path", help="plan.json from `headroom plan --output json`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--gpu-memory", help="memory to plan against, e.g. 12GiB (default: pynvml; 2GiB on a CPU)")
    parser.add_argument("--kv-cache-dtype", dest="kv_dtype", choices=KV_DTYPES, default="bf16")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--max-total-tokens", type=int)
    parser.add_argument("--chunked-prefill-size", type=int)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="the planner's reserve per request")
    parser.add_argument("--retained-sessions", type=int, default=0,
                        help="sessions whose prefixes stay reusable (default: as many as the pool holds)")
    parser.add_argument("--session-tokens", type=int, default=0, help="tokens per retained session")
    parser.add_argument("--ssm-slots", type=int, help="checked against the plan's SSM slots (headroom plan prints it)")
    parser.add_argument("--max-waiting-requests", type=int, default=256, help="beyond this, 429 with Retry-After")
    parser.add_argument("--itl-target-ms", type=float, help="bound prefill per pass so decode gaps stay under this")
    parser.add_argument("--skip-ahead-limit", type=int, default=16, help="misfit requests admission scans past")
    parser.add_argument("--strict-fcfs", action="store_true", help="old admission: whole prompt, stop at misfit")
    parser.add_argument("--scheduler-policy", choices=("short_first", "fair"), default="short_first",
                        help="short prefills first, long prompts back to back (default); or the even split")
    parser.add_argument("--log-rejections", action="store_true", help="log every admission rejection")
    parser.add_argument("--warmup-tokens", type=int, help="length of the warm-up prefill (default: 2 chunks)")
    parser.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int,
                        help="split the model over this many GPUs, one process each (default: the plan's, else 1)")
    parser.add_argument("--cuda-graph-max-batch", type=int,
                        help="decode batches up to this size replay CUDA graphs (0 = off; at most 64; default min(running, 64))")


def options_from_args(args: argparse.Namespace):
    from headroom.engine.server.factory import ServeOptions

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ServeOptions(
        model=args.model, plan_path=args.plan_path, device=device, gpu_memory=args.gpu_memory,
        kv_dtype=args.kv_dtype, mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size, context_length=args.context_length,
        max_running_requests=args.max_running_requests, max_new_tokens=args.max_new_tokens,
        max_waiting_requests=args.max_waiting_requests, itl_target_ms=args.itl_target_ms,
        skip_ahead_limit=args.skip_ahead_limit, strict_fcfs=args.strict_fcfs, log_rejections=args.log_rejections,
        policy=args.scheduler_policy,
        warmup_tokens=args.warmup_tokens, ssm_slots=args.ssm_slots, cuda_graph_max_batch=args.cuda_graph_max_batch,
        tensor_parallel_size=args.tensor_parallel_size,
        retained_sessions=args.retained_sessions, session_tokens=args.session_tokens,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from headroom.engine.server.app import build_app
    from headroom.engine.server.factory import build_state, start_warm_up

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = options_from_args(args)
    try:
        state = build_state(options)
    except PlanRefused as exc:
        print(f"headroom serve: no plan fits: {exc.message} (binding: {exc.binding_constraint})", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"headroom serve: {exc}", file=sys.stderr)
        return 2
    start_warm_up(state, options.warmup_tokens)
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="info")
    finally:
        state.loop.stop()
    return 0
