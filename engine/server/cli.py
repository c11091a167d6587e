"""`headroom serve`: plan (or read a plan), load the model, warm up, serve the OpenAI API with uvicorn.

Flags use the planner's vocabulary, plus the spellings vLLM and SGLang users type where the meaning is
the same (--model-path, --served-model-name, --dtype, --kv-cache-dtype auto, --max-model-len,
--max-num-seqs, --cuda-graph-max-bs, --api-key); `--help` is grouped as theirs is. Without --plan the
planner derives whatever is not pinned.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import sys

from headroom.engine.plan import KV_DTYPES, PlanRefused

# vLLM's and SGLang's --dtype words -> headroom's (EngineConfig.dtype).
DTYPE_WORDS = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
               "float32": "float32", "float": "float32"}
# --kv-cache-dtype words: `auto` is the model's 16-bit dtype (bf16 pool); fp8 is e4m3 with per-token scales.
KV_DTYPE_WORDS = {"auto": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8", **{d: d for d in KV_DTYPES}}
logger = logging.getLogger(__name__)
# The engine loop is a thread beside the HTTP event loop; after each GPU step it may wait for the GIL while the
# event loop formats and writes the streams' tokens, up to the interpreter's switch interval. The default stays
# Python's 5 ms: on the H200 (bench/results/session8/callB_engine_speed_detail.json) 1 ms moved decode through
# HTTP at batch 1 and 16 by under 1.5% and at batch 8 by 1.8x in one run, prompts the other way: no clear gain.
GIL_SWITCH_MS = 5.0
GIL_SWITCH_MAX_MS = 100.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", "--model-path", dest="model",
                       help="Hugging Face model directory (default: the embedded tiny hybrid model)")
    model.add_argument("--served-model-name", help="model name in /v1/models and responses (default: the directory name)")
    model.add_argument("--dtype", choices=sorted(DTYPE_WORDS), default="auto",
                       help="weight and activation dtype; auto = the checkpoint's (half = float16, float = float32)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM/SGLang command lines; headroom never runs code from the model directory")

    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0 in a pod)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=None,
                      help="require `Authorization: Bearer <key>` on every route but /health, /ready and /metrics "
                           "(default: $HEADROOM_API_KEY)")
    http.add_argument("--metrics-need-key", action="store_true", help="require the API key on /metrics as well")
    http.add_argument("--max-connections", type=int, default=1024, help="open connections; more get 503 and are closed")
    http.add_argument("--header-timeout", type=float, default=10.0, help="seconds to receive a request's head (408)")
    http.add_argument("--body-timeout", type=float, default=60.0, help="seconds to receive a request's body (408)")
    http.add_argument("--timeout-keep-alive", type=float, default=5.0, help="seconds an idle keep-alive connection lives")
    http.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    http.add_argument("--gil-switch-ms", type=float, default=GIL_SWITCH_MS, metavar="MS",
                      help="how long one Python thread may keep the GIL while another waits for it (default "
                           f"{GIL_SWITCH_MS:g}, Python's own): the longest the engine thread waits for it after a "
                           "GPU step while the HTTP threads write streams")

    memory = parser.add_argument_group("memory and plan")
    memory.add_argument("--plan", dest="plan_path", help="plan.json from `headroom plan --output json`")
    memory.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    memory.add_argument("--gpu-memory", help="memory to plan against, e.g. 12GiB (default: CUDA's total; 2GiB on a CPU)")
    memory.add_argument("--kv-cache-dtype", dest="kv_dtype", choices=sorted(KV_DTYPE_WORDS), default="auto",
                        help="KV pool dtype; auto = bf16 (the model's 16-bit dtype), fp8 = fp8_e4m3, int8/4/2 = KIVI")
    memory.add_argument("--mem-fraction-static", type=float, help="fraction of GPU memory for weights and pools")
    memory.add_argument("--max-total-tokens", type=int, help="cap on the KV pool (tokens)")
    memory.add_argument("--context-length", "--max-model-len", dest="context_length", type=int,
                        help="longest prompt + completion (tokens)")
    memory.add_argument("--max-new-tokens", type=int, default=1024, help="the planner's reserve per request")
    memory.add_argument("--retained-sessions", type=int, default=0,
                        help="sessions whose prefixes stay reusable (default: as many as the pool holds)")
    memory.add_argument("--session-tokens", type=int, default=0, help="tokens per retained session")
    memory.add_argument("--ssm-slots", type=int, help="checked against the plan's SSM slots (headroom plan prints it)")
    memory.add_argument("--cuda-graph-max-batch", "--cuda-graph-max-bs", dest="cuda_graph_max_batch", type=int,
                        help="decode batches up to this size replay CUDA graphs (0 = off; at most 64; default min(running, 64))")
    memory.add_argument("--cpu-threads", type=int, default=1,
                        help="--device cpu: torch's intra-op threads in the engine thread (default 1: on a 2-core "
                             "machine two ran a forward 2-3x slower from that thread)")
    memory.add_argument("--tensor-parallel-size", "--tp-size", "--tp", dest="tensor_parallel_size", type=int,
                        help="split the model over this many GPUs, one process each (default: the plan's, else 1)")

    scheduling = parser.add_argument_group("scheduling")
    scheduling.add_argument("--chunked-prefill-size", type=int, help="prefill tokens per pass")
    scheduling.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=int,
                            help="requests decoding at once")
    scheduling.add_argument("--max-waiting-requests", type=int, default=256, help="beyond this, 429 with Retry-After")
    scheduling.add_argument("--itl-target-ms", type=float, help="bound prefill per pass so decode gaps stay under this")
    scheduling.add_argument("--max-pass-ms", type=float, default=1000.0,
                            help="size every prefill pass to about this long (fitted at warm-up), so a request "
                                 "arriving during a long prompt waits at most about one pass; 0: the chunk alone")
    scheduling.add_argument("--skip-ahead-limit", type=int, default=16, help="misfit requests admission scans past")
    scheduling.add_argument("--strict-fcfs", action="store_true", help="old admission: whole prompt, stop at misfit")
    scheduling.add_argument("--scheduler-policy", choices=("short_first", "fair"), default="short_first",
                            help="short prefills first, long prompts back to back (default); or the even split")
    scheduling.add_argument("--no-interjection", dest="interject_short", action="store_false",
                            help="short_first: a short request arriving during a long pass waits for the pass to end "
                                 "instead of running between its layers")
    scheduling.add_argument("--interjection-lag", type=int, metavar="LAYERS",
                            help="layers the host may run ahead of the GPU in a long pass that takes interjections "
                                 "(default 2): more keeps the GPU busy while a short pass is launched, fewer starts "
                                 "it sooner")

    diagnostics = parser.add_argument_group("diagnostics")
    diagnostics.add_argument("--log-rejections", action="store_true", help="log every admission rejection")
    diagnostics.add_argument("--warmup-tokens", type=int, help="length of the warm-up prefill (default: 2 chunks)")


def options_from_args(args: argparse.Namespace):
    from headroom.engine.server.factory import ServeOptions

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ServeOptions(
        model=args.model, plan_path=args.plan_path, device=device, gpu_memory=args.gpu_memory,
        kv_dtype=KV_DTYPE_WORDS[args.kv_dtype], dtype=DTYPE_WORDS[args.dtype], served_model_name=args.served_model_name,
        mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size, context_length=args.context_length,
        max_running_requests=args.max_running_requests, max_new_tokens=args.max_new_tokens,
        max_waiting_requests=args.max_waiting_requests, itl_target_ms=args.itl_target_ms, max_pass_ms=args.max_pass_ms,
        skip_ahead_limit=args.skip_ahead_limit, strict_fcfs=args.strict_fcfs, log_rejections=args.log_rejections,
        policy=args.scheduler_policy, interject_short=args.interject_short, interjection_lag=args.interjection_lag,
        warmup_tokens=args.warmup_tokens, ssm_slots=args.ssm_slots, cuda_graph_max_batch=args.cuda_graph_max_batch,
        tensor_parallel_size=args.tensor_parallel_size, cpu_threads=args.cpu_threads,
        retained_sessions=args.retained_sessions, session_tokens=args.session_tokens,
    )


def http_limits_from_args(args: argparse.Namespace):
    from headroom.engine.server.transport import HTTPLimits

    return HTTPLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                      keep_alive_s=args.timeout_keep_alive, max_connections=args.max_connections)


def apply_gil_switch(ms: float) -> None:
    """Set the interpreter's thread switch interval from --gil-switch-ms (checked before the model loads)."""
    if not 0 < ms <= GIL_SWITCH_MAX_MS:
        raise ValueError(f"--gil-switch-ms must be above 0 and at most {GIL_SWITCH_MAX_MS:g} ms, got {ms:g}")
    sys.setswitchinterval(ms / 1000)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from headroom.engine.server.app import build_app
    from headroom.engine.server.auth import resolve_api_key
    from headroom.engine.server.factory import build_state, start_warm_up
    from headroom.engine.server.transport import uvicorn_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        api_key = resolve_api_key(args.api_key)
        limits = http_limits_from_args(args)
        apply_gil_switch(args.gil_switch_ms)
        options = options_from_args(args)
        state = build_state(options)
    except PlanRefused as exc:
        print(f"headroom serve: no plan fits: {exc.message} (binding: {exc.binding_constraint})", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"headroom serve: {exc}", file=sys.stderr)
        return 2
    if api_key is None and not _is_loopback(args.host):
        logger.warning("serving on %s without an API key: anyone who reaches the port can use it "
                       "(--api-key or $HEADROOM_API_KEY; docs/security.md)", args.host)
    # The model, torch and the imports are millions of long-lived objects: out of the collector's sight, a
    # full collection (triggered by a request that builds many objects) no longer stalls every stream.
    gc.collect()
    gc.freeze()
    start_warm_up(state, options.warmup_tokens)
    app = build_app(state, api_key=api_key, limits=limits, metrics_need_key=args.metrics_need_key)
    try:
        uvicorn.Server(uvicorn_config(app, args.host, args.port, limits, args.uvicorn_log_level)).run()
    finally:
        state.loop.stop()
    return 0
