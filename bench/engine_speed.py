"""Engine speed on the H200 (issue 18): headroom through `headroom serve`'s HTTP API and through the LLM API,
and warm transformers, on the same Qwen3.5-4B-shaped random bf16 weights, in one process run.

Run on the H200 from the repo root (see bench/device_env.sh):
    python3 bench/engine_speed.py OUTDIR [parts...]
parts (default: all, in this order): serve llm_bf16 hf llm_int2 kernels logits profile tiles; also serve_plain
(the same server with --no-interjection, beside the rows), serve_switch5 (the same with Python's own 5 ms GIL
switch interval, --gil-switch-ms 5, beside the rows), serve_lag4 / serve_lag8 (the host allowed 4 or 8 layers ahead
of the GPU in a pass that takes interjections, --interjection-lag: session 11 found the default 2 costing the HTTP
prefill rows), serve_trace / serve_trace_plain (the server built in this process, a lone 8K and 32K prompt over
HTTP at the default lag and with the host never held back, then under torch's profiler: GPU busy time, idle gaps,
blocking CUDA calls; bench/serve_trace.py), decode_tiles (the paged kernel's decode configs at 32K keys, bf16 and
int2, batch 1 and 8), profile_decode_long (an eager decode step at 32K context, bf16 against int2 KV, kernels by
name), serve_int2
(the INT2 plan over HTTP: 128K context, 8 running; prefill 32K/120K, decode at 32K), kivi_blocks (the KIVI block
path against the fused kernel), kivi_dense (a long KIVI chunk's dense path, cuDNN over dequantized ranges, against
the paged passes and fp32), attention_check (paged attention of every pool kind against naive), logits_4b
(the logit check on the 4B-shaped model, the one whose shapes the GEMV table has: fla's first fp32 calls compile for
minutes, so LOGIT_HF_TORCH=1 takes the fp32 truth from transformers' torch functions and the bf16 bound both as
transformers runs by default and on those functions), hf_prefill (hf's
prefill rows only), profile_passes (kernel and CPU time of an 8K prefill and of graphed decode steps), profile_small (wall and Python time of lone eager prefill passes, with and
without checkpoint stops), kivi_graphs (graphed int2 decode against eager int2 decode) and
captures (in-pass SSM checkpoints against runs that stopped there, on the GPU), llm_bf16_loops / llm_int2_loops (the
LLM API rows with the attention loop's variants on, beside the rows), profile_decode_batches (a graphed decode step's GPU time by kernel at batch 1, 8 and 16, PDL off),
fused_residual (graphed decode at batch 1, 8 and 16 with the residual add and norm inside the GEMVs against
HEADROOM_FUSED_RESIDUAL=0, one engine after the other: steps, graph replays, the same greedy tokens), fused_conv (the
same for Gated DeltaNet's decode conv in the in-projection's GEMV against HEADROOM_FUSED_CONV=0), fused_gate_norm
(the same for its output norm in the delta rule's decode kernel, HEADROOM_DECODE_GATE_NORM=1 against 0),
fused_conv_in_step (its conv in that kernel, HEADROOM_DECODE_CONV_IN_STEP=1 against 0), fused_step (both against
neither), fused_swiglu (SwiGLU's activation in the gate|up GEMV's epilogue, HEADROOM_FUSED_SWIGLU=1 against 0),
fused_prescaled_norm (at 2-16 sequences the next norm's weight in the residual GEMVs' epilogue and its 1 / rms on
the next GEMV's output rows, HEADROOM_PRESCALED_NORM=1 against 0), fused_conv_rows (Gated DeltaNet's decode conv in
the in-projection's GEMV at 2-16 sequences too, against its own launch there), fused_prescaled_conv_rows (both),
fused_early_residual (the residual GEMVs load their residual rows before their loop, HEADROOM_EARLY_RESIDUAL=1
against 0), fused_prescaled_early_residual (with the prescaled norm), gemv_fuzz (the
GEMV's fused modes against the unfused kernels over random configurations),
llm_int2_tuned (the int2 LLM API rows with the
paged-attention tunings of ENGINE_SPEED_EXTEND_TUNING / ENGINE_SPEED_DECODE_TUNING, JSON objects such as
'{"d_chunks": 2}', beside the rows), gemv (kernels/gemv.py's
configurations against cuBLAS at the decode shapes), short_passes (lone short prefill passes with the delta rule
token by token against fla: engine/layers/linear_attention.py's RECURRENT_ROWS), fla_configs (after the parts
that serve: the configs fla's autotuners picked, written to OUTDIR/fla_tuned_configs.json, which
kernels/fla_tuned_configs.json ships; the part also writes that file in this checkout, so that serve_cold_tuned,
which follows, starts with them and an empty Triton cache). `serve` starts its
server with an empty Triton cache whatever ran before it, so its start is a cold one. Rows measured by several parts merge
into one table; results also go to /tmp/engine_speed_state.json so a second command on the same machine can
add the remaining parts. Writes OUTDIR/engine_speed.json (the issue's schema) and OUTDIR/engine_speed_detail.json.

How each figure is taken:
- prefill_*: one request of N tokens, 1 new token, wall time, after one untimed request of the same length (as
  transformers is timed: part_hf) (HTTP for 8K/32K with the 24 GiB / 32K plan;
  LLM API with a 270K-token pool for 128K and the int2 rows). N/seconds.
- decode_bs*: HTTP, B concurrent streams of 256-token prompts and 129 new tokens: tokens received while all B
  streams decode, over that window (serve's detail decode_bs*_streamed). Beside them (decode_bs*): B concurrent
  non-streamed requests, (time for 65 new tokens - time for 1) / (64 B), whose two admissions differ too much
  to stand for decode alone (session 11: above the limit at batch 8 and 16).
- *_decode_*_32k: LLM API, B prompts of 32K tokens, 65 new tokens; the wall time of each decode-only pass
  (start of one forward to the start of the next: forward, sampling and the loop), B / median pass time.
- limits: decode = B / (bytes a step must move / measured copy bandwidth), bytes = weights + each request's
  KV (pool format) + recurrent state read and written; prefill = measured bf16 matmul rate / (2 x params)
  FLOP per token (attention FLOPs not counted, as in the issue).
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode_parts  # noqa: E402
import engine_speed_parts as parts  # noqa: E402
import gpu_engine  # noqa: E402

STATE = Path("/tmp/engine_speed_state.json")
MODEL = gpu_engine.MODEL_4B
PORT = 18080
ROWS = ("decode_bs1", "decode_bs8", "decode_bs16", "prefill_8k", "prefill_32k", "int2_decode_bs1_32k",
        "int2_decode_bs8_32k", "bf16_decode_bs1_32k", "bf16_decode_bs8_32k", "int2_prefill_32k", "int2_prefill_128k",
        "bf16_prefill_128k", "cold_start_s")
RNG = random.Random(18)


def prompt(n: int) -> list[int]:
    return [RNG.randrange(1000, 200000) for _ in range(n)]


def http_prompt(n: int) -> list[int]:
    """Token ids the server accepts: the random model has no tokenizer, so `headroom serve` falls back to its
    byte tokenizer and refuses ids past its vocabulary (as bench/gpu_serve_bench.sh's --token-id-range 32 127)."""
    return [RNG.randrange(32, 128) for _ in range(n)]


# Prompt lengths of the greedy probe after /ready: a short one, one with checkpoint stops, one past a chunk.
PROBE_LENGTHS = (37, 300, 9000)


def _probe_prompt(n: int) -> list[int]:
    """The same n token ids in every run (byte-tokenizer range, as http_prompt)."""
    return [32 + (i * 37 + n) % 96 for i in range(n)]


def headroom_cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from headroom.main import main; sys.exit(main())", *args]


def part_serve(state: dict, cold_start_only: bool = False, kv: str = "bf16", flags: tuple[str, ...] = (),
               extra_env: dict[str, str] | None = None, label: str = "cold_start_tuned_s") -> dict:
    """Cold start to /ready, then prefill and decode over HTTP (24 GiB plan, bf16 KV, 32K context, 16 running).
    cold_start_only: another first start, with an empty Triton compile cache (TRITON_CACHE_DIR) and the fla
    configs that kernels/fla_tuned_configs.json now holds (the fla_configs part writes it): the cold start of a
    fresh machine running this checkout with the shipped configs.
    kv="int2": issue 18's INT2 plan instead (128K context, 8 running): prefill of 32K and 120K prompts and
    decode at batch 1 and 8 with 32K of context each, over HTTP (the rows stay the LLM API's).
    flags: more server flags (serve_plain: --no-interjection), measured beside the rows, not into them.
    extra_env, label: a cold_start_only start with these environment variables (serve_cold_one_by_one:
    HEADROOM_COMPILE_AHEAD=0, the warm-up compiling each kernel inside its pass), its seconds kept as state[label]."""
    import httpx

    if kv == "int2":
        args = ["serve", "--model", str(MODEL), "--device", "cuda", "--gpu-memory", "24GiB", "--context-length",
                "131072", "--kv-cache-dtype", "int2", "--max-new-tokens", "512", "--max-running-requests", "8",
                "--port", str(PORT)]
    else:
        args = ["serve", "--model", str(MODEL), "--device", "cuda", "--gpu-memory", "24GiB", "--context-length",
                "32768", "--max-new-tokens", "512", "--max-running-requests", "16", "--port", str(PORT)]
    args += list(flags)
    into_rows = kv == "bf16" and not flags
    suffix = ("_" + kv if kv != "bf16" else "") + "".join("_" + f.strip("-") for f in flags)
    log_path = Path(f"/tmp/engine_speed_serve_{label}.log" if cold_start_only else f"/tmp/engine_speed_serve{suffix}.log")
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    env = dict(os.environ, **(extra_env or {}))
    if cold_start_only or into_rows:
        # The row's cold start is a first start: an empty Triton compile cache, whatever earlier parts compiled.
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    started = time.perf_counter()
    command = headroom_cli(*args)
    if cold_start_only and os.environ.get("ENGINE_SPEED_STACKS") == "1":
        # Where the start's seconds go, by thread and Python frame (bench/stack_sampler.py), beside the JSON.
        command = [sys.executable, str(Path(__file__).with_name("stack_sampler.py")),
                   str(Path(sys.argv[1]).resolve() / f"stacks_{label}.json"), "--", *args]
    server = subprocess.Popen(command, cwd="/tmp", stdout=log, stderr=subprocess.STDOUT, env=env)
    out: dict = {"command": "headroom " + " ".join(args)}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=600) as client:
            while True:
                if server.poll() is not None:
                    raise RuntimeError("headroom serve exited: " + log_path.read_text()[-2000:])
                if "warm-up failed" in log_path.read_text():
                    # Never ready (and not live): stop now rather than wait out the command's time limit.
                    raise RuntimeError("headroom serve's warm-up failed: " + log_path.read_text()[-3000:])
                try:
                    if client.get("/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            out["cold_start_s"] = time.perf_counter() - started
            out["start_up_log"] = [line for line in log_path.read_text().splitlines() if "start-up" in line
                                   or "fla kernel configs" in line or "captured decode" in line
                                   or "scheduler:" in line]
            if kv == "bf16" and not flags:
                # What the first requests after /ready compute, greedily: a start-up that left garbage anywhere
                # (compile ahead's dry passes) answers differently from one that did not (serve_cold_one_by_one).
                probe = [client.post("/v1/completions", json={
                    "prompt": _probe_prompt(n), "max_tokens": 16, "ignore_eos": True, "temperature": 0,
                    "return_token_ids": True}).json()["choices"][0].get("token_ids") for n in PROBE_LENGTHS]
                own, other = ("probe_" + label, "probe_serve") if cold_start_only else ("probe_serve", None)
                state[own] = out["greedy_probe"] = probe
                for key in (other,) if other else [k for k in state if k.startswith("probe_cold")]:
                    if key in state:
                        out[f"greedy_probe_equals_{key}"] = state[key] == probe
            if cold_start_only:
                state[label] = out["cold_start_s"]
                return out
            if into_rows:
                state["rows"]["cold_start_s"]["tok_per_s"] = None
                state["cold_start_s"] = out["cold_start_s"]

            def complete(tokens: list[int], max_tokens: int) -> float:
                # The body is encoded before the clock, as transformers' input tensor is built before its clock (the
                # client's JSON encoding of 32K ids is about 3 ms); the server's read and validation are timed.
                body = json.dumps({"prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True,
                                   "temperature": 0}, separators=(",", ":")).encode()
                t0 = time.perf_counter()
                response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                response.raise_for_status()
                got = response.json()["usage"]["completion_tokens"]
                if got != max_tokens:
                    raise RuntimeError(f"asked for {max_tokens} tokens, got {got}")
                return time.perf_counter() - t0

            def concurrent(batch: int, max_tokens: int, context: int = 256) -> float:
                prompts = [http_prompt(context) for _ in range(batch)]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(batch) as pool:
                    list(pool.map(lambda p: complete(p, max_tokens), prompts))
                return time.perf_counter() - t0

            def server_seconds() -> dict[str, float]:
                """The server's own pass-time and TTFT sums (where a request's wall time goes)."""
                keys = ("headroom_pass_seconds_sum", "headroom_pass_seconds_count",
                        "headroom_time_to_first_token_seconds_sum")
                lines = client.get("/metrics").text.splitlines()
                return {key: float(line.split()[-1]) for line in lines for key in keys if line.startswith(key + " ")}

            complete(http_prompt(8192), 1)  # a full chunk: a shape class the warm-up may not have compiled
            prompts = (("prompt_30", 30), ("prompt_256", 256), ("prefill_8k", 8192), ("prefill_32k", 32000))
            if kv == "int2":
                prompts = (("prompt_30", 30), ("prefill_32k", 32000), ("prefill_120k", 120000))
            for name, n in prompts:
                # Warm at this very length first, as transformers is (part_hf); the first call's time stays beside.
                first = complete(http_prompt(n), 1)
                before = server_seconds()
                seconds = complete(http_prompt(n), 1)
                after = server_seconds()
                out[name] = {"seconds": seconds, "tokens": n, "tok_per_s": n / seconds, "first_call_seconds": first,
                             "server": {key: after[key] - before.get(key, 0.0) for key in after}}
                if name in state["rows"] and into_rows:
                    state["rows"][name]["tok_per_s"] = n / seconds
            for batch in ((1, 8) if kv == "int2" else (1, 8, 16)):
                context = 32000 if kv == "int2" else 256
                concurrent(batch, 3, context)
                t1, t65 = concurrent(batch, 1, context), concurrent(batch, 65, context)
                # Kept beside the rows, not in them: the difference of two wall times, each with its own admission
                # of B concurrent prefills, came out above the bandwidth limit at batch 8 and 16 once decode steps
                # overlapped (session 11 call 4: 3,938 and 9,084 tok/s against limits of 3,685 and 6,720).
                out[f"decode_bs{batch}"] = {"t1_s": t1, "t65_s": t65, "context": context,
                                            "tok_per_s": batch * 64 / (t65 - t1)}
            # Steady state through streams: B concurrent streams, tokens counted while all B are decoding (from
            # the last stream's first chunk to the first stream's last), so admission and tail drop out.
            def streamed(tokens: list[int], max_tokens: int) -> list[tuple[float, int]]:
                body = {"prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                        "stream": True, "return_token_ids": True}
                arrivals = []
                with client.stream("POST", "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"]
                            if choice:
                                arrivals.append((time.perf_counter(), len(choice[0].get("token_ids") or [])))
                return arrivals

            for batch in ((1, 8) if kv == "int2" else (1, 8, 16)):
                context = 32000 if kv == "int2" else 256
                with ThreadPoolExecutor(batch) as pool:
                    streams = list(pool.map(lambda p: streamed(p, 129), [http_prompt(context) for _ in range(batch)]))
                out[f"decode_bs{batch}_streamed"] = parts.steady_stream_rate(streams)
                if into_rows:
                    # The rows: tokens the B streams received while all B were decoding, over that window.
                    state["rows"][f"decode_bs{batch}"]["tok_per_s"] = out[f"decode_bs{batch}_streamed"]["tok_per_s"]
            out["metrics"] = [line for line in client.get("/metrics").text.splitlines() if line.startswith("headroom_")][:80]
            compiles = [line for line in out["metrics"] if line.startswith("headroom_kernel_compiles_after_ready_total")]
            out["kernel_compiles_after_ready"] = float(compiles[0].split()[-1]) if compiles else None
    finally:
        server.terminate()
        server.wait(60)
        # The server's whole log (which kernels compiled after /ready, and in which request) goes with the results.
        out["compiled_while_serving"] = [line[-500:] for line in log_path.read_text().splitlines()
                                         if "kernel compiled while serving" in line][:60]
        shutil.copy(log_path, Path(sys.argv[1]) / log_path.name)
    return out


def llm_settings(kv: str) -> dict:
    """The LLM API rows' engine settings (part_llm), KV cache in `kv`."""
    return {"device": "cuda", "dtype": "bfloat16", "kv_dtype": kv, "max_total_tokens": 270336, "ssm_slots": 40,
            "chunked_prefill_size": 8192, "context_length": 140000, "max_running_requests": 16,
            "enable_prefix_cache": False}


# The decode batches (256 tokens of context each).
DECODE_BATCHES = (1, 8, 16)


def part_llm(state: dict, kv: str, into_rows: bool = True, decode_only: bool = False,
             decode_batches: tuple[int, ...] = DECODE_BATCHES, long_batches: tuple[int, ...] = (1, 8)) -> dict:
    """LLM API: prefill 8K/32K/128K, decode at decode_batches with 256 tokens of context and at long_batches with
    32K tokens of context per sequence (into the issue's rows unless into_rows is False; decode_only: the decode
    rows alone, for A/Bs of decode kernels)."""
    from headroom.engine.llm import LLM

    settings = llm_settings(kv)
    out: dict = {"prefill": {}, "decode": {}}
    try:
        llm = LLM(str(MODEL), **settings)
    except Exception:  # noqa: BLE001 - KIVI decode graphs are new on the GPU: keep the eager figures if they fail
        out["graphs_failed"] = traceback.format_exc()[-3000:]
        llm = LLM(str(MODEL), cuda_graph_max_batch=0, **settings)
    steps = parts.time_passes(llm.runner)
    out["capture"] = gpu_engine._capture_info(llm.graph_capture)
    llm.generate([prompt(8192 + 300)], max_new_tokens=2, ignore_eos=True)
    llm.generate([prompt(64) for _ in range(8)], max_new_tokens=3, ignore_eos=True)

    def prefill(n: int) -> None:
        # Warm at this very length first, as transformers is (part_hf).
        llm.generate([prompt(n)], max_new_tokens=1, ignore_eos=True)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        # The prompt drawn before the clock starts (32K random ids take ~10 ms of the host; until session 26 the
        # LLM API's prefill rows timed them, transformers' never did).
        ids = prompt(n)
        seconds, _ = gpu_engine.sync_time(lambda: llm.generate([ids], max_new_tokens=1, ignore_eos=True))
        out["prefill"][n] = {"seconds": seconds, "tokens_per_s": n / seconds,
                             "peak_above_static_bytes": torch.cuda.max_memory_allocated() - before}
        row = f"{kv}_prefill_{n // 1024}k"
        if row in state["rows"] and into_rows:
            state["rows"][row]["tok_per_s"] = n / seconds

    def decode(batch: int, context: int) -> None:
        steps.clear()
        llm.generate([prompt(context) for _ in range(batch)], max_new_tokens=65, ignore_eos=True)
        timed = [s for s in steps if s["decode"] and "seconds" in s]
        median = statistics.median(s["seconds"] for s in timed)
        out["decode"][f"bs{batch}_ctx{context}"] = {"passes": len(timed), "median_step_ms": median * 1000,
                                                   "tokens_per_s": batch / median, "graphed": timed[0]["graphed"]}
        graphs = llm.runner.decode_graphs
        if graphs is not None and batch in graphs.captured_sizes:
            # The graph alone, replayed back to back: what a step costs the GPU, against the step's wall time
            # (the host's share that overlapped decode, engine/loop/in_flight.py, has to hide).
            out["decode"][f"bs{batch}_ctx{context}"]["graph_replay_ms"] = graphs.replay_seconds(batch) * 1000
        row = f"{kv}_decode_bs{batch}_32k"
        if context == 32768 and row in state["rows"] and into_rows:
            state["rows"][row]["tok_per_s"] = batch / median

    if not decode_only:
        prefill(8192)
        prefill(32768)
    if kv == "bf16" and not decode_only:
        # The same prefill with the naive elementwise path (before this kernels).
        from headroom.kernels import ops

        ops.set_fused(False)
        ids = prompt(8192)
        seconds, _ = gpu_engine.sync_time(lambda: llm.generate([ids], max_new_tokens=1, ignore_eos=True))
        ops.set_fused(True)
        out["prefill"]["8192_unfused"] = {"seconds": seconds, "tokens_per_s": 8192 / seconds}
    for batch in decode_batches:  # short context, as the HTTP rows
        decode(batch, 256)
    for batch in long_batches:
        decode(batch, 32768)
    if not decode_only:
        prefill(131072)
    state.setdefault("kv_bytes_per_token", {})[kv] = parts.kv_bytes_per_token(llm.runner.kv_pool)
    return out


# The attention loop's variants (kernels/paged_attention.py: mask_split, lazy_rescale) in every launch; extend launches
# take mask_split by default since session 16 (EXTEND_DEFAULTS), lazy_rescale nowhere.
LOOP_VARIANT = {"mask_split": 1, "lazy_rescale": 1}


def part_llm_tuned(state: dict, kv: str, extend: dict, decode: dict) -> dict:
    """part_llm with these paged-attention tunings in every launch (EXTEND_TUNING, DECODE_TUNING; decode graphs
    are captured with them), beside the rows."""
    from headroom.kernels import paged_attention as pa

    with pa.tuned(extend, decode):
        return {"extend_tuning": dict(extend), "decode_tuning": dict(decode), **part_llm(state, kv, into_rows=False)}


def free_gpu_memory() -> None:
    """A finished engine's memory back to the GPU: its runner's forward wrapper is a cycle, so the engine and its
    pools outlive their last reference until a collection; then the caching allocator's blocks."""
    gc.collect()
    torch.cuda.empty_cache()


def part_llm_gemv(state: dict, kv: str, variants: dict[str, dict]) -> dict:
    """part_llm's decode rows once for each variant of the shipped GEMV table, beside the rows: {name: {"*": fields
    for every one-row entry, "NxK": fields for the one-row entries of that weight shape (plain and SwiGLU input
    alike), "*@M" and "NxK@M" the same for the entries of M rows}}, each a GemvConfig field's value (prefetch,
    l2_prefetch, block_n, ...; decode_parts.table_variant). The sweep times GEMVs in chains
    of GEMVs; what a change does between the small kernels of a step (the norms, the conv, the delta rule,
    attention) only a step shows."""
    from headroom.kernels import gemv

    shipped = gemv.load_tuned_configs(torch.device("cuda"))
    out: dict = {}
    try:
        for name, changes in variants.items():
            # One variant's failure (a tile that needs more shared memory than the GPU has, a key naming no entry)
            # is recorded and the next variant runs: the ones before it stay measured.
            try:
                gemv._tuned = decode_parts.table_variant(shipped, changes)
                out[name] = {"changes": changes, **part_llm(state, kv, into_rows=False, decode_only=True)}
            except Exception:  # noqa: BLE001 - kept in the part's JSON
                out[name] = {"changes": changes, "error": traceback.format_exc()[-3000:]}
            finally:
                free_gpu_memory()  # every variant's engine gone before the next one's starts
    finally:
        gemv._tuned = shipped
    return out


def part_gemv_step(state: dict, target: Path) -> dict:
    """The GEMV table tuned in the graphed step (decode_parts.step_gemv_tune at the row counts in
    ENGINE_SPEED_STEP_TUNE_ROWS, default "1"; budget ENGINE_SPEED_STEP_TUNE_S, default 240 s; the isolated sweep's
    fastest ENGINE_SPEED_STEP_CANDIDATES, default 5, tried in the step), then part_llm's decode rows (at
    DECODE_BATCHES and each tuned row count) with the shipped table and with the tuned one, one process; the tuned
    table (what was tuned when a limit or an error stopped the walk) written as OUTDIR/gemv_tuned_configs.json
    (decode_parts.step_table; this checkout's is left as it was: ship it once the decode rows agree). ENGINE_SPEED_FUSED_ROWS (engine/layers/residual.py FUSED_ROWS,
    1 as shipped) and ENGINE_SPEED_FUSED_CONV_ROWS (engine/layers/linear_attention.py FUSED_CONV_ROWS, 1): tune with
    the residual add and the next norm, or the conv step, fused into the GEMVs of passes up to that many rows
    (sessions 18 and 19 measured them losing at 8 and 16 rows, with tables tuned without them); the decode rows then
    also run the shipped table with those settings, so that the fusions and the table each show apart."""
    from headroom.engine.layers import linear_attention, residual
    from headroom.engine.llm import LLM
    from headroom.kernels import gemv
    from headroom.kernels.gdn_fla import gpu_name
    from headroom.kernels.ops import GEMV_ROWS
    from headroom.kernels.tuned_table import entries_for, table_text

    text = os.environ.get("ENGINE_SPEED_STEP_TUNE_ROWS", "1")
    rows = tuple(int(m) for m in text.split(",") if m.strip())
    limit = min(GEMV_ROWS, llm_settings("bf16")["max_running_requests"])
    if not rows or not all(1 <= m <= limit for m in rows):
        raise ValueError(f"ENGINE_SPEED_STEP_TUNE_ROWS={text!r}: a comma list of row counts in 1..{limit}")
    switches = {"ENGINE_SPEED_FUSED_ROWS": (residual, "FUSED_ROWS"),
                "ENGINE_SPEED_FUSED_CONV_ROWS": (linear_attention, "FUSED_CONV_ROWS")}
    shipped_fused = {name: getattr(*where) for name, where in switches.items()}
    fused = {name: int(os.environ.get(name, value)) for name, value in shipped_fused.items()}

    def fuse(setting: dict[str, int]) -> None:
        for name, (module, attribute) in switches.items():
            setattr(module, attribute, setting[name])

    out: dict = {"fused": fused, "shipped_fused": shipped_fused, "tune": {}, "decode": {}}
    cuda = torch.device("cuda")
    shipped = gemv.load_tuned_configs(cuda)
    try:
        fuse(fused)
        try:
            llm = LLM(str(MODEL), cuda_graph_max_batch=1, **llm_settings("bf16"))
            llm.generate([prompt(64)], max_new_tokens=3, ignore_eos=True)  # every kernel compiled and loaded once
            decode_parts.step_gemv_tune(
                llm.runner, rows, float(os.environ.get("ENGINE_SPEED_STEP_TUNE_S", "240")),
                int(os.environ.get("ENGINE_SPEED_STEP_CANDIDATES", decode_parts.STEP_CANDIDATES)), out["tune"])
        except Exception:  # noqa: BLE001 - a limit or an error mid-walk: keep and write what was tuned
            out["tune_error"] = traceback.format_exc()[-3000:]
        llm = None
        free_gpu_memory()
        tuned = {(e["n"], e["k"], e["m"], e["input"]): gemv.config_of(e) for e in out["tune"].get("table", [])}
        if tuned:
            asked = "".join(f"{name}={value} " for name, value in fused.items() if value != shipped_fused[name])
            previous = entries_for(gemv.TUNED_CONFIGS, cuda)
            source = (f"{asked}ENGINE_SPEED_STEP_TUNE_ROWS={','.join(map(str, rows))} python3 bench/engine_speed.py "
                      "OUT gemv_step (entries marked step_tuned), over the previous table: "
                      + json.loads(gemv.TUNED_CONFIGS.read_text()).get(gpu_name(cuda), {}).get("source", "none"))
            (target / "gemv_tuned_configs.json").write_text(table_text(
                cuda, decode_parts.step_table(out["tune"], previous), source, gemv.TUNED_CONFIGS))
        runs = [("shipped", shipped, shipped_fused), ("step_tuned", tuned, fused)]
        if fused != shipped_fused:
            runs.append(("shipped_table_fused", shipped, fused))
        if tuned and "tune_error" not in out and (tuned != shipped or fused != shipped_fused):
            for name, table, setting in runs:
                gemv._tuned = table
                fuse(setting)
                out["decode"][name] = part_llm(state, "bf16", into_rows=False, decode_only=True,
                                               decode_batches=tuple(sorted({*DECODE_BATCHES, *rows})))
    finally:
        gemv._tuned = shipped
        fuse(shipped_fused)
    return out


# Batches with no GEMV table entry of their own (the tables have 1, 8 and 16 rows).
NEAREST_BATCHES = (2, 3, 4, 6, 12)


def part_llm_nearest(state: dict) -> dict:
    """Decode at NEAREST_BATCHES (256 tokens of context) with kernels/gemv.py NEAREST_ROWS on (the next larger row
    count's entry), off (cuBLAS runs their projections) and on again, one engine after the other in one process
    (A/B/A: the second engine of session 24's first call, off then on, could have gained from the order alone)."""
    from headroom.kernels import gemv

    shipped, out = gemv.NEAREST_ROWS, {}
    try:
        for name, on in (("nearest", True), ("exact_only", False), ("nearest_again", True)):
            gemv.NEAREST_ROWS = on
            out[name] = part_llm(state, "bf16", into_rows=False, decode_only=True, decode_batches=NEAREST_BATCHES,
                                 long_batches=())
    finally:
        gemv.NEAREST_ROWS = shipped
    return out


def prefetch_variants() -> dict[str, dict]:
    """llm_bf16_prefetch's variants: every one-row entry loading each count in ENGINE_SPEED_GEMV_PREFETCH (a comma
    list of 1, 2, 4; default "2,4") of weight tiles before its PDL wait (GemvConfig.prefetch)."""
    asked = decode_parts.parse_prefetches(os.environ.get("ENGINE_SPEED_GEMV_PREFETCH", "2,4"))
    return {f"prefetch{p}": {"*": {"prefetch": p}} for p in asked}


def gemv_variants() -> dict[str, dict]:
    """llm_bf16_gemv's variants, ENGINE_SPEED_GEMV_VARIANTS (JSON, part_llm_gemv's form); by default the shipped
    table and every one-row entry asking L2 for 2 and 4 tiles before its PDL wait (GemvConfig.l2_prefetch)."""
    from headroom.kernels.gemv import GemvConfig

    text = os.environ.get("ENGINE_SPEED_GEMV_VARIANTS", "")
    variants = json.loads(text) if text else {"shipped": {}, "l2_2": {"*": {"l2_prefetch": 2}},
                                               "l2_4": {"*": {"l2_prefetch": 4}}}
    fields = set(vars(GemvConfig()))

    def valid(changes: object) -> bool:
        # (a misspelt shape key would match no entry and time the shipped table under the variant's name)
        return isinstance(changes, dict) and all(
            re.fullmatch(r"(\*|\d+x\d+)(@(?!1$)\d+)?", shape) and isinstance(c, dict) and set(c) <= fields
            and all(isinstance(v, int) for v in c.values()) for shape, c in changes.items())

    if not isinstance(variants, dict) or not all(valid(changes) for changes in variants.values()):
        raise ValueError(f"ENGINE_SPEED_GEMV_VARIANTS: each variant must map \"*\" or \"NxK\" (N, K integers), "
                         f"either with \"@M\" for the entries of M rows, to "
                         f"integer GemvConfig fields ({sorted(fields)}), got {text!r}")
    return variants


def env_tuning(name: str) -> dict:
    """A tuning dict from the environment variable `name` (JSON), {} when unset; a bad value fails the part."""
    text = os.environ.get(name, "")
    value = json.loads(text) if text else {}
    if not isinstance(value, dict) or not all(isinstance(v, int) for v in value.values()):
        raise ValueError(f"{name} must be a JSON object of integers, got {text!r}")
    return value


def part_hf(state: dict, decode: bool = True, prefill: bool = True) -> dict:
    """Warm transformers (sdpa + fla): same weights, prefill 8K/32K/128K, decode batch 1/8/16 and batch 1 at 32K
    (decode=False: the prefill rows only, the ones the issue's ratio goals are on; its decode runs at 7-150 tok/s
    and takes two minutes; prefill=False: the decode rows only, for a call of their own)."""
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).to(gpu_engine.DEV).eval()
    out: dict = {}

    def run(ids, new=None):
        with torch.no_grad():
            if new is None:
                return gpu_engine.sync_time(lambda: hf(ids, logits_to_keep=1, use_cache=False))[0]
            return gpu_engine.sync_time(lambda: hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False))[0]

    dev = gpu_engine.DEV
    run(torch.tensor([prompt(8192)], device=dev))
    run(torch.tensor([prompt(64) for _ in range(8)], device=dev), 3)
    for name, n in (("prefill_8k", 8192), ("prefill_32k", 32000), ("bf16_prefill_128k", 131072)) if prefill else ():
        try:
            # Warm at this very length first (until session 3 only 8K was: 32K and 128K were first calls).
            run(torch.tensor([prompt(n)], device=dev))
            out[name] = n / run(torch.tensor([prompt(n)], device=dev))
        except torch.OutOfMemoryError as exc:
            out[name] = f"OOM: {exc}"[:200]
        torch.cuda.empty_cache()
    for name, batch, context in (("decode_bs1", 1, 256), ("decode_bs8", 8, 256), ("decode_bs16", 16, 256),
                                 ("bf16_decode_bs1_32k", 1, 32768)) if decode else ():
        ids = torch.tensor([prompt(context) for _ in range(batch)], device=dev)
        # Warm at this very shape first (fla's kernels tune on the first call at a shape; session 27's column did
        # not, and its batch 16 ran slower than its batch 8).
        run(ids, 2)
        out[name] = batch * 64 / (run(ids, 65) - run(ids, 1))
    for name, value in out.items():
        if isinstance(value, float):
            state["rows"][name]["transformers_tok_per_s"] = value
    return out


def _stop(signum, frame) -> None:
    raise RuntimeError("stopped by SIGTERM (the command's time limit): the part's figures so far are kept")


def _gemv_part(state: dict, target: Path) -> dict:
    """The GEMV sweep, and the table kernels/gemv_tuned_configs.json would ship from it (OUTDIR/, to commit).
    With GEMV_BATCHES (some batches swept) the shipped table's entries of the other batches are kept."""
    from headroom.kernels import gemv
    from headroom.kernels.tuned_table import entries_for, table_text

    sweep = decode_parts.gemv_sweep(float(os.environ.get("GEMV_SWEEP_BUDGET_S", "150")))
    source = "python3 bench/engine_speed.py OUT gemv"
    if sweep["batches"] != list(decode_parts.GEMV_BATCH_BUDGET):
        source = (f"GEMV_BATCHES={','.join(map(str, sweep['batches']))} {source} (other batches' entries kept from "
                  "the previous table)")
    if decode_parts.GEMV_MIN_GAIN_ENV in os.environ:
        source = f"{decode_parts.GEMV_MIN_GAIN_ENV}={os.environ[decode_parts.GEMV_MIN_GAIN_ENV]} {source}"
    if decode_parts.gemv_prefetches() != [1]:
        source = f"GEMV_PREFETCH={','.join(map(str, decode_parts.gemv_prefetches()))} {source}"
    configs = decode_parts.gemv_table(sweep, entries_for(gemv.TUNED_CONFIGS, parts.DEV))
    text = table_text(parts.DEV, configs, source, gemv.TUNED_CONFIGS)
    (target / "gemv_tuned_configs.json").write_text(text)
    # Also into this checkout, so that the parts after this one (and servers they start) run the new table.
    gemv.TUNED_CONFIGS.write_text(text)
    gemv._tuned = None
    return sweep


def main() -> None:
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)
    names = sys.argv[2:] or ["serve", "llm_bf16", "hf", "llm_int2", "kernels", "logits", "profile", "tiles"]
    # A second command on the same machine continues the first's state; on another machine, pass the first's
    # engine_speed_detail.json as ENGINE_SPEED_INIT.
    init = Path(os.environ.get("ENGINE_SPEED_INIT", STATE))
    state = json.loads(init.read_text()) if init.exists() else {"rows": {name: {} for name in ROWS}, "detail": {}}
    gpu_engine._build_4b()
    if "roofline" not in state:
        state["roofline"] = gpu_engine.section_roofline()
        state["env"] = gpu_engine.section_env()
        torch.cuda.empty_cache()
    todo = {"serve": part_serve, "llm_bf16": lambda s: part_llm(s, "bf16"), "hf": part_hf,
            "hf_prefill": lambda s: part_hf(s, decode=False),
            "hf_decode": lambda s: part_hf(s, prefill=False),
            "llm_int2": lambda s: part_llm(s, "int2"),
            "llm_bf16_loops": lambda s: part_llm_tuned(s, "bf16", LOOP_VARIANT, LOOP_VARIANT),
            "llm_int2_loops": lambda s: part_llm_tuned(s, "int2", LOOP_VARIANT, LOOP_VARIANT),
            # The same rows again, beside the rows: after a part that changed a table (gemv), in the same process.
            "llm_bf16_after": lambda s: part_llm(s, "bf16", into_rows=False),
            "llm_bf16_prefetch": lambda s: part_llm_gemv(s, "bf16", prefetch_variants()),
            "llm_bf16_gemv": lambda s: part_llm_gemv(s, "bf16", gemv_variants()),
            "gemv_step": lambda s: part_gemv_step(s, Path(sys.argv[1])),
            "llm_bf16_nearest": part_llm_nearest,
            "llm_int2_tuned": lambda s: part_llm_tuned(s, "int2", env_tuning("ENGINE_SPEED_EXTEND_TUNING"),
                                                       env_tuning("ENGINE_SPEED_DECODE_TUNING")),
            "kernels": lambda s: parts.kernel_checks(),
            "logits": lambda s: parts.logit_check(("tiny",)),
            "logits_4b": lambda s: parts.logit_check(("4b",)), "profile": lambda s: gpu_engine.section_profile(),
            "profile_passes": lambda s: parts.profile_passes(MODEL),
            "prefill_host": lambda s: parts.prefill_host(MODEL, llm_settings("bf16")),
            "profile_small": lambda s: parts.profile_small_passes(MODEL),
            "profile_decode_batches": lambda s: parts.profile_decode_batches(MODEL),
            "fused_residual": lambda s: parts.fusion_speed(MODEL, "residual"),
            "fused_conv": lambda s: parts.fusion_speed(MODEL, "conv"),
            "fused_gate_norm": lambda s: parts.fusion_speed(MODEL, "gate_norm"),
            "fused_conv_in_step": lambda s: parts.fusion_speed(MODEL, "conv_in_step"),
            "fused_step": lambda s: parts.fusion_speed(MODEL, "step"),
            "fused_swiglu": lambda s: parts.fusion_speed(MODEL, "swiglu"),
            "fused_prescaled_norm": lambda s: parts.fusion_speed(MODEL, "prescaled_norm"),
            "fused_conv_rows": lambda s: parts.fusion_speed(MODEL, "conv_rows"),
            "fused_prescaled_conv_rows": lambda s: parts.fusion_speed(MODEL, "prescaled_conv_rows"),
            "fused_early_residual": lambda s: parts.fusion_speed(MODEL, "early_residual"),
            "fused_prescaled_early_residual": lambda s: parts.fusion_speed(MODEL, "prescaled_early_residual"),
            "profile_decode_int2": lambda s: {kv: parts.profile_decode_batches(MODEL, (1, 8), kv_dtype=kv)
                                              for kv in ("bf16", "int2")},
            "kivi_graphs": lambda s: parts.kivi_graph_check(MODEL), "captures": lambda s: parts.capture_check(MODEL),
            "fla_configs": lambda s: parts.save_fla_configs(Path(sys.argv[1])),
            "serve_cold_tuned": lambda s: part_serve(s, cold_start_only=True),
            "serve_cold_one_by_one": lambda s: part_serve(s, cold_start_only=True, label="cold_start_one_by_one_s",
                                                          extra_env={"HEADROOM_COMPILE_AHEAD": "0"}),
            # The cold start with kernels/gemv.py NEAREST_ROWS off (session 24 turned it on; its two cold starts
            # took 64 s on an H100 where session 23's took 38-40 s): serve_cold_tuned, this, serve_cold_tuned_again.
            "serve_cold_exact_rows": lambda s: part_serve(s, cold_start_only=True, label="cold_start_exact_rows_s",
                                                          extra_env={"HEADROOM_GEMV_NEAREST_ROWS": "0"}),
            "serve_cold_tuned_again": lambda s: part_serve(s, cold_start_only=True, label="cold_start_tuned_again_s"),
            "serve_int2": lambda s: part_serve(s, kv="int2"),
            "serve_plain": lambda s: part_serve(s, flags=("--no-interjection",)),
            "serve_switch5": lambda s: part_serve(s, flags=("--gil-switch-ms", "5")),
            "serve_lag4": lambda s: part_serve(s, flags=("--interjection-lag", "4")),
            "serve_lag8": lambda s: part_serve(s, flags=("--interjection-lag", "8")),
            "serve_trace": lambda s: __import__("serve_trace").serve_trace(MODEL),
            "decode_tiles": lambda s: parts.decode_tile_sweep(),
            "profile_decode_long": lambda s: parts.profile_decode_long(MODEL),
            "profile_decode_long_nopdl": lambda s: parts.profile_decode_long(MODEL, pdl=False),
            "serve_trace_plain": lambda s: __import__("serve_trace").serve_trace(MODEL, extra=("--no-interjection",)),
            "tiles": lambda s: parts.attention_tile_sweep(), "kivi_load": lambda s: parts.kivi_load_sweep(), "attention_backends": lambda s: parts.attention_backends(), "kivi_blocks": lambda s: parts.kivi_block_path(),
            "kivi_dense": lambda s: parts.kivi_dense_check(), "dense_variants": lambda s: parts.dense_path_variants(),
            "cudnn_layouts": lambda s: parts.cudnn_layout_check(), "cudnn_dirty": lambda s: parts.cudnn_dirty_memory(),
            "dense_pieces": lambda s: parts.dense_pieces(), "decode_window": lambda s: parts.decode_window_check(),
            "half_check": lambda s: __import__("gpu_kernels").check_half_tiles(),
            "page_close": lambda s: __import__("gpu_kernels").check_page_close(),
            "quantizers": lambda s: __import__("gpu_kernels").check_quantizers(),
            "gated_merge": lambda s: __import__("gpu_kernels").check_gated_merge(),
            "split_merges": lambda s: __import__("gpu_kernels").time_split_merges(),
            "llm_bf16_decode": lambda s: part_llm(s, "bf16", into_rows=False, decode_only=True),
            "llm_int2_decode": lambda s: part_llm(s, "int2", into_rows=False, decode_only=True),
            "gemv_fuzz": lambda s: __import__("gpu_kernels").check_fused_gemv(int(os.environ.get("GEMV_FUZZ_CASES", "12"))),
            "attention_check": lambda s: __import__("gpu_kernels").check_attention(),
            "gemv": lambda s: _gemv_part(s, Path(sys.argv[1])), "gemv_check": lambda s: parts._gemv_check(), "short_passes": lambda s: decode_parts.short_pass_sweep(MODEL)}
    command = "python3 bench/engine_speed.py " + " ".join(sys.argv[1:])
    # Parts that would start after this many seconds are skipped (ENGINE_SPEED_DEADLINE_S; default none),
    # so that one device command ends inside its limit with every file written.
    deadline = float(os.environ.get("ENGINE_SPEED_DEADLINE_S", "inf"))
    run_started = time.perf_counter()
    for name in names:
        started = time.perf_counter()
        if started - run_started > deadline:
            state["detail"][name] = {"skipped": f"started after {started - run_started:.0f} s > {deadline} s"}
            continue
        try:
            state["detail"][name] = todo[name](state)
        except Exception:  # noqa: BLE001 - one failing part must not lose the others
            state["detail"][name] = {"error": traceback.format_exc()[-3000:]}
        state["detail"][name + "_seconds"] = time.perf_counter() - started
        free_gpu_memory()
        state.setdefault("commands", [])
        if command not in state["commands"]:
            state["commands"].append(command)
        STATE.write_text(json.dumps(state, indent=1, default=str))
        table = parts.table(state, MODEL, command)
        (target / "engine_speed.json").write_text(json.dumps(table, indent=1))
        (target / "engine_speed_detail.json").write_text(json.dumps(state, indent=1, default=str))
        print(name, "done in", round(time.perf_counter() - started, 1), "s", flush=True)
    for row in parts.table(state, MODEL, command)["rows"]:
        print(f"{row['name']:22} {row['tok_per_s']!s:>10.10} limit {row['limit_tok_per_s']!s:>10.10} "
              f"share {row['share_of_limit']!s:>6.6} hf {row['transformers_tok_per_s']!s:>10.10} "
              f"ratio {row['ratio_to_transformers']!s:>6.6}")
    os.sync()


if __name__ == "__main__":
    main()
