"""Launch configurations of the Gated DeltaNet decode step (kernels/gdn_decode.py, issue 18), decided on the GPU.

    source bench/device_env.sh && python3 bench/gdn_decode_sweep.py OUT.json     # H200, from the repo root
    GDN_SWEEP_CPU=1 .venv/bin/python bench/gdn_decode_sweep.py OUT.json        # tiny shapes, Triton interpreter

At the 4B model's shapes (q, k [B, 16, 128] and v [B, 32, 128] strided views of one [B, 8192] conv output, g fp32
and beta bf16 [B, 32], fp32 states [24 layers, 64 slots, 32, 128, 128] as the SSM pool holds them) for batch 1, 8
and 16, every configuration of VARIANTS is checked against naive_gated_delta_decode (output and the whole layer's
states) and timed as the decode graph runs it: a CUDA graph of 24 calls, one a layer, replayed after an L2 flush
("cold_us", what a step sees: the weights stream through L2 between GDN layers) and back to back ("warm_us"), us a
call, launch gaps inside the graph included. The fastest few at batch 1 are then profiled for kernel time alone
("profiled_us", the figure of the engine's profile). Then the short-chunk rows path and the tail kernel, fewer
variants, each twice: "rows"/"tail" with raw q/k normed in the kernel (session 10's inputs: its 80 and 248 us),
and "rows_qk_normed"/"tail_qk_normed" with q/k L2-normed beforehand as the prefill conv writes them (the engine's
path since the conv norms for every prefill pass). "pick" names the best correct configuration per CONFIGS entry
(rows and tail from their qk_normed sections); the JSON is rewritten after every section, and sections stop
starting new configurations once BUDGET_S (GDN_SWEEP_BUDGET_S, default 55 s) has passed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

CPU = os.environ.get("GDN_SWEEP_CPU") == "1"
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the bench's siblings, under PYTHONSAFEPATH too
from decode_parts import graph_replay_us  # noqa: E402
from headroom.kernels import gdn_decode  # noqa: E402
from headroom.kernels.gated_delta import (  # noqa: E402
    naive_gated_delta_decode,
    naive_gated_delta_rule,
    naive_gated_delta_tail,
)
from headroom.kernels.norm import naive_l2_norm  # noqa: E402

DEV = torch.device("cpu" if CPU else "cuda")
# (q/k heads, value heads, key dim, value dim, GDN layers, pool slots, batches)
HK, HV, DK, DV, LAYERS, SLOTS, BATCHES = (2, 4, 16, 32, 3, 6, (1, 3)) if CPU else (16, 32, 128, 128, 24, 64, (1, 8, 16))
BUDGET_S = float(os.environ.get("GDN_SWEEP_BUDGET_S", "55"))
# The short-chunk pass of bench/engine_speed_parts.py's gdn_rows check.
ROWS_LENGTHS = [3, 1, 4] if CPU else [30, 1, 64]
# Widths and warps, at most 128 state elements a thread (256 would spill), at least 4. (Session 10's sweep also ran
# the load order from before issue 18; it lost everywhere and is gone: bench/results/session10/call2.)
VARIANTS = [{"block_v": bv, "num_warps": w} for bv in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8)
            if 4 <= DK * bv // (32 * w) <= 128]
# The rows and tail paths walk up to hundreds of rows a program: narrower blocks (down to 4 columns: with the next
# row's loads in flight during a row's math, a row's time is that math, which a narrower tile shortens), fewer
# variants.
ROW_VARIANTS = [{"block_v": bv, "num_warps": w} for bv in (4, 8, 16, 32) for w in (1, 2, 4)
                if DK * bv // (32 * w) >= 4]
if CPU:  # the interpreter proves the paths run; one variant of each kind is enough
    VARIANTS, ROW_VARIANTS = VARIANTS[:1] + VARIANTS[-3:], ROW_VARIANTS[:2]

started = time.perf_counter()


def over_budget() -> bool:
    return time.perf_counter() - started > BUDGET_S


def name(cfg: dict) -> str:
    return f"bv{cfg['block_v']}_w{cfg['num_warps']}"


def diff(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float(), want.float()
    return {"max_abs": float((got - want).abs().max()), "scale": float(want.abs().max()),
            "finite": bool(got.isfinite().all())}


def correct(out: dict, states: dict) -> bool:
    """Output within a bf16 rounding of the largest value (the fp32 sums run in another order), states within
    fp32 rounding."""
    return (out["finite"] and states["finite"] and out["max_abs"] <= 1e-2 * out["scale"] + 1e-6
            and states["max_abs"] <= 1e-5 * max(1.0, states["scale"]))


def flush_l2(buf: torch.Tensor | None) -> None:
    if buf is not None:
        buf.zero_()


def graph_us(fn, calls: int, flush: torch.Tensor | None, replays: int) -> float:
    """us a call of fn (calls calls), from a CUDA graph replayed `replays` times, the median; L2 flushed before
    each replay (outside the timed span) when flush is given. On the CPU: one eager call's wall time."""
    if CPU:
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e6 / calls
    return graph_replay_us(fn, calls, replays, lambda: flush_l2(flush))


def decode_inputs(batch: int, gen: torch.Generator) -> dict:
    conv = torch.randn(LAYERS, batch, 2 * HK * DK + HV * DV, generator=gen).to(DEV, torch.bfloat16)
    q, k, v = torch.split(conv, [HK * DK, HK * DK, HV * DV], dim=-1)
    return {"q": q.reshape(LAYERS, batch, HK, DK), "k": k.reshape(LAYERS, batch, HK, DK),
            "v": v.reshape(LAYERS, batch, HV, DV), "g": (-torch.rand(LAYERS, batch, HV, generator=gen)).to(DEV),
            "beta": torch.rand(LAYERS, batch, HV, generator=gen).to(DEV, torch.bfloat16),
            "slots": torch.randperm(SLOTS, generator=gen)[:batch].to(DEV)}


def sweep(variants: list[dict], run, want: dict, timing) -> dict:
    """Per configuration: run(cfg) -> the tensors named as in want (the first is the output, the others states),
    each compared with want's; then timing(cfg) -> more fields. Past the budget a configuration is skipped, and
    one that fails (compile, resources) records its error and leaves the others."""
    rows: dict = {}
    for cfg in variants:
        if over_budget():
            rows[name(cfg)] = {"skipped": "budget"}
            continue
        try:
            got = run(cfg)
            row = {"config": cfg, **{key: diff(got[key], want[key]) for key in want}}
            first, *others = want
            row["ok"] = all(correct(row[first], row[key]) for key in others)
            row.update(timing(cfg))
            rows[name(cfg)] = row
        except Exception:  # noqa: BLE001 - one configuration failing leaves the others
            rows[name(cfg)] = {"config": cfg, "error": traceback.format_exc()[-1500:]}
    return rows


def ranked_cold(rows: dict) -> list:
    return [[round(us, 2), n] for us, n in sorted((r["cold_us"], n) for n, r in rows.items() if r.get("ok"))]


def layer_calls(x: dict, pool: torch.Tensor, slots: torch.Tensor, cfg: dict) -> None:
    """One decode step's GDN calls: one a layer, each on its own inputs and its layer's states."""
    for layer in range(LAYERS):
        gdn_decode.gated_delta_decode(x["q"][layer], x["k"][layer], x["v"][layer], x["g"][layer], x["beta"][layer],
                                      pool[layer], slots, config=cfg)


def decode_section(flush: torch.Tensor | None) -> dict:
    gen = torch.Generator().manual_seed(18)
    pool = torch.empty(LAYERS, SLOTS, HV, DK, DV, device=DEV)
    for layer in range(LAYERS):  # on the GPU one layer at a time: a CPU generator for 3 GiB would take minutes
        pool[layer] = torch.randn(SLOTS, HV, DK, DV, device=DEV) * 0.1 if not CPU else \
            torch.randn(SLOTS, HV, DK, DV, generator=gen) * 0.1
    # A sequence's state read and written once a call: 4 MiB at the 4B shapes, 0.87 us at the H200's 4.8 TB/s.
    res: dict = {"state_bytes_read_and_written_per_sequence": 2 * HV * DK * DV * 4, "batches": {}}
    for batch in BATCHES:
        x = decode_inputs(batch, gen)
        layer0 = [x[key][0] for key in ("q", "k", "v", "g", "beta")]
        before = pool[0].clone()
        want_states = before.clone()
        want_out = naive_gated_delta_decode(*layer0, want_states, x["slots"])
        def run(cfg, layer0=layer0, x=x, before=before):
            states = before.clone()
            return {"out": gdn_decode.gated_delta_decode(*layer0, states, x["slots"], config=cfg), "states": states}

        def timing(cfg, x=x, batch=batch):
            def step(cfg=cfg, x=x):
                layer_calls(x, pool, x["slots"], cfg)

            cold = graph_us(step, LAYERS, flush, replays=15)
            return {"cold_us": cold, "warm_us": graph_us(step, LAYERS, None, replays=15) if not CPU else None,
                    "cold_GBps": batch * res["state_bytes_read_and_written_per_sequence"] / cold / 1e3}

        rows = sweep(VARIANTS, run, {"out": want_out, "states": want_states}, timing)
        ranked = ranked_cold(rows)
        res["batches"][str(batch)] = {"ranked_cold_us": ranked, "variants": rows}
        print(f"decode b{batch}: {ranked[:5]}", flush=True)
    return res


def profiled(section: dict, flush: torch.Tensor | None, top: int = 4, replays: int = 5) -> dict:
    """Kernel time alone (torch.profiler's CUDA events, no launch gaps) at batch 1 of the `top` fastest correct
    configurations and the shipped one, cold: us a call."""
    if CPU:
        return {"skipped": "cpu"}
    from torch.profiler import ProfilerActivity, profile

    ranked = [n for _, n in section["batches"]["1"]["ranked_cold_us"]]
    picks = list(dict.fromkeys(ranked[:top] + [name(gdn_decode.CONFIGS["decode_small"])]))
    picks = [n for n in picks if section["batches"]["1"]["variants"].get(n, {}).get("ok")]
    cfgs = {n: section["batches"]["1"]["variants"][n]["config"] for n in picks}
    gen = torch.Generator().manual_seed(1)
    x = decode_inputs(1, gen)
    pool = torch.randn(LAYERS, 2, HV, DK, DV, device=DEV) * 0.1
    slots = torch.tensor([1], device=DEV)
    graphs = {}
    for n, cfg in cfgs.items():
        layer_calls(x, pool, slots, cfg)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer_calls(x, pool, slots, cfg)
        graph.replay()
        graphs[n] = graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for graph in graphs.values():  # in order: the kernels' start times split them by configuration
            for _ in range(replays):
                flush_l2(flush)
                graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.name == "gated_delta_decode_fwd_kernel")
    per = replays * LAYERS
    if len(kernels) != per * len(graphs):
        return {"error": f"{len(kernels)} kernel events for {len(graphs)} configurations x {per} calls"}
    return {n: round(sum(us for _, us in kernels[i * per:(i + 1) * per]) / per, 2) for i, n in enumerate(graphs)}


def normed(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the prefill conv's epilogue writes them: each head L2-normed (fp32, eps inside), in bf16."""
    return naive_l2_norm(q, 1e-6).contiguous(), naive_l2_norm(k, 1e-6).contiguous()


def rows_section(flush: torch.Tensor | None, qk_normed: bool) -> dict:
    """Short chunks token by token from their slots (bounds): the 30 + 1 + 64-row pass, one layer."""
    gen = torch.Generator().manual_seed(7)
    n = sum(ROWS_LENGTHS)
    conv = torch.randn(n, 2 * HK * DK + HV * DV, generator=gen).to(DEV, torch.bfloat16)
    q, k, v = torch.split(conv, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.reshape(n, HK, DK), k.reshape(n, HK, DK), v.reshape(n, HV, DV)
    if qk_normed:
        q, k = normed(q, k)
    g, beta = (-torch.rand(n, HV, generator=gen) * 0.5).to(DEV), torch.rand(n, HV, generator=gen).to(DEV, torch.bfloat16)
    before = (torch.randn(8, HV, DK, DV, generator=gen) * 0.1).to(DEV)
    slots = torch.tensor([5, 0, 2], device=DEV)
    bounds = torch.tensor([0, *torch.tensor(ROWS_LENGTHS).cumsum(0).tolist()], device=DEV)
    want_out, want_states = torch.empty_like(v), before.clone()
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b].item(), bounds[b + 1].item()
        want_out[lo:hi], want_states[slot] = naive_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                                                    beta[lo:hi], before[slot], qk_normed)
    def run(cfg):
        states = before.clone()
        return {"out": gdn_decode.gated_delta_decode(q, k, v, g, beta, states, slots, bounds, qk_normed=qk_normed,
                                                     config=cfg),
                "states": states}

    def timing(cfg):
        states = before.clone()
        return {"cold_us": graph_us(lambda: gdn_decode.gated_delta_decode(q, k, v, g, beta, states, slots, bounds,
                                                                           qk_normed=qk_normed, config=cfg),
                                    1, flush, replays=10)}

    rows = sweep(ROW_VARIANTS, run, {"out": want_out, "states": want_states}, timing)
    return {"lengths": ROWS_LENGTHS, "qk_normed": qk_normed, "ranked_cold_us": ranked_cold(rows), "variants": rows}


def tail_section(flush: torch.Tensor | None, qk_normed: bool) -> dict:
    """The tail launch of in-pass checkpoints: two sequences' last 128 and 200 rows, 2 and 3 snapshots."""
    gen = torch.Generator().manual_seed(8)
    if CPU:
        lo, hi, snaps = [0, 5], [5, 12], [[(2, 1)], [(1, 3), (6, 4)]]
    else:
        lo, hi, snaps = [0, 128], [128, 328], [[(64, 1), (127, 2)], [(1, 3), (72, 4), (199, 5)]]
    n = hi[-1]
    qk = torch.randn(n, 2 * HK, DK, generator=gen).to(DEV, torch.bfloat16)
    q, k = qk[:, :HK], qk[:, HK:]
    if qk_normed:
        q, k = normed(q, k)
    v = torch.randn(n, HV, DV, generator=gen).to(DEV, torch.bfloat16)
    g, beta = (-torch.rand(n, HV, generator=gen) * 0.5).to(DEV), torch.rand(n, HV, generator=gen).to(DEV, torch.bfloat16)
    start = (torch.randn(2, HV, DK, DV, generator=gen) * 0.1).to(DEV)
    want_states, want_pool, want_out = start.clone(), torch.zeros(8, HV, DK, DV, device=DEV), torch.zeros_like(v)
    naive_gated_delta_tail(q, k, v, g, beta, want_states, want_out, want_pool, lo, hi, snaps, qk_normed)
    at = torch.tensor([[a for a, _ in s] + [0] * (3 - len(s)) for s in snaps], dtype=torch.int32, device=DEV)
    slot = torch.tensor([[x for _, x in s] + [0] * (3 - len(s)) for s in snaps], dtype=torch.int32, device=DEV)
    lo_t, hi_t = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in (lo, hi))
    def run(cfg):
        states, pool, out = start.clone(), torch.zeros_like(want_pool), torch.zeros_like(v)
        gdn_decode.gated_delta_tail(q, k, v, g, beta, states, out, pool, lo_t, hi_t, at, slot, qk_normed=qk_normed,
                                    config=cfg)
        return {"out": out, "states": states, "pool": pool}

    def timing(cfg):
        states, pool, out = start.clone(), torch.zeros_like(want_pool), torch.zeros_like(v)
        return {"cold_us": graph_us(lambda: gdn_decode.gated_delta_tail(
            q, k, v, g, beta, states, out, pool, lo_t, hi_t, at, slot, qk_normed=qk_normed, config=cfg), 1, flush,
            replays=10)}

    rows = sweep(ROW_VARIANTS, run, {"out": want_out, "states": want_states, "pool": want_pool}, timing)
    return {"qk_normed": qk_normed, "ranked_cold_us": ranked_cold(rows), "variants": rows}


def picks(report: dict) -> dict:
    """The configuration each CONFIGS entry should hold: decode_small the fastest at batch 1, decode the fastest
    over batches 8 and 16 together (cold us summed), rows and tail their fastest on normed q/k (the engine's
    inputs; on raw ones where that section has none); and the shipped entries."""
    out: dict = {"shipped": gdn_decode.CONFIGS}
    batches = report.get("decode", {}).get("batches", {})
    if batches:
        small = batches[str(BATCHES[0])]["ranked_cold_us"]
        if small:
            out["decode_small"] = batches[str(BATCHES[0])]["variants"][small[0][1]]["config"]
        large = [b for b in map(str, BATCHES[1:]) if b in batches]
        totals = {}
        for n in batches[large[0]]["variants"] if large else []:
            rows = [batches[b]["variants"].get(n, {}) for b in large]
            if all(r.get("ok") for r in rows):
                totals[n] = sum(r["cold_us"] for r in rows)
        if totals:
            best = min(totals, key=totals.get)
            out["decode"] = batches[large[0]]["variants"][best]["config"]
    for kind in ("rows", "tail"):
        section = next((report[key] for key in (kind + "_qk_normed", kind) if report.get(key, {}).get("ranked_cold_us")),
                       None)
        if section:
            out[kind] = section["variants"][section["ranked_cold_us"][0][1]]["config"]
    return out


def main(path: str) -> None:
    torch.manual_seed(0)
    report: dict = {"command": os.environ.get("BENCH_COMMAND", " ".join(sys.argv)), "cpu_interpreter": CPU,
                    "device": "cpu" if CPU else torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "shape": {"hk": HK, "hv": HV, "dk": DK, "dv": DV, "layers": LAYERS,
                                                            "slots": SLOTS, "batches": list(BATCHES)}}
    flush = None if CPU else torch.empty(256 * 2**20, dtype=torch.int8, device=DEV)
    sections = (("decode", lambda: decode_section(flush)), ("profiled_b1_us", lambda: profiled(report["decode"], flush)),
                ("rows", lambda: rows_section(flush, False)), ("rows_qk_normed", lambda: rows_section(flush, True)),
                ("tail", lambda: tail_section(flush, False)), ("tail_qk_normed", lambda: tail_section(flush, True)))
    for key, section in sections:
        began = time.time()
        try:
            report[key] = section()
        except Exception:  # noqa: BLE001
            report[key] = {"error": traceback.format_exc()[-3000:]}
        report[key + "_seconds"] = round(time.time() - began, 1)
        report["pick"] = picks(report)
        print(key, json.dumps(report[key])[:1500], flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    print("pick", json.dumps(report["pick"]), f"{time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gdn_decode_sweep.json")
