"""Parts of bench/engine_speed.py that decide two kernel paths by measurement on the GPU:
gemv_sweep: kernels/gemv.py's configurations against cuBLAS (torch's F.linear) at the 4B model's decode shapes,
and its fused SwiGLU down projection (silu_mul_gemv) against silu_mul + cuBLAS;
short_pass_sweep: lone short prefill passes with the Gated DeltaNet rows token by token (kernels/gdn_decode.py)
against fla's chunked kernels (engine/layers/linear_attention.py RECURRENT_ROWS)."""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The 4B model's linear layers at decode: (out_features, in_features, how many a step runs).
DECODE_SHAPES = {
    "mlp_gate_up": (18432, 2560, 32), "mlp_down": (2560, 9216, 32), "gdn_in_proj": (12352, 2560, 24),
    # A quantized checkpoint's split GDN projection (its dense b|a cannot stack with qkv|z): not in a bf16 step.
    "gdn_qkvz": (12288, 2560, 0), "gdn_ba": (64, 2560, 0),
    "gdn_out_proj": (2560, 4096, 24), "attn_qkv": (10240, 2560, 8), "attn_o_proj": (2560, 4096, 8),
    "lm_head": (248320, 2560, 1),
}
# The MLP down projection with SwiGLU's activation fused (kernels/gemv.py silu_mul_gemv), swept as a shape of its
# own right after the one it replaces: name -> (the plain shape, the table's input kind). Its input is the gate|up
# output [M, 2K] and its baseline silu_mul + cuBLAS, timed together (also silu_mul + the plain shape's best GEMV,
# which the engine runs instead where the plain shape has an entry); its entries carry "input": "silu_mul".
FUSED_SHAPES = {"mlp_down_silu_mul": ("mlp_down", "silu_mul")}


def _sweep_shapes() -> list[tuple[str, int, int, int, str, str | None]]:
    """(name, n, k, per step, input kind, the plain shape it replaces) in sweep order: each fused shape follows
    its plain one (whose best configuration it times as a baseline)."""
    shapes = []
    for name, (n, k, per_step) in DECODE_SHAPES.items():
        shapes.append((name, n, k, per_step, "x", None))
        shapes += [(fused, n, k, per_step, kind, name) for fused, (plain, kind) in FUSED_SHAPES.items() if plain == name]
    return shapes


def graph_replay_us(fn, calls: int, replays: int, before_each=None) -> float:
    """us a call of fn (which makes `calls` calls) replayed from a CUDA graph: the median over `replays` replays
    timed one by one, before_each() run ahead of each outside the timed span (an L2 flush, say)."""
    fn()  # compiled and loaded outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        if before_each is not None:
            before_each()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def weight_copies(n: int, k: int, device: torch.device) -> list[torch.Tensor]:
    """Random bf16 weights [n, k] in enough copies (at least two, 300 MB in all) that L2 holds none of them between
    the calls of a replay that walks them in turn."""
    copies = max(2, -(-300_000_000 // (n * k * 2)))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def checked_time(run, weights: list, want: torch.Tensor | None) -> float | None:
    """Seconds a call of run(w) takes over `weights` (copies L2 cannot hold, each called once a replay), or None
    where run does not compile or launch, or where its output on weights[0] is off `want` (None: not checked) by
    more than a rounding moved by another summation order can explain."""
    try:
        got = run(weights[0])
        if want is not None and not torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02):
            return None
        return _graph_time(lambda: [run(w) for w in weights], len(weights))
    except Exception:  # noqa: BLE001 - a configuration that does not compile or launch is not a candidate
        return None


def _graph_time(fn, calls_per_replay: int, replays: int = 20) -> float:
    """Seconds per call of fn (which makes calls_per_replay calls), replayed from a CUDA graph: launch gaps out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / replays / calls_per_replay


# The sweep's configurations, most promising first (a row's share of the budget may end before the last).
# One row (CUDA cores, int32 pairs): a tile of 4096-16384 weights, 16-byte loads along K; num_stages 1 is plain
# register loads (fewest instructions, bench/kernel_sass.py gemv), 2-4 cp.async pipelining.
GEMV_ROW_TILES = [(16, 512, 4), (32, 256, 4), (16, 256, 4), (8, 512, 4), (32, 512, 8), (64, 128, 4), (16, 1024, 8)]
GEMV_ROW_STAGES = (1, 3, 2)
# One row at an output narrower than 8-row blocks fill four waves of (the 2,560-wide projections back to the
# residual: 320 programs on 132 SMs, out_proj's shipped 16 x 1024 tile 160, one SM in five holding two): blocks of
# 4 rows, timed first there, so that every SM gets within a block of the same bytes (640 blocks: 4.85 an SM).
GEMV_NARROW_ROW_TILES = [(4, 1024, 4), (4, 2048, 8), (4, 512, 4), (8, 1024, 8)]
# Several rows (tensor cores): session 7's winners (32 x 128 and 32 x 256, 4 stages) first.
GEMV_MMA_TILES = [(32, 128, 4), (32, 256, 4), (64, 128, 4), (16, 256, 4)]
GEMV_MMA_STAGES = (4, 3)
# Several rows with swap_ab (the weight tile the MMA's M side, so 64-128 weight rows make a wgmma), timed before
# GEMV_MMA_TILES: session 11's unswapped tiles were only level with cuBLAS at 8 and 16 rows.
GEMV_SWAP_TILES = [(64, 128, 4), (128, 128, 4), (64, 256, 4), (128, 64, 4), (128, 128, 8)]
# Stream-K (GemvConfig.stream, session 19): programs a multiprocessor, each the same share of the (block, K tile)
# iterations, for several rows with the swapped tiles (the grid's whole blocks balanced badly at the 4B model's
# several-row shapes: 2.3-3.5 TB/s where lm_head's 3,880 blocks reached 4.35, session 19's sweep). Timed only when
# asked (GEMV_STREAM=1,2): on the H200 it was slower than the shipped grid at all four worst-balanced shapes
# (session 20, bench/stream_k_probe.py), and timed first it took the sweep's budget.
GEMV_STREAM = tuple(int(p) for p in os.environ.get("GEMV_STREAM", "").split(",") if p)
# Up to 8 rows on the CUDA cores (rows_on_cores: the one-row loop, an FFMA a row and weight), timed before the
# tensor-core tiles: those reached only ~3.5 TB/s at 8 rows (session 12). Small tiles, as the accumulator is
# [rows, BLOCK_N, BLOCK_K / 2] (each at most kernels/gemv.py's CORE_ROWS_ACC_REGS a thread at 8 rows: 206-254
# registers in sm_90 SASS, no spills). 3 stages first: with 1 the x tile goes through shared memory for its layout
# every tile (24-32 barriers in the loop), with cp.async it is read from the stage buffer (bench/kernel_sass.py).
GEMV_CORE_ROW_TILES = [(8, 512, 4), (16, 256, 4), (8, 256, 4), (16, 512, 8), (4, 512, 4)]
GEMV_CORE_ROW_STAGES = (3, 1)
# Each batch's share of the budget, cumulative: one row (issue 18's decode) first and most.
GEMV_BATCH_BUDGET = {1: 0.6, 8: 0.8, 16: 1.0}


def gemv_splits(n: int, k: int, block_n: int, block_k: int, sms: int) -> list[int]:
    """Splits over K worth timing for a tile: none, and those that bring the grid to about 1, 2, 4 and 8 programs
    an SM where the output blocks alone fill fewer than 4 (the MLP down projection, 2560 x 9216, is 160 blocks of
    16 rows on 132 SMs). Never 16 or a multiple (Triton would compile num_splits apart as 16-divisible)."""
    blocks, k_tiles = -(-n // block_n), -(-k // block_k)
    splits = {1}
    if blocks < 4 * sms:
        for waves in (1, 2, 4, 8):
            split = max(1, min(k_tiles, round(waves * sms / blocks), 32))
            # as gemv() rounds it: whole tiles a split (7 splits of 18 tiles are 6 of 3)
            split = -(-k_tiles // -(-k_tiles // split))
            splits.add(split - 1 if split % 16 == 0 else split)
    return sorted(splits)


def gemv_prefetches() -> list[int]:
    """GEMV_PREFETCH (a comma list of 1, 2, 4; default "1"): the weight tiles a program loads before its PDL wait
    (GemvConfig.prefetch) that the sweep times each tile with."""
    return parse_prefetches(os.environ.get("GEMV_PREFETCH", "1"), "GEMV_PREFETCH")


def parse_prefetches(text: str, name: str = "ENGINE_SPEED_GEMV_PREFETCH") -> list[int]:
    """A comma list of GemvConfig.prefetch values (1, 2 and 4), sorted; a bad list fails naming `name`."""
    text = text.strip() or "1"
    try:
        values = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        values = []
    if not values or any(p not in (1, 2, 4) for p in values):
        raise ValueError(f"{name}={text!r}: a comma list of 1, 2 and 4")
    return values


def gemv_configs(n: int, k: int, rows: int, sms: int) -> list:
    """The GemvConfigs the sweep times at a shape and row count, most promising first (for several rows the
    stream-K swapped tiles where GEMV_STREAM asks for them, then for up to 8 rows the CUDA-core tiles, then at each stage count the swapped tiles
    and the unswapped ones), each with every prefetch of gemv_prefetches()."""
    prefetches = gemv_prefetches()
    return [dataclasses.replace(config, prefetch=p) for config in _gemv_tiles(n, k, rows, sms) for p in prefetches]


def _gemv_tiles(n: int, k: int, rows: int, sms: int) -> list:
    from headroom.kernels.gemv import CORE_ROWS_MAX, GemvConfig

    def configs(stages, tiles, **fields) -> list:
        return [GemvConfig(bn, bk, split, warps, stage, **fields) for stage in stages for bn, bk, warps in tiles
                for split in gemv_splits(n, k, bn, bk, sms)]

    if rows == 1:
        narrow = configs(GEMV_ROW_STAGES, GEMV_NARROW_ROW_TILES) if -(-n // 8) < 4 * sms else []
        return narrow + configs(GEMV_ROW_STAGES, GEMV_ROW_TILES)
    cores = configs(GEMV_CORE_ROW_STAGES, GEMV_CORE_ROW_TILES, rows_on_cores=True) if rows <= CORE_ROWS_MAX else []
    streamed = [GemvConfig(bn, bk, 1, warps, stage, swap_ab=True, stream=programs) for stage in GEMV_MMA_STAGES
                for bn, bk, warps in GEMV_SWAP_TILES for programs in GEMV_STREAM]
    # Stage by stage, the swapped tiles then the unswapped (session 11's winners, 4 and 3 stages, so they are
    # timed early whatever the budget leaves); stream-K's swapped tiles, when asked, before all of them.
    return streamed + cores + [
        config for stage in GEMV_MMA_STAGES
        for config in configs((stage,), GEMV_SWAP_TILES, swap_ab=True) + configs((stage,), GEMV_MMA_TILES)]


def gemv_batches() -> list[int]:
    """The batches gemv_sweep times: those in GEMV_BATCHES (a comma list: "8,16" sweeps again only the
    tensor-core rows, the table keeping its other batches' entries), else all of GEMV_BATCH_BUDGET's."""
    text = os.environ.get("GEMV_BATCHES", "").strip()
    if not text:
        return list(GEMV_BATCH_BUDGET)
    asked = {int(b) for b in text.split(",") if b.strip()}
    if not asked or asked - set(GEMV_BATCH_BUDGET):
        raise ValueError(f"GEMV_BATCHES={text!r}: a comma list of {sorted(GEMV_BATCH_BUDGET)}")
    return [m for m in GEMV_BATCH_BUDGET if m in asked]


def _batch_spans(batches: list[int]) -> dict[int, tuple[float, float]]:
    """Each swept batch's span of the budget (start, end; fractions): its own GEMV_BATCH_BUDGET share, scaled so
    that the batches swept share the whole budget."""
    own, before = {}, 0.0
    for m, cumulative in GEMV_BATCH_BUDGET.items():
        own[m], before = cumulative - before, cumulative
    total, start, spans = sum(own[m] for m in batches), 0.0, {}
    for m in batches:
        spans[m] = (start, start + own[m] / total)
        start = spans[m][1]
    return spans


def gemv_sweep(budget_s: float = 150.0) -> dict:
    """Per shape and batch (1, 8, 16; GEMV_BATCHES picks some, see gemv_batches): cuBLAS and the best GemvConfig,
    each timed over enough weight copies that L2 (60 MB) holds none of them between calls; GB/s of weight bytes;
    and a decode step's linear time with either choice per shape. Batches run one after another, each shape of a
    batch up to its even share of the batch's part of budget_s (GEMV_BATCH_BUDGET, scaled to the batches swept;
    time a row leaves is the next rows'); each row says how many configurations it timed and how many the budget
    skipped. A fused shape (FUSED_SHAPES) times silu_mul_gemv on a gate|up output against silu_mul then cuBLAS
    ("cublas_us", the two kernels in one graph) and against silu_mul then its plain shape's best GEMV
    ("unfused_gemv_us"), with silu_mul alone beside them."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import GemvConfig, gemv, silu_mul_gemv

    started = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batches = gemv_batches()
    out: dict = {"configs_tried": 0, "configs_skipped": 0, "sms": sms, "batches": batches, "shapes": {}}
    shapes = _sweep_shapes()
    for name, n, k, per_step, kind, replaces in shapes:
        out["shapes"][name] = {"n": n, "k": k, "per_step": per_step, "weight_bytes": n * k * 2, "batches": {}}
        if kind != "x":
            out["shapes"][name].update(input=kind, replaces=replaces)
    for m, (batch_start, share) in _batch_spans(batches).items():
        for index, (name, n, k, _, kind, replaces) in enumerate(shapes):
            deadline = started + budget_s * (batch_start + (share - batch_start) * (index + 1) / len(shapes))
            weights = weight_copies(n, k, torch.device("cuda"))
            copies = len(weights)
            weight_bytes = n * k * 2
            extra: dict = {}
            if kind == "x":
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

                def product(w, config, x=x):
                    return gemv(x, w, config)

                def baseline(w, x=x):
                    return F.linear(x, w)
            else:
                gate, up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16).split([k, k], dim=-1)

                def product(w, config, gate=gate, up=up):
                    return silu_mul_gemv(gate, up, w, config)

                def baseline(w, gate=gate, up=up):
                    return F.linear(silu_mul(gate, up), w)

                extra["silu_mul_us"] = _graph_time(
                    lambda g=gate, u=up, calls=copies: [silu_mul(g, u) for _ in range(calls)], copies) * 1e6
                plain_best = out["shapes"][replaces]["batches"][str(m)]["best_config"]
                if plain_best is not None:
                    config = GemvConfig(**plain_best)
                    extra["unfused_gemv_us"] = _graph_time(
                        lambda g=gate, u=up, c=config, ws=weights: [gemv(silu_mul(g, u), w, c) for w in ws],
                        copies) * 1e6
            want = baseline(weights[0])
            cublas = _graph_time(lambda ws=weights, run=baseline: [run(w) for w in ws], copies)
            best: tuple[float, object] | None = None
            errors = timed = skipped = 0
            for config in gemv_configs(n, k, m, sms):
                if time.perf_counter() > deadline:
                    skipped += 1
                    continue
                seconds = checked_time(lambda w, c=config, run=product: run(w, c), weights, want)
                if seconds is None:
                    errors += 1
                    continue
                timed += 1
                if best is None or seconds < best[0]:
                    best = (seconds, config)
            out["configs_tried"] += timed
            out["configs_skipped"] += skipped
            out["shapes"][name]["batches"][str(m)] = {
                "cublas_us": cublas * 1e6, "cublas_gb_s": weight_bytes / cublas / 1e9,
                "best_us": best[0] * 1e6 if best else None,
                "best_gb_s": weight_bytes / best[0] / 1e9 if best else None,
                "best_config": vars(best[1]) if best else None, "failed_configs": errors, "timed_configs": timed,
                "skipped_configs": skipped, **extra}
            del weights
            torch.cuda.empty_cache()
    for m in batches:
        out[f"step_linear_ms_bs{m}"] = _step_linear_ms(out["shapes"], str(m))
    out["seconds"] = time.perf_counter() - started
    return out



# In-step tuning (step_gemv_tune): the isolated sweep's fastest configurations a shape tried in a graphed step; the
# replays each step is timed over (the median of STEP_TIMINGS runs of STEP_REPLAYS back-to-back replays); the share
# of the step a change must save to replace the configuration before it (session 23's H100 step at batch 1 timed
# the same table 3,388-3,397 us: 0.25% is about three times that spread).
STEP_CANDIDATES = 5
STEP_TIMINGS, STEP_REPLAYS = 5, 50
STEP_MIN_GAIN = 0.0025


def step_gemv_tune(runner, rows: tuple[int, ...] = (1,), budget_s: float = 240.0,
                   candidates: int = STEP_CANDIDATES, out: dict | None = None) -> dict:
    """The GEMV table tuned in the graphed decode step rather than in chains of GEMVs alone. The sweep's isolated
    winners lose microseconds in the step (session 23 on the H100: out_proj's 2560 x 4096 8.4 us in the sweep, 10.8
    in the step; 4-row tiles the sweep ranked lower gained 2.3% a step): what runs before a GEMV (norms, the conv,
    the delta rule, attention) and the PDL hand-off change which tile wins. For each row count, shape by shape,
    most weight traffic a step first, and for the MLP down projection then its fused SwiGLU input (FUSED_SHAPES):
    every configuration the sweep would try (gemv_configs) timed alone on weights L2 cannot hold (one whose output
    is off the unfused path's as the sweep judges is dropped); the `candidates` fastest, the table's own and none
    (cuBLAS for a plain entry, which also serves the normed, residual, conv and gated launches; silu_mul then the
    plain entry for a fused one) each set into the table, a graph of that batch captured with it (runner's model;
    no request may be running) and its replay timed; a candidate replaces the table's own only if its step is
    STEP_MIN_GAIN faster than the table's own, re-timed for each entry, and the entries after are tuned with the
    winner in place. While the plain down projection is tuned its fused entry is set aside (the step would not
    read the plain one). Fills and returns `out` (given, it holds what was done when a part's time limit or an
    error stops the walk): per row count and entry, each candidate's isolated and in-step time; the tuned table
    (every entry, kernels/gemv_tuned_configs.json's fields); per row count, the whole step shipped against tuned,
    timed alternately. budget_s: no new entry is started after it (the skipped ones are listed)."""
    from headroom.engine.runtime.decode_graphs import DecodeGraphs
    from headroom.kernels import gemv
    from headroom.kernels.compile_ahead import CompileAhead, compile_threads, triton_compiles_ahead
    from headroom.kernels.gates_triton import silu_mul

    started = time.perf_counter()
    device = runner.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    shipped = gemv.load_tuned_configs(device)
    table = dict(shipped)
    threads = compile_threads() if triton_compiles_ahead() else 0
    # The candidates of an entry compiled at once on a thread pool (the runner's own is off outside its warm-up).
    compiler = CompileAhead(threads) if threads else None

    def step_us(m: int, timed_table: dict | None = None) -> float:
        gemv._tuned = table if timed_table is None else timed_table
        graphs = DecodeGraphs(runner, m)
        graphs.capture(sizes=(m,))
        times = sorted(graphs.replay_seconds(m, repeats=STEP_REPLAYS) for _ in range(STEP_TIMINGS))
        del graphs
        torch.cuda.empty_cache()
        return times[len(times) // 2] * 1e6

    def alone_us(run, weights: list, want: torch.Tensor | None) -> float | None:
        seconds = checked_time(run, weights, want)
        return None if seconds is None else seconds * 1e6

    def put(key: tuple, config) -> None:
        if config is None:
            table.pop(key, None)
        else:
            table[key] = config

    def dry(product, w, configs) -> None:
        for c in configs:
            try:
                product(w, c)
            except Exception:  # noqa: BLE001 - the timing below says which configurations fail
                pass

    traffic: dict[tuple[int, int], int] = {}  # weight elements a step reads through each shape
    for n, k, per_step in DECODE_SHAPES.values():
        if per_step:
            traffic[(n, k)] = traffic.get((n, k), 0) + per_step * n * k
    fused_kinds = {DECODE_SHAPES[plain][:2]: kind for plain, kind in FUSED_SHAPES.values()}
    entries = [(n, k, kind) for n, k in sorted(traffic, key=lambda shape: -traffic[shape])
               for kind in ("x", fused_kinds.get((n, k))) if kind is not None]
    out = {} if out is None else out
    out.update({"sms": sms, "min_gain": STEP_MIN_GAIN, "compile_threads": threads, "rows": {}, "skipped": []})
    pending: tuple | None = None
    try:
        for m in rows:
            tuned_rows: dict = {"entries": {}}
            out["rows"][str(m)] = tuned_rows
            for n, k, kind in entries:
                if time.perf_counter() - started > budget_s:
                    out["skipped"].append(f"{n}x{k} {kind} at {m} rows")
                    continue
                key = (n, k, m, kind)
                # Tuning a plain shape that has a fused entry here: the fused one aside (back after), or the step
                # would time the fused entry whatever the plain one holds.
                fused_key = (n, k, m, fused_kinds[(n, k)]) if kind == "x" and (n, k) in fused_kinds else None
                aside = table.pop(fused_key, None) if fused_key is not None else None
                current, plain = table.get(key), table.get((n, k, m, "x"))
                pending = (key, current, fused_key, aside)  # what the table holds again if the walk stops here
                weights = weight_copies(n, k, device)
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                gate, up = torch.randn(m, 2 * k, device=device, dtype=torch.bfloat16).split([k, k], dim=-1)
                if kind == "x":
                    def product(w, c, x=x):
                        return gemv.gemv(x, w, c)

                    def unfused(w, x=x):
                        return F.linear(x, w)
                else:
                    def product(w, c, gate=gate, up=up):
                        return gemv.silu_mul_gemv(gate, up, w, c)

                    def unfused(w, gate=gate, up=up, plain=plain):
                        y = silu_mul(gate, up)
                        return gemv.gemv(y, w, plain) if plain is not None else F.linear(y, w)
                configs = step_candidates(gemv_configs(n, k, m, sms), current, m)
                if compiler is not None:
                    compiler.prepare(lambda w=weights[0], configs=configs, product=product: dry(product, w, configs))
                want = unfused(weights[0])
                timed = [(us, config) for config in configs
                         if (us := alone_us(lambda w, c=config, product=product: product(w, c), weights, want))
                         is not None]
                none_alone = alone_us(unfused, weights, None)
                del weights, want
                torch.cuda.empty_cache()
                timed.sort(key=lambda t: t[0])
                alone = {config: us for us, config in timed}
                tried = [current] + [config for _, config in timed if config != current][:candidates]
                if current is not None:
                    tried.append(None)
                steps, best, baseline = [], None, None
                for config in tried:
                    put(key, config)
                    try:
                        us = step_us(m)
                    except Exception as error:  # noqa: BLE001 - kept out of the table, said in the row
                        steps.append({"config": config and vars(config), "error": repr(error)[:300]})
                        continue
                    steps.append({"config": config and vars(config), "step_us": us,
                                  "alone_us": none_alone if config is None else alone.get(config)})
                    if config == current:
                        baseline = us
                    elif baseline is not None and us < baseline * (1 - STEP_MIN_GAIN) and (best is None or us < best[0]):
                        best = (us, config)
                chosen = best[1] if best is not None else current
                put(key, chosen)
                if aside is not None:
                    table[fused_key] = aside
                pending = None
                tuned_rows["entries"][f"{n}x{k} {kind}"] = {
                    "configs_alone": len(timed), "set_aside": vars(aside) if aside is not None else None,
                    "tried": steps, "chosen": chosen and vars(chosen), "step_us": best[0] if best else baseline,
                    "own_step_us": baseline, "changed": chosen != current}
            # Shipped and tuned once more, alternately: the greedy walk's gain against drift over its minutes.
            pairs = [(step_us(m, shipped), step_us(m)) for _ in range(3)]
            tuned_rows["final_pairs_us"] = pairs
            tuned_rows["tuned_over_shipped"] = statistics.median(b / a for a, b in pairs)
    finally:
        gemv._tuned = shipped
        if pending is not None:  # stopped inside an entry: its candidate out, the table's own (and fused one) back
            key, current, fused_key, aside = pending
            put(key, current)
            if aside is not None:
                table[fused_key] = aside
        # What was tuned so far, also when a limit or an error ends the walk early.
        out["table"] = [{"n": n, "k": k, "m": m, "input": kind, **vars(config)}
                        for (n, k, m, kind), config in sorted(table.items())]
        out["seconds"] = time.perf_counter() - started
    return out


def step_candidates(configs: list, current, rows: int) -> list:
    """The sweep's configurations as step_gemv_tune tries them for an entry whose table config is `current` (None:
    no entry): several rows on the grid kernel keep the entry's l2_prefetch. The sweep's configurations ask L2 for
    nothing, yet in the graphed step every 8- and 16-row entry gained with 2 (session 31: batch 8 3.82 against
    3.95 ms a step on an H100), so a tile tried without it would be judged without that gain. One row keeps the
    sweep's 0 (2 cost 5% of batch 1's step, sessions 22 and 31); stream-K has no L2 requests."""
    if rows == 1 or current is None or current.l2_prefetch == 0:
        return configs
    return [config if config.stream else dataclasses.replace(config, l2_prefetch=current.l2_prefetch)
            for config in configs]


def table_variant(shipped: dict, changes: dict[str, dict]) -> dict:
    """A variant of the GEMV table (keys (n, k, m, kind) -> GemvConfig) for part_llm_gemv: changes maps "*" (every
    one-row entry), "NxK" (the one-row entries of that weight shape, plain and SwiGLU input alike), "*@M" (every
    entry of M rows) or "NxK@M" to GemvConfig fields; an entry takes the general key's fields, then its shape's.
    Entries no key names stay as shipped. A key that names no entry (a misspelt shape, "@1", a row count the table
    has no entry for) fails: it would time the shipped table under the variant's name."""
    variant, used = {}, set()
    for key, config in shipped.items():
        n, k, m = key[:3]
        rows = "" if m == 1 else f"@{m}"
        names = [name for name in (f"*{rows}", f"{n}x{k}{rows}") if name in changes]
        used.update(names)
        fields = {field: value for name in names for field, value in changes[name].items()}
        variant[key] = dataclasses.replace(config, **fields) if fields else config
    unused = sorted(set(changes) - used)
    if unused:
        raise ValueError(f"GEMV table variant: {unused} name no entry of the table (entries: "
                         f"{sorted({(n, k, m) for n, k, m, _ in shipped})})")
    return variant


def step_table(tune: dict, previous: list[dict]) -> list[dict]:
    """kernels/gemv_tuned_configs.json's configs for this GPU after a step_gemv_tune: the previous entries (the
    shipped table's for this GPU and Triton version) with each changed one's configuration and "us" (the chosen
    configuration alone) replaced and marked "step_tuned"; an entry the tuning added (a shape cuBLAS ran, a fused
    SwiGLU input) with its layer's name and the time of what it replaced alone ("cublas_us" for a plain entry,
    "unfused_us", silu_mul then the plain entry, for a fused one); the entries whose shape the tuning moved back
    to cuBLAS (or to silu_mul then the plain entry) dropped. Entries of row counts not tuned are kept as they are."""
    from headroom.kernels.gemv import GemvConfig

    fields = [field.name for field in dataclasses.fields(GemvConfig)]
    names = {(n, k, "x"): name for name, (n, k, per_step) in reversed(DECODE_SHAPES.items()) if per_step}
    names.update({(*DECODE_SHAPES[plain][:2], kind): fused for fused, (plain, kind) in FUSED_SHAPES.items()})
    table = [dict(entry) for entry in previous]

    def key_of(entry: dict) -> tuple:
        return entry["n"], entry["k"], entry["m"], entry.get("input", "x")

    for m, tuned in tune.get("rows", {}).items():
        for label, result in tuned["entries"].items():
            if not result["changed"]:
                continue
            shape, kind = label.split()
            n, k = (int(v) for v in shape.split("x"))
            key, chosen = (n, k, int(m), kind), result["chosen"]
            if chosen is None:
                table = [entry for entry in table if key_of(entry) != key]
                continue
            alone = next(row.get("alone_us") for row in result["tried"] if row["config"] == chosen)
            updates = {**{f: chosen[f] for f in fields}, "us": round(alone, 2) if alone else None, "step_tuned": True}
            mine = [entry for entry in table if key_of(entry) == key]
            for entry in mine:
                entry.update(updates)
            if not mine:
                unfused = next((row.get("alone_us") for row in result["tried"] if row["config"] is None), None)
                entry = {"layer": names.get((n, k, kind), shape), "n": n, "k": k, "m": int(m)}
                if kind != "x":
                    entry["input"] = kind
                entry.update(updates)
                entry["cublas_us" if kind == "x" else "unfused_us"] = round(unfused, 2) if unfused else None
                table.append(entry)
    return table


def _step_linear_ms(shapes: dict, m: str) -> dict:
    """A decode step's linear time at batch m: all cuBLAS, and the faster of cuBLAS and the GEMV per shape (the
    plain shapes, as before the fused ones); then with the MLP activation counted: silu_mul + cuBLAS for the
    down projection, and the fastest of that, silu_mul + the GEMV and the fused GEMV."""
    plain = [s for s in shapes.values() if "input" not in s]

    def best(row: dict) -> float:
        return min(row["cublas_us"], row["best_us"] or 1e9)

    out = {"cublas": sum(s["per_step"] * s["batches"][m]["cublas_us"] for s in plain) / 1000,
           "best_of_both": sum(s["per_step"] * best(s["batches"][m]) for s in plain) / 1000}
    out.update(cublas_with_activation=out["cublas"], best_with_activation=out["best_of_both"])
    for fused in (s for s in shapes.values() if "input" in s):
        row, replaced = fused["batches"][m], shapes[fused["replaces"]]["batches"][m]
        out["cublas_with_activation"] += fused["per_step"] * row["silu_mul_us"] / 1000
        fastest = min(row["silu_mul_us"] + best(replaced), row["best_us"] or 1e9)
        out["best_with_activation"] += fused["per_step"] * (fastest - best(replaced)) / 1000
    return out


# A shape goes to the Triton GEMV only if it won by at least this share: smaller differences are within what the
# same kernel varies between runs.
GEMV_MIN_GAIN = 0.03
# Inside a graphed step cuBLAS ran slower than in the sweep's chains (mlp_gate_up at 16 rows 31 against 27.6 us,
# session 16's profile_decode_batches), where the GEMV also overlaps its weight loads with the kernel before it (PDL):
# GEMV_MIN_GAIN=0 in the environment ships every shape the sweep's GEMV won at all, for profile_decode_batches and the
# decode rows to compare step against step.
GEMV_MIN_GAIN_ENV = "GEMV_MIN_GAIN"


def gemv_table(sweep: dict, previous: list[dict] | None = None) -> list[dict]:
    """kernels/gemv_tuned_configs.json's configs for this GPU from a gemv_sweep: the (shape, rows) where the best
    configuration beat cuBLAS by GEMV_MIN_GAIN, with both timings and the whole config (swap_ab and rows_on_cores
    too; the table is written by kernels/tuned_table.py). A fused shape's entry ("input": "silu_mul") must beat what the engine
    runs without it by as much: silu_mul then cuBLAS, or silu_mul then the GEMV where the plain shape has its own
    entry. previous (the shipped table's entries for this GPU and Triton version): those of batches the sweep
    did not time are kept (GEMV_BATCHES="8,16" must not drop the one-row entries); a swept batch's are replaced
    whole, so a shape that no longer wins there goes back to cuBLAS."""
    min_gain = float(os.environ.get(GEMV_MIN_GAIN_ENV, GEMV_MIN_GAIN))

    def wins(row: dict, baseline_us: float) -> bool:
        return row["best_us"] is not None and row["best_us"] <= (1 - min_gain) * baseline_us

    configs = []
    for name, shape in sweep["shapes"].items():
        for m, row in shape["batches"].items():
            baseline, fused = row["cublas_us"], {}
            if "input" in shape:
                fused = {"input": shape["input"]}
                replaced = sweep["shapes"][shape["replaces"]]["batches"][m]
                if wins(replaced, replaced["cublas_us"]) and "unfused_gemv_us" in row:
                    baseline = min(baseline, row["unfused_gemv_us"])
                    fused["unfused_gemv_us"] = round(row["unfused_gemv_us"], 2)
            if wins(row, baseline):
                configs.append({"layer": name, "n": shape["n"], "k": shape["k"], "m": int(m), **fused,
                                **row["best_config"], "us": round(row["best_us"], 2),
                                "cublas_us": round(row["cublas_us"], 2)})
    swept = {int(m) for shape in sweep["shapes"].values() for m in shape["batches"]}
    return [c for c in previous or [] if c["m"] not in swept] + configs


def short_pass_sweep(model: Path, lengths: tuple[int, ...] = (8, 16, 30, 64, 128, 256)) -> dict:
    """Wall time of one lone prefill pass of each length through the LLM API (prefix cache on, no checkpoint
    stops), best of 3 after a warm-up, with the delta rule token by token (RECURRENT_ROWS above the length) and
    through fla (RECURRENT_ROWS 0); also 4 prompts of 30 tokens in one pass, as an interjection runs them."""
    from engine_speed_parts import timed_prompts
    from headroom.engine.layers import linear_attention
    from headroom.engine.llm import LLM

    rng = random.Random(7)
    llm = LLM(str(model), device="cuda", dtype="bfloat16", kv_dtype="bf16", max_total_tokens=40000, ssm_slots=24,
              chunked_prefill_size=8192, context_length=16384, max_running_requests=8)
    default_rows = linear_attention.RECURRENT_ROWS

    def run(lengths_in_pass: list[int]) -> float:
        return timed_prompts(llm, lengths_in_pass, False, rng)

    out: dict = {"default_recurrent_rows": default_rows, "passes_ms": {}}
    try:
        for label, rows in (("recurrent", 1 << 30), ("fla", 0)):
            linear_attention.RECURRENT_ROWS = rows
            for shape in [[n] for n in lengths] + [[30] * 4]:
                key = "x".join(map(str, shape))
                run(shape)
                out["passes_ms"].setdefault(key, {})[label] = min(run(shape) for _ in range(3)) * 1000
    finally:
        linear_attention.RECURRENT_ROWS = default_rows
    return out


def gpu_timeline(prof, min_gap_us: float = 20.0, top: int = 10) -> dict:
    """Where the GPU of a torch profile sat idle: the span from the first kernel's start to the last one's end,
    the time some kernel ran (intervals merged), and the largest gaps with the kernels on either side (a gap
    after a kernel that is followed by host work, a sync or a Python-bound stretch shows as a long one)."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        return {}
    busy, gaps, reach, before = 0.0, [], kernels[0][0], kernels[0][2]
    for start, end, name in kernels:
        if start - reach >= min_gap_us:
            gaps.append((start - reach, before, name))
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, before = end, name
    span = reach - kernels[0][0]
    gaps.sort(reverse=True)
    return {"span_ms": span / 1000, "busy_ms": busy / 1000, "idle_ms": (span - busy) / 1000,
            "gaps_over_min_ms": sum(g for g, _, _ in gaps) / 1000, "num_gaps_over_min": len(gaps),
            "min_gap_us": min_gap_us, "largest_gaps": [{"us": round(g, 1), "after": a[:70], "before": b[:70]}
                                                       for g, a, b in gaps[:top]]}
