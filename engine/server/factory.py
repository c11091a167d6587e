"""Assemble a server: model directory -> plan (file, or the planner with the pinned flags) -> runner -> loop.

Also the warm-up that gates /ready: a long prefill (several chunks) alongside a decoding request, so
every kernel path serving uses has run once; its pass times calibrate the scheduler's cost model.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from headroom.engine.config import EngineConfig
from headroom.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from headroom.engine.loop.engine_loop import EngineLoop, check_interjection_lag
from headroom.engine.loop.step import StepStats, TokenEvent
from headroom.engine.plan import Pinned, Plan, PlanRequest, Targets, load_geometry, make_plan, parse_size
from headroom.engine.plan.kv_format import kv_format
from headroom.engine.scheduler.types import PassCostModel, SchedulerConfig
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.generate import ServerState
from headroom.engine.server.metrics import EngineMetrics
from headroom.engine.server.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Without NVML (a CPU), plan against this much memory unless --gpu-memory says otherwise.
CPU_MEMORY_BUDGET = "2GiB"


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None
    plan_path: str | None = None
    device: str = "cpu"
    gpu_memory: str | None = None
    kv_dtype: str = "bf16"
    # Weights and activations (EngineConfig.dtype: auto = the checkpoint's).
    dtype: str = "auto"
    # The model's name in /v1/models and responses; None: the model directory's name.
    served_model_name: str | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    max_new_tokens: int = 1024
    max_waiting_requests: int = 256
    itl_target_ms: float | None = None
    # Every pass carrying prefill is sized to about this long (the warm-up's fitted cost model), so a request
    # arriving during a long prompt waits at most about one such pass; 0 or None: the chunk alone.
    max_pass_ms: float | None = 1000.0
    skip_ahead_limit: int = 16
    strict_fcfs: bool = False
    policy: str = "short_first"
    # short_first: short requests arriving during a long pass run between its layers (scheduler/interjection.py).
    interject_short: bool = True
    # Layers the host may run ahead of the GPU in an interruptible pass; None: the engine's (2).
    interjection_lag: int | None = None
    log_rejections: bool = False
    warmup_tokens: int | None = None
    ssm_slots: int | None = None
    cuda_graph_max_batch: int | None = None
    # None: the plan's (1 when the planner makes it).
    tensor_parallel_size: int | None = None
    retained_sessions: int = 0
    session_tokens: int = 0
    # torch intra-op threads of the engine thread on a CPU device (EngineConfig.cpu_threads).
    cpu_threads: int = 1


def cuda_total_memory(device: str) -> int:
    """Total memory of the device as CUDA reports it: what the engine can allocate and what ModelRunner
    checks a plan against. NVML's total is larger (on the H200 150,754,820,096 bytes against CUDA's
    150,109,880,320), and a plan made for NVML's figure was refused at start-up."""
    import torch

    return torch.cuda.mem_get_info(torch.device(device))[1]


def resolve_plan(options: ServeOptions, model_dir: Path) -> Plan:
    """--plan file, or the builtin planner with the pinned flags and the device's memory."""
    if options.plan_path:
        plan = Plan.from_dict(json.loads(Path(options.plan_path).read_text()))
        if options.tensor_parallel_size is not None and options.tensor_parallel_size != plan.tp:
            raise ValueError(f"--tensor-parallel-size {options.tensor_parallel_size} disagrees with the plan's tp {plan.tp}")
        return plan
    memory = parse_size(options.gpu_memory) if options.gpu_memory else None
    if memory is None and options.device.startswith("cuda"):
        memory = cuda_total_memory(options.device)
    if memory is None:
        memory = parse_size(CPU_MEMORY_BUDGET)
    request = PlanRequest(
        geometry=load_geometry(model_dir), gpu_memory_bytes=memory, kv_dtype=options.kv_dtype, engine="builtin",
        tp=options.tensor_parallel_size or 1,
        targets=Targets(context_length=options.context_length, max_running_requests=options.max_running_requests,
                        max_new_tokens=options.max_new_tokens, retained_sessions=options.retained_sessions,
                        session_tokens=options.session_tokens),
        pinned=Pinned(mem_fraction_static=options.mem_fraction_static, max_total_tokens=options.max_total_tokens,
                      chunked_prefill_size=options.chunked_prefill_size, context_length=options.context_length),
    )
    return make_plan(request)


def scheduler_config(options: ServeOptions, plan: Plan) -> SchedulerConfig:
    if options.strict_fcfs:
        config = SchedulerConfig.strict_fcfs(plan.chunked_prefill_size, plan.max_running_requests,
                                             plan.chunked_prefill_size)
        return replace(config, log_rejections=options.log_rejections)
    itl = options.itl_target_ms / 1000.0 if options.itl_target_ms else None
    max_pass = options.max_pass_ms / 1000.0 if options.max_pass_ms else None
    return SchedulerConfig(chunked_prefill_size=plan.chunked_prefill_size,
                           max_running_requests=plan.max_running_requests, skip_ahead_limit=options.skip_ahead_limit,
                           itl_target_s=itl, max_pass_s=max_pass, log_rejections=options.log_rejections,
                           policy=options.policy, interject_short=options.interject_short)


def build_state(options: ServeOptions) -> ServerState:
    if options.interjection_lag is not None:
        # Before the weights load: a bad flag costs no start-up.
        check_interjection_lag(options.interjection_lag, "--interjection-lag")
    model_dir = Path(options.model) if options.model else ensure_default_model()
    plan = resolve_plan(options, model_dir)
    if options.ssm_slots is not None and options.ssm_slots != plan.ssm_slots:
        raise ValueError(
            f"--ssm-slots {options.ssm_slots} disagrees with the plan's {plan.ssm_slots} SSM slots "
            "(they follow from chunk, context and running requests); pass --plan plan.json to pin a plan"
        )
    if plan.context_length > plan.max_total_tokens:
        # No request longer than the KV pool can ever be admitted: it would wait forever.
        raise ValueError(
            f"plan context_length {plan.context_length} exceeds its max_total_tokens {plan.max_total_tokens}: "
            "a request of that length could never fit the KV pool"
        )
    config = EngineConfig.from_plan(plan, str(model_dir), device=options.device, dtype=options.dtype,
                                    cuda_graph_max_batch=options.cuda_graph_max_batch, cpu_threads=options.cpu_threads)
    if not options.device.startswith("cuda"):
        # A CPU run has no GPU to check the plan's static budget against.
        config = replace(config, static_budget_bytes=None, gpu_memory_bytes=None)
    metrics = EngineMetrics()
    started = time.perf_counter()
    loop = EngineLoop.from_config(config, scheduler_config(options, plan), options.max_waiting_requests,
                                  metrics.observe_step)
    logger.info("start-up: weights loaded and pools allocated in %.1f s", time.perf_counter() - started)
    if options.interjection_lag is not None:
        loop.set_interjection_lag(options.interjection_lag)
    tokenizer = load_tokenizer(model_dir, loop.eos_token_ids)
    name = options.served_model_name or (options.model.rstrip("/").split("/")[-1] if options.model else DEFAULT_MODEL_NAME)
    return ServerState(loop=loop, tokenizer=tokenizer, model_name=name, context_length=plan.context_length,
                       metrics=metrics, plan=plan.to_dict())


# (request id, prompt tokens) of the warm-up's short prompts.
WARMUP_SHORT_PROMPTS = (("warmup-short", 37), ("warmup-stops", 300))
# On a GPU, prompts of these lengths then run one at a time, and WARMUP_CONCURRENT = (count, tokens) of them at
# once. A prompt alone is a pass shape of its own: the attention kernel's query tile and key split follow the
# pass's rows, and Triton specialises integer arguments on 1 and on multiples of 16. Met first inside a request,
# such a shape compiled there: 1.8 s for a lone 30-token prompt on the H200, after the old warm-up.
WARMUP_ALONE_PROMPTS = (1, 3, 7, 16, 37, 48, 256, 300, 600)
WARMUP_CONCURRENT = (8, 64)
# The prompt length of the warm-up's batches for the LM head's GEMV variants (gemv_warm_up_batches): short, so that
# up to 16 of them (64 tokens) prefill in one pass and then decode together.
WARMUP_BATCH_PROMPT = 4
# After /ready, compiles are logged one by one up to this many, then every COMPILE_LOG_EVERY-th.
COMPILE_LOG_FIRST, COMPILE_LOG_EVERY = 50, 100
# Each logged compile's text: the kernel, its options and every argument's type and specialisation. The argument
# list is where two variants of one kernel differ, and a paged-attention launch's runs to ~2,500 characters (session
# 13's int2 server logged two compiles cut at 400, before any argument).
COMPILE_LOG_CHARS = 6000
# Prefill tokens of the smaller of the two timed passes the pass-cost fit uses on a GPU (the other is a full chunk).
TIMING_PASS_TOKENS = 2048
# The smallest prefill pass the fit takes a marginal rate against (a 1-token pass is all overhead).
MARGINAL_MIN_TOKENS = 256


def warm_up(state: ServerState, num_tokens: int | None = None) -> None:
    """Run a long prefill (>= 2 chunks) next to a decoding request, calibrate the cost model, start the loop."""
    loop = state.loop
    chunk = loop.scheduler.config.chunked_prefill_size
    longest = 2 * chunk + 1
    open_length = None
    if loop.compiles_kernels and kv_format(str((state.plan or {}).get("kv_dtype", "bf16"))).is_kivi:
        # On a GPU, the prompts whose passes meet every path of a KIVI pool's long prefills (the runner says which).
        kivi_longest, open_length = loop.runner.kivi_warm_up_lengths(chunk)
        longest = max(longest, kivi_longest)
    length = min(num_tokens or longest, state.context_length - 2)
    # Warm-up runs full chunks, so every pass shape serving uses is compiled before /ready; the pass-time
    # bound needs the cost model this warm-up fits, so it applies from the first served pass on.
    max_pass_s, itl_target_s = loop.scheduler.config.max_pass_s, loop.scheduler.config.itl_target_s
    # Nor do decode steps interject into warm-up passes before the cost model they are timed by is fitted.
    loop.scheduler.config = replace(loop.scheduler.config, max_pass_s=None, itl_target_s=None)
    vocab = state.tokenizer.vocab_size
    timings: list[StepStats] = []
    failures: list[str] = []
    previous_step, previous_emit = loop.on_step, loop.steps.emit

    def record(request_id: str, event: TokenEvent) -> None:
        if event.finish_reason == "error":
            failures.append(f"{request_id}: {event.error}")
        previous_emit(request_id, event)

    loop.on_step = lambda stats, _: timings.append(stats)
    loop.steps.emit = record
    # A request sent before /ready must not be interjected into the timed passes the cost model is fitted on.
    previous_poll, loop.steps.poll_arrivals = loop.steps.poll_arrivals, None

    def add(name: str, size: int, new_tokens: int, stride: int, offset: int, checkpoints: bool = True) -> None:
        """A warm-up request of `size` tokens, each family its own token pattern (no prefix hits between them)."""
        tokens = [(stride * i + offset) % vocab for i in range(size)]
        # Greedy, always: a dry pass (compile ahead) may leave NaN in the logits, where argmax still picks a token
        # and sampling would fail on the device.
        seq = Sequence(name, tokens, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0),
                       take_checkpoints=checkpoints)
        loop.steps.add(seq, frozenset())

    watch = loop.watch_compiles()
    try:
        # Until the timing passes: each warm-up pass runs dry first, and the kernels it meets compile on every core
        # at once instead of one by one inside it (kernels/compile_ahead.py).
        loop.start_compile_ahead()
        # cuDNN's attention plans for long prefill spans: one per query bucket, built before any request meets one.
        # Before the capture, which waits for fla's import on its thread (kernels/gdn_fla.py import_in_background):
        # the plans run beside that import instead of after the wait.
        plans = loop.runner.warm_attention_plans(chunk)
        if plans:
            logger.info("start-up: built %d cuDNN attention plans for long prefill spans", plans)
        # Before any request: capture decodes placeholders through the first slots of the pools.
        report = loop.capture_decode_graphs()
        if report.batch_sizes:
            logger.info("captured decode CUDA graphs for batch 1..%d in %.1f s (graph pool %d MiB)",
                        max(report.batch_sizes), report.seconds, report.pool_bytes // 2**20)
        add("warmup-decode", 3, 8, 1, 1)
        add("warmup-long", length, 2, 7, 0)
        # Short prompts too: a length that is no multiple of 16 and one with checkpoint stops inside compile
        # kernel specialisations of their own; left to the first user request, they took 1.4 s on the H200.
        for name, size in WARMUP_SHORT_PROMPTS:
            if size < length:
                add(name, size, 2, 11, 5)
        started = time.perf_counter()
        loop.run_until_idle()
        if timings:
            # The first passes compile every kernel shape serving uses: on a cold GPU most of the start-up.
            logger.info("start-up: warm-up ran %d passes in %.1f s (the first %.1f s)", len(timings),
                        time.perf_counter() - started, timings[0].seconds)
        if loop.compiles_kernels:
            if open_length is not None and open_length < state.context_length - 2:
                # Alone, so that its chunks fall where kivi_warm_up_lengths put them.
                add("warmup-long-open", open_length, 2, 23, 3)
                loop.run_until_idle()
            # And where the GEMV table has row counts those and the decode graphs miss (kernels/gemv.py
            # warm_up_rows), those too.
            alone = [size for size in WARMUP_ALONE_PROMPTS if size < length]
            alone = sorted(size for size in {*alone, *loop.runner.gemv_warm_up_lengths(tuple(alone))} if size < length)
            for i, size in enumerate(alone):
                add(f"warmup-alone-{size}", size, 2, 17, 100 + i)
                loop.run_until_idle()
            count, size = WARMUP_CONCURRENT
            together = min(count, loop.scheduler.config.max_running_requests)
            for i in range(together):
                add(f"warmup-together-{i}", min(size, length - 1), 2, 19, 200 + i)
            loop.run_until_idle()
            # The LM head runs on one row a sequence: where eager passes may hold more sequences than the decode
            # graphs, batches of the counts whose variants nothing above launched (short prompts, one pass each).
            for count in loop.runner.gemv_warm_up_batches((together,)):
                for i in range(count):
                    add(f"warmup-batch{count}-{i}", min(WARMUP_BATCH_PROMPT, length - 1), 2, 29, 300 + i)
                loop.run_until_idle()
            # Those passes paid for the compiling (on a cold H200 both full chunks took seconds, the fit came out
            # at 2.7K tokens/s, and the pass bound cut 8K prompts into three passes): time clean ones for the fit.
            _report_compile_ahead(loop)
            decodes = [t for t in timings if t.num_prefill_tokens == 0]
            timings.clear()
            # Two sizes, a mid-sized pass and a full chunk, for the marginal rate (fit_cost_model); one size twice
            # when the chunk is that small already.
            longest_timed = min(chunk, state.context_length - 2)
            sizes = sorted({min(TIMING_PASS_TOKENS, longest_timed), longest_timed})
            for i, size in enumerate(sizes * 2 if len(sizes) == 1 else sizes):
                # Without checkpoint stops: a prompt's last pass runs its Gated DeltaNet layers in rounds between
                # them, each round a fla call per layer at a fixed cost (H200, 4B model: a lone 256-token prompt's
                # pass with 3 stops took 199 ms, a 30-token one's with none 81 ms); fitted on such passes the rate
                # came out at 10-17K tokens/s, against the 40K+ a chunk runs at.
                add(f"warmup-timing-{i}", size, 1, 13, 7 * i + 3, checkpoints=False)
                loop.run_until_idle()
            timings.extend(decodes)
        # Ready means every tensor-parallel rank has run the warm-up too.
        loop.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported through /health, which fails so the pod restarts
        failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        _report_compile_ahead(loop)
        loop.on_step, loop.steps.emit, loop.steps.poll_arrivals = previous_step, previous_emit, previous_poll
    if failures:
        # A server that cannot run its own warm-up is not usable: never ready, and not live either.
        state.warmup_error = "warm-up failed: " + "; ".join(failures)
        logger.error("%s", state.warmup_error)
        return
    # The warm-up's prompts are nobody's, and a dry pass (compile ahead) leaves garbage in the states they cached.
    dropped = loop.clear_prefix_cache()
    if dropped:
        logger.info("start-up: dropped the warm-up's %d cached prefix tokens", dropped)
    config = replace(loop.scheduler.config, cost_model=fit_cost_model(timings, marginal=loop.compiles_kernels),
                     max_pass_s=max_pass_s, itl_target_s=itl_target_s)
    loop.scheduler.config = config
    cost = config.cost_model
    logger.info("scheduler: policy %s%s, chunk %d, max pass %s, ITL target %s; pass cost fitted by the warm-up: "
                "%.1f ms (+ %.1f ms with prefill) + %.0f prefill tokens/s", config.policy, " (strict FCFS)" if config.judge_whole_prompt else
                " (short requests interjected between a long pass's layers)"
                if config.policy == "short_first" and config.interject_short and loop.runner.supports_interjection
                else "",
                config.chunked_prefill_size, f"{max_pass_s * 1000:.0f} ms" if max_pass_s else "none",
                f"{config.itl_target_s * 1000:.0f} ms" if config.itl_target_s else "none", cost.fixed_s * 1000,
                cost.prefill_fixed_s * 1000, cost.prefill_tokens_per_s)
    step_s = cost.pass_seconds(0, config.max_running_requests)
    if config.itl_target_s is not None and step_s >= config.itl_target_s:
        # Nothing can keep such a target: a long pass then steps its decodes at every layer boundary (or shrinks
        # to min_prefill_tokens), and its prefill runs at a fraction of its rate.
        logger.warning("ITL target %.0f ms is below one decode pass of %d requests here (%.0f ms, fitted): decode "
                       "gaps cannot be kept under it, and long prompts prefill slowly", config.itl_target_s * 1000,
                       config.max_running_requests, step_s * 1000)
    # Everything alive now (imports, weights' Python objects, the model) lives as long as the server: move it
    # out of the collector's sight, so that a full collection set off by a request's objects (a 30,000-part
    # body parses into as many dicts) scans those alone instead of pausing every thread for the whole heap.
    # Collect first, so that only live objects are frozen; unfreeze at exit, so that the interpreter's final
    # collections still see them (nanobind reported Triton's bindings as leaked otherwise).
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    if watch is not None:
        logger.info("start-up: the warm-up compiled %d Triton kernel specialisations", watch.count)
        watch.on_compile = _compile_reporter(state, watch.count)
    loop.start()
    state.ready.set()


def _report_compile_ahead(loop: EngineLoop) -> None:
    """End compiling ahead (a second call does nothing) and log what it did."""
    report = loop.stop_compile_ahead()
    if report is not None:
        logger.info("start-up: %s", report.summary())


def _compile_reporter(state: ServerState, before_ready: int):
    """What each Triton compile after /ready does: count it in /metrics and name it in the log."""
    seen = [0]

    def report(kernel: str) -> None:
        seen[0] += 1
        state.metrics.kernel_compiles.inc()
        if seen[0] <= COMPILE_LOG_FIRST or seen[0] % COMPILE_LOG_EVERY == 0:
            logger.warning("kernel compiled while serving (compile %d after /ready, %d before): a pass shape the "
                           "warm-up did not run, paid by the request in that pass: %s", seen[0], before_ready,
                           kernel[:COMPILE_LOG_CHARS])

    return report


def fit_cost_model(timings: list[StepStats], marginal: bool = False) -> PassCostModel:
    """Fixed cost from the quickest decode-only pass; prefill rate from the fastest of the big prefill passes
    (at least half the biggest's tokens). The first full chunk compiles the kernels (seconds on a cold GPU):
    fitted on it, the rate came out several times too low and the pass bound cut the H200's chunks.

    marginal (the GPU warm-up's clean timed passes): with a pass of at most half as many tokens
    (>= MARGINAL_MIN_TOKENS) beside them, the rate is the marginal one between the two sizes and the
    difference goes to prefill_fixed_s: on a GPU a mid-sized eager pass is bound by its kernel launches (~45-60 ms of Python for a 2,048-token pass of the 4B model, against a
    4 ms graphed decode), and a rate fitted through the decode's fixed cost alone came out at half the real
    one on a slower host (28K tok/s where 8K chunks ran at 50K). Off for a CPU's warm-up passes, of mixed
    batches and checkpoint stops, where a difference of two passes is no rate."""
    decode_only = [t.seconds for t in timings if t.num_prefill_tokens == 0 and t.num_decodes > 0]
    prefills = [t for t in timings if t.num_prefill_tokens > 0]
    if not decode_only or not prefills:
        return PassCostModel()
    fixed = min(decode_only)
    biggest = max(t.num_prefill_tokens for t in prefills)
    big = [t for t in prefills if 2 * t.num_prefill_tokens >= biggest]
    rate = max(t.num_prefill_tokens / max(t.seconds - fixed, 1e-6) for t in big)
    small = [t for t in prefills if marginal and MARGINAL_MIN_TOKENS <= t.num_prefill_tokens
             and 2 * t.num_prefill_tokens < biggest]
    if small:
        fast_big = min(big, key=lambda t: t.seconds / t.num_prefill_tokens)
        size = max(t.num_prefill_tokens for t in small)
        fast_small = min((t for t in small if t.num_prefill_tokens == size), key=lambda t: t.seconds)
        extra = fast_big.seconds - fast_small.seconds
        if extra > 0:
            marginal_rate = (fast_big.num_prefill_tokens - fast_small.num_prefill_tokens) / extra
            prefill_fixed = fast_small.seconds - fixed - fast_small.num_prefill_tokens / marginal_rate
            if marginal_rate > rate and prefill_fixed > 0:
                return PassCostModel(fixed_s=fixed, prefill_tokens_per_s=marginal_rate, decode_s=0.0,
                                     prefill_fixed_s=prefill_fixed)
    return PassCostModel(fixed_s=fixed, prefill_tokens_per_s=rate, decode_s=0.0)


def start_warm_up(state: ServerState, num_tokens: int | None = None) -> threading.Thread:
    thread = threading.Thread(target=warm_up, args=(state, num_tokens), name="headroom-warmup", daemon=True)
    thread.start()
    return thread
