"""Helpers of bench/engine_speed.py: pass timing through the LLM API, the roofline table, the GPU checks of
this issue's fused kernels against their naive_* references at the 4B model's sizes, and the engine's bf16
logits (prefill and graphed decode) against an fp32 transformers reference."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
from pathlib import Path

import torch

DEV = torch.device("cuda")


def time_passes(runner) -> list[dict]:
    """Wrap runner.forward; returns the list it appends one record per pass to: decode-only or not, batch,
    graphed, and seconds from the pass's start to the next pass's start (forward, sampling, the loop; with
    overlapped decode, from one step's launch to the next's). The last pass of a run has no next and no seconds."""
    steps: list[dict] = []
    inner = runner.forward
    last: dict = {}

    def forward(items, all_positions=False, **kwargs):
        now = time.perf_counter()
        if "record" in last:
            last["record"]["seconds"] = now - last["start"]
        graphed = runner.decode_graphs is not None and runner.decode_graphs.can_run(items)
        record = {"decode": all(len(i.token_ids) == 1 for i in items), "batch": len(items), "graphed": graphed}
        last.update(record=record, start=now)
        steps.append(record)
        return inner(items, all_positions, **kwargs)

    runner.forward = forward
    return steps


@contextlib.contextmanager
def pdl_off():
    """Programmatic dependent launch off inside (HEADROOM_PDL=0): with it on, a profiled kernel starts before the one
    it follows ends, and its time counts that one's tail (session 20's profile_decode_long had the split merge at
    1.5 ms a step at batch 8)."""
    from headroom.kernels import pdl

    previous = os.environ.get("HEADROOM_PDL")
    os.environ["HEADROOM_PDL"] = "0"
    pdl._supported.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HEADROOM_PDL", None)
        else:
            os.environ["HEADROOM_PDL"] = previous
        pdl._supported.cache_clear()


def kv_bytes_per_token(pool) -> float:
    """Pool bytes per token slot (scales amortised; the residual window of KIVI is not counted)."""
    return pool.nbytes() / pool.num_tokens


def table(state: dict, model: Path, command: str) -> dict:
    """The issue's engine_speed.json: rows with their limits, shares and ratios."""
    from headroom.engine.plan import load_geometry
    from headroom.engine.plan.kv_format import kv_bytes_per_token as planned_kv
    from headroom.engine.plan.kv_format import ssm_slot_bytes

    geometry = load_geometry(model)
    weights = geometry.total_weight_bytes()
    params = weights // 2
    roof = state.get("roofline", {})
    bandwidth, flops = roof.get("hbm_bytes_per_s"), roof.get("bf16_matmul_flops")
    state_rw = 2 * ssm_slot_bytes(geometry)

    def decode_limit(batch: int, context: int, kv: str) -> float | None:
        if not bandwidth:
            return None
        kv_token = state.get("kv_bytes_per_token", {}).get(kv) or planned_kv(geometry, kv)
        step = weights + batch * (context * kv_token + state_rw)
        return batch * bandwidth / step

    limits = {"decode_bs1": decode_limit(1, 288, "bf16"), "decode_bs8": decode_limit(8, 288, "bf16"),
              "decode_bs16": decode_limit(16, 288, "bf16")}
    for kv in ("int2", "bf16"):
        for batch in (1, 8):
            limits[f"{kv}_decode_bs{batch}_32k"] = decode_limit(batch, 32768 + 32, kv)
    for name in ("prefill_8k", "prefill_32k", "int2_prefill_32k", "int2_prefill_128k", "bf16_prefill_128k"):
        limits[name] = flops / (2 * params) if flops else None
    rows = []
    for name, got in state["rows"].items():
        ours, hf, limit = got.get("tok_per_s"), got.get("transformers_tok_per_s"), limits.get(name)
        row = {"name": name, "tok_per_s": ours, "limit_tok_per_s": limit,
               "share_of_limit": ours / limit if ours and limit else None, "transformers_tok_per_s": hf,
               "ratio_to_transformers": ours / hf if ours and hf else None}
        if name == "cold_start_s":
            row["seconds"] = state.get("cold_start_s")
            # A second first start in the same run: empty Triton cache, the shipped fla configs.
            row["seconds_with_shipped_fla_configs"] = state.get("cold_start_tuned_s")
        rows.append(row)
    env = state.get("env", {})
    versions = {"torch": env.get("torch"), "triton": env.get("triton")}
    for package in ("transformers", "fla"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - a missing package is recorded as such
            versions[package] = None
    return {"command": " ; ".join(state.get("commands", [command])), "gpu": env.get("gpu"), "versions": versions,
            "rows": rows}


def steady_stream_rate(streams: list[list[tuple[float, int]]]) -> dict:
    """Tokens per second of B concurrent streams while all of them decode: arrivals (time, tokens) of each
    stream, counted from the last stream's first chunk (its prefill done) to the first stream's last."""
    start = max(s[0][0] for s in streams)
    end = min(s[-1][0] for s in streams)
    tokens = sum(n for s in streams for t, n in s if start < t <= end)
    chunks = sum(1 for s in streams for t, _ in s if start < t <= end)
    return {"window_s": end - start, "tokens": tokens, "chunks": chunks,
            "tok_per_s": tokens / (end - start) if end > start else None}


def _diff(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float(), want.float()
    return {"max_abs": float((got - want).abs().max()), "frac_differing": float((got != want).float().mean()),
            "scale": float(want.abs().max()), "finite": bool(got.isfinite().all())}


def _bench(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def kernel_checks() -> dict:
    """Each fused kernel against its naive_* reference in bf16 at the 4B model's sizes (prefill of 8,192
    tokens, decode of 16 sequences): differences, and ms of both."""
    from headroom.kernels import (
        gates,
        gates_triton,
        norm,
        norm_triton,
        rotary,
        rotary_triton,
    )

    torch.manual_seed(18)
    bf = torch.bfloat16
    out: dict = {}
    n, hidden = 8192, 2560
    x, d = torch.randn(n, hidden, device=DEV, dtype=bf), torch.randn(n, hidden, device=DEV, dtype=bf)
    w = torch.randn(hidden, device=DEV, dtype=bf) * 0.1
    got, summed = norm_triton.rms_norm(x, w, 1e-6, True, delta=d)
    want, want_sum = norm.naive_add_rms_norm(d, x, w, 1e-6, True)
    out["add_rms_norm"] = {"out": _diff(got, want), "sum": _diff(summed, want_sum),
                           "ms": _bench(lambda: norm_triton.rms_norm(x, w, 1e-6, True, delta=d)),
                           "naive_ms": _bench(lambda: norm.naive_add_rms_norm(d, x, w, 1e-6, True))}
    got, _ = norm_triton.rms_norm(x, w, 1e-6, False)
    out["rms_norm_plain"] = {"out": _diff(got, norm.naive_rms_norm(x, w, 1e-6, False))}
    wide = torch.randn(n, 16, 512, device=DEV, dtype=bf)
    q = wide.chunk(2, dim=-1)[0]
    wq = torch.randn(256, device=DEV, dtype=bf) * 0.1
    pos = torch.randint(0, 200000, (n,), device=DEV)
    inv = rotary.rotary_inv_freq(64, 1e7).to(DEV)
    out["rms_norm_rotary"] = {
        "out": _diff(rotary_triton.rms_norm_rotary(q, wq, 1e-6, True, pos, inv), rotary.naive_rms_norm_rotary(q, wq, 1e-6, True, pos, inv)),
        "ms": _bench(lambda: rotary_triton.rms_norm_rotary(q, wq, 1e-6, True, pos, inv)),
        "naive_ms": _bench(lambda: rotary.naive_rms_norm_rotary(q, wq, 1e-6, True, pos, inv))}
    # The attention layer's q/k norms, rotary and both bf16 pool row stores in one launch (4B shapes: 16 q heads,
    # 4 kv heads, a fused q|gate|k|v projection viewed in place), against the naive ops and index stores.
    fused = torch.randn(n, (32 + 8) * 256, device=DEV, dtype=bf)
    fq = fused[:, : 32 * 256].view(n, 16, 512)[..., :256]
    fk, fv = fused[:, 32 * 256 : 36 * 256].view(n, 4, 256), fused[:, 36 * 256 :].view(n, 4, 256)
    wk = torch.randn(256, device=DEV, dtype=bf) * 0.1
    rows = torch.randperm(4 * n, device=DEV)[:n]
    pools = [torch.zeros(4 * n, 4, 256, device=DEV, dtype=bf) for _ in range(4)]
    got = rotary_triton.qk_norm_rotary_store(fq, fk, fv, wq, wk, 1e-6, True, pos, inv, pools[0], pools[1], rows)
    want = rotary.naive_qk_norm_rotary_store(fq, fk, fv, wq, wk, 1e-6, True, pos, inv, pools[2], pools[3], rows)
    out["qk_norm_rotary_store"] = {
        "q": _diff(got[0], want[0]), "k": _diff(got[1], want[1]), "pool_k": _diff(pools[0], pools[2]),
        "pool_v": _diff(pools[1], pools[3]),
        "ms": _bench(lambda: rotary_triton.qk_norm_rotary_store(fq, fk, fv, wq, wk, 1e-6, True, pos, inv, pools[0],
                                                               pools[1], rows)),
        "unfused_ms": _bench(lambda: (rotary_triton.rms_norm_rotary(fq, wq, 1e-6, True, pos, inv),
                                      pools[0].index_put_((rows,), rotary_triton.rms_norm_rotary(fk, wk, 1e-6, True, pos, inv)),
                                      pools[1].index_put_((rows,), fv)))}
    # 8 channels a thread, 16-byte accesses: another order of the rstd sums (not bit-equal to the default tile).
    wide_tile = rotary_triton.qk_norm_rotary_store(fq, fk, fv, wq, wk, 1e-6, True, pos, inv, pools[0], pools[1], rows,
                                                   config=(4, 1))
    out["qk_norm_rotary_store"]["tile_4x1"] = {
        "q_vs_default": _diff(wide_tile[0], got[0]), "q": _diff(wide_tile[0], want[0]),
        "ms": _bench(lambda: rotary_triton.qk_norm_rotary_store(fq, fk, fv, wq, wk, 1e-6, True, pos, inv, pools[0],
                                                               pools[1], rows, config=(4, 1)))}
    qk = torch.randn(n, 16, 256, device=DEV, dtype=bf)[..., :128]  # GDN q heads cut from a wider q|k
    from fla.modules.norm.l2norm import l2norm_fwd

    out["l2_norm"] = {"out": _diff(norm_triton.l2_norm(qk, 1e-6), norm.naive_l2_norm(qk, 1e-6)),
                      "vs_fla_l2norm": _diff(norm_triton.l2_norm(qk, 1e-6), l2norm_fwd(qk.contiguous(), 1e-6)[0]),
                      "ms": _bench(lambda: norm_triton.l2_norm(qk, 1e-6)),
                      "naive_ms": _bench(lambda: norm.naive_l2_norm(qk, 1e-6))}
    core, z = torch.randn(n, 32, 128, device=DEV, dtype=bf), torch.randn(n, 32, 128, device=DEV, dtype=bf)
    wg = torch.randn(128, device=DEV, dtype=bf)
    out["gated_rms_norm"] = {"out": _diff(norm_triton.gated_rms_norm(core, z, wg, 1e-6), norm.naive_gated_rms_norm(core, z, wg, 1e-6)),
                             "ms": _bench(lambda: norm_triton.gated_rms_norm(core, z, wg, 1e-6)),
                             "naive_ms": _bench(lambda: norm.naive_gated_rms_norm(core, z, wg, 1e-6))}
    g, u = torch.randn(n, 9216, device=DEV, dtype=bf), torch.randn(n, 9216, device=DEV, dtype=bf)
    out["silu_mul"] = {"out": _diff(gates_triton.silu_mul(g, u), gates.naive_silu_mul(g, u)),
                       "ms": _bench(lambda: gates_triton.silu_mul(g, u)), "naive_ms": _bench(lambda: gates.naive_silu_mul(g, u))}
    attn, gate = torch.randn(n, 4096, device=DEV, dtype=bf), wide.chunk(2, dim=-1)[1]
    out["sigmoid_mul"] = {"out": _diff(gates_triton.sigmoid_mul(attn, gate), gates.naive_sigmoid_mul(attn, gate)),
                          "ms": _bench(lambda: gates_triton.sigmoid_mul(attn, gate)),
                          "naive_ms": _bench(lambda: gates.naive_sigmoid_mul(attn, gate))}
    b, a = torch.randn(n, 32, device=DEV, dtype=bf) * 4, torch.randn(n, 32, device=DEV, dtype=bf) * 8
    neg_a, dt = -torch.rand(32, device=DEV) * 8, torch.randn(32, device=DEV, dtype=bf)
    got_b, got_g = gates_triton.gdn_gates(b, a, neg_a, dt)
    want_b, want_g = gates.naive_gdn_gates(b, a, neg_a, dt)
    out["gdn_gates"] = {"beta": _diff(got_b, want_b), "g": _diff(got_g, want_g),
                        "ms": _bench(lambda: gates_triton.gdn_gates(b, a, neg_a, dt)),
                        "naive_ms": _bench(lambda: gates.naive_gdn_gates(b, a, neg_a, dt))}
    for batch in (1, 16):
        out[f"gdn_decode_b{batch}"] = _gdn_decode_check(batch)
    out["merge_splits"] = _merge_check()
    out["conv_varlen"] = _conv_varlen_check()
    out["gdn_tail"] = _gdn_tail_check()
    out["gdn_rows"] = _gdn_rows_check()
    out["gemv"] = _gemv_check()
    out["fused_residual_gemv"] = _fused_residual_gemv_check()
    out["conv_gemv"] = _conv_gemv_check()
    out["dense_attention"] = _dense_attention_check()
    out["fla_chunk_index"] = _fla_chunk_index_check()
    return out


def _fla_chunk_index_check() -> dict:
    """kernels/gdn_fla.py's chunk_index (built on the host, uploaded without a stream sync) against fla's own
    prepare_chunk_indices, and a varlen call with it against one that lets fla build the index from the device
    bounds: the outputs and final states must be the same bits."""
    from fla.ops.utils.index import prepare_chunk_indices
    from headroom.kernels.gdn_fla import chunk_index, gated_delta_rule_varlen

    out: dict = {"equal_to_fla": all(
        torch.equal(chunk_index(b).to(DEV), prepare_chunk_indices(torch.tensor(b, device=DEV), 64))
        for b in ([0, 64, 65, 65, 200], [0, 8192], [0, 1, 2, 3], [0, 100, 8292, 8300]))}
    bounds = [0, 3000, 3001, 8192]
    n, bf = bounds[-1], torch.bfloat16
    q, k = (torch.nn.functional.normalize(torch.randn(n, 16, 128, device=DEV), dim=-1).to(bf) for _ in range(2))
    v, g = torch.randn(n, 32, 128, device=DEV, dtype=bf), -torch.rand(n, 32, device=DEV)
    beta, states = torch.rand(n, 32, device=DEV, dtype=bf), torch.randn(3, 32, 128, 128, device=DEV) * 0.1
    cu = torch.tensor(bounds, device=DEV)
    ours = gated_delta_rule_varlen(q, k, v, g, beta, states, cu, is_decode=False, cu_seqlens_cpu=cu.cpu(), qk_normed=True)
    fla = gated_delta_rule_varlen(q, k, v, g, beta, states, cu, is_decode=False, qk_normed=True)
    out["out_same_bits"] = bool(torch.equal(ours[0], fla[0]))
    out["final_same_bits"] = bool(torch.equal(ours[1], fla[1]))
    return out


def _dense_attention_check() -> dict:
    """kernels/dense_attention.py (cuDNN) against naive_dense_attention in fp32 on the same bf16 operands, at the
    4B model's heads: a causal block of 3,000 rows (padded to the query bucket) and 2,048 rows over a whole
    prefix block; beside the paged Triton kernel's error on the same causal block, and ms of both."""
    import gpu_kernels
    from headroom.kernels import dense_attention as dense
    from headroom.kernels.paged_kv import PagedKV

    hq, hkv, d = gpu_kernels.HQ, gpu_kernels.HKV, gpu_kernels.D
    gen = torch.Generator(device=DEV).manual_seed(3)
    out: dict = {"available": dense.available(torch.empty(1, hq, d, device=DEV, dtype=torch.bfloat16), hkv)}
    if not out["available"]:
        return out
    for name, rows, keys, causal in (("causal_3000", 3000, 3000, True), ("prefix_2048x8192", 2048, dense.PREFIX_BLOCK, False)):
        q = torch.randn(rows, hq, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(keys, hkv, d, device=DEV, dtype=torch.bfloat16, generator=gen) * 2
        v = torch.randn(keys, hkv, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        got, got_lse = dense.dense_attention(q, k, v, causal, d**-0.5)
        want, want_lse = dense.naive_dense_attention(q.float(), k.float(), v.float(), causal, d**-0.5)
        case = {"out": _diff(got, want), "lse": _diff(got_lse, want_lse),
                "ms": _bench(lambda q=q, k=k, v=v, causal=causal: dense.dense_attention(q, k, v, causal, d**-0.5))}
        if causal:
            kv = PagedKV("dense", k, v)
            table = torch.arange(keys, device=DEV, dtype=torch.int32)[None]
            args = (q, torch.arange(rows, device=DEV), torch.tensor([0, rows], device=DEV, dtype=torch.int32), table,
                    torch.zeros(1, device=DEV, dtype=torch.int32), torch.tensor([keys], device=DEV, dtype=torch.int32),
                    kv, d**-0.5)
            from headroom.kernels import ops

            paged, paged_lse = ops.paged_attention(*args, max_q_len=rows)
            case["paged_kernel_out"] = _diff(paged, want)
            case["paged_kernel_lse"] = _diff(paged_lse, want_lse)
            case["paged_kernel_ms"] = _bench(lambda args=args, rows=rows: ops.paged_attention(*args, max_q_len=rows))
        out[name] = case
    out["merge_8192"] = _merge_pair_check(8192, hq, d, gen)
    return out


def _merge_pair_check(rows: int, heads: int, dim: int, gen: torch.Generator) -> dict:
    """dense_attention.merge (one Triton launch) against merge_two in fp32 at a full chunk: cuDNN's strided bf16
    output merged with a bf16 piece into fp32 and into bf16; ms of both."""
    from headroom.kernels import dense_attention as dense
    from headroom.kernels.attention_merge import merge_two

    a = torch.randn(heads, rows, dim, device=DEV, dtype=torch.bfloat16, generator=gen).transpose(0, 1)
    b = torch.randn(rows, heads, dim, device=DEV, dtype=torch.bfloat16, generator=gen)
    a_lse = torch.randn(rows, heads, device=DEV, generator=gen) * 4
    b_lse = torch.randn(rows, heads, device=DEV, generator=gen) * 4
    want, want_lse = merge_two(a.float(), a_lse, b.float(), b_lse)
    acc, acc_lse = torch.empty(rows, heads, dim, device=DEV), torch.empty_like(a_lse)
    dense.merge(a, a_lse, b, b_lse, acc, acc_lse)
    into_bf16 = torch.empty_like(b)
    dense.merge(a, a_lse, b, b_lse, into_bf16, torch.empty_like(a_lse))
    return {"fp32": _diff(acc, want), "lse": _diff(acc_lse, want_lse), "bf16": _diff(into_bf16, want),
            "ms": _bench(lambda: dense.merge(a, a_lse, b, b_lse, acc, acc_lse)),
            "merge_two_ms": _bench(lambda: merge_two(a.float(), a_lse, b.float(), b_lse))}


def _gemv_check() -> list[dict]:
    """Every (shape, rows, input) the shipped GEMV table runs on this GPU: the Triton GEMV and cuBLAS (bf16
    F.linear) each against fp32 math on the same bf16 operands, so the GEMV's error sits beside cuBLAS's own. A
    fused down projection ("silu_mul" input) against fp32 silu(gate) * up @ w.T, beside silu_mul + cuBLAS, and
    against silu_mul + the same GEMV configuration, which it should equal bit for bit (the activation rounded
    as silu_mul rounds it). SwiGLU's gate|up epilogue (swiglu_gemv) against silu_mul of the GEMV's pairs, likewise."""
    import torch.nn.functional as F
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import SILU_MUL_INPUT, gemv, load_tuned_configs, silu_mul_gemv, swiglu_gemv

    rows = []
    for (n, k, m, kind), config in sorted(load_tuned_configs(DEV).items()):
        w = (torch.randn(n, k, device=DEV) * 0.02).bfloat16()
        if kind == SILU_MUL_INPUT:
            gate, up = torch.randn(m, 2 * k, device=DEV).bfloat16().split([k, k], dim=-1)
            want = (F.silu(gate.float()) * up.float()) @ w.float().t()
            got = silu_mul_gemv(gate, up, w, config)
            rows.append({"n": n, "k": k, "m": m, "input": kind, "gemv": _diff(got, want),
                         "cublas": _diff(F.linear(silu_mul(gate, up), w), want),
                         "vs_silu_mul_then_gemv": _diff(got, gemv(silu_mul(gate, up), w, config))})
            continue
        x = torch.randn(m, k, device=DEV).bfloat16()
        want = x.float() @ w.float().t()
        row = {"n": n, "k": k, "m": m, "gemv": _diff(gemv(x, w, config), want), "cublas": _diff(F.linear(x, w), want)}
        if n % 2 == 0 and config.block_n % 2 == 0:
            # SwiGLU's epilogue (the weight's rows read as interleaved gate / up pairs) against silu_mul of the same
            # GEMV's pairs, equal bit for bit
            pairs = gemv(x, w, config)
            row["swiglu_vs_gemv_then_silu_mul"] = _diff(swiglu_gemv(x, w, config),
                                                        silu_mul(pairs[:, 0::2], pairs[:, 1::2]))
        rows.append(row)
    return rows


def _fused_residual_gemv_check(hidden: int = 2560) -> list[dict]:
    """The decode GEMVs with the residual add behind (residual_gemv: the out/down projections, [*, hidden] out)
    and the RMSNorm in front (normed_gemv: the projections reading the hidden rows) at every (shape, rows) of the
    shipped table they run at: residual_gemv against residual + the same GEMV (equal bit for bit: the product is
    rounded, then the add, as there) and its sums of squares against fp32's, also with Gated DeltaNet's output
    norm in front (against gated_rms_norm's kernel then the GEMV, and fp32); normed_gemv, with those sums,
    against fp32 math on the fp32-normed rows beside the unfused path (norm_triton's rms_norm, then the GEMV).
    With the next norm's weight applied in the epilogue (residual_prescaled_gemv, every entry of several rows): the
    sum and its sums against residual_gemv's and the prescaled rows against r * (1 + g) in fp32 rounded once (all
    equal bit for bit expected); and the GEMVs reading such rows (normed_gemv with a prescaled RowNorm, its output
    rows scaled by 1 / rms; swiglu_gemv so too) against the same fp32 math, beside the unfused path."""
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import (
        SILU_MUL_INPUT,
        GatedNorm,
        NextNorm,
        RowNorm,
        gated_gemv_fits,
        gemv,
        load_tuned_configs,
        naive_gated_gemv,
        normed_gemv,
        residual_gemv,
        residual_prescaled_gemv,
        silu_mul_gemv,
        swiglu_gemv,
    )
    from headroom.kernels.norm_triton import gated_rms_norm, rms_norm

    head = 128  # the 4B model's value heads

    rows = []
    for (n, k, m, kind), config in sorted(load_tuned_configs(DEV).items()):
        w = (torch.randn(n, k, device=DEV) * 0.02).bfloat16()
        if n == hidden:
            residual = (torch.randn(m, n, device=DEV) * 4).bfloat16()
            if kind == SILU_MUL_INPUT:
                gate, up = torch.randn(m, 2 * k, device=DEV).bfloat16().split([k, k], dim=-1)
                summed, sumsq = residual_gemv(gate, w, residual, config, up=up)
                product = silu_mul_gemv(gate, up, w, config)
            else:
                x = torch.randn(m, k, device=DEV).bfloat16()
                summed, sumsq = residual_gemv(x, w, residual, config)
                product = gemv(x, w, config)
            rows.append({"n": n, "k": k, "m": m, "input": kind, "residual_gemv": _diff(summed, residual + product),
                         "sums_of_squares": _diff(sumsq.sum(-1), summed.float().pow(2).sum(-1))})
            if m > 1:
                following = NextNorm((0.1 * torch.randn(n, device=DEV)).bfloat16(), True)
                a, b = (gate, up) if kind == SILU_MUL_INPUT else (x, None)
                pre_summed, pre_sumsq, scaled = residual_prescaled_gemv(a, w, residual, following, config, up=b)
                rows[-1].update({"prescaled_sum_vs_residual_gemv": _diff(pre_summed, summed),
                                 "prescaled_sums_vs_residual_gemv": _diff(pre_sumsq, sumsq),
                                 # (rounded once as the kernel rounds: equal bit for bit expected)
                                 "prescaled_rows": _diff(scaled, (summed.float() * (1 + following.weight.float()))
                                                         .bfloat16())})
            if kind != SILU_MUL_INPUT and gated_gemv_fits(k, head, config):
                # Gated DeltaNet's out-projection (the attention o_proj's shape): its output norm in front too
                core, z = torch.randn(m, k, device=DEV).bfloat16(), torch.randn(m, k + 64, device=DEV).bfloat16()
                gated = GatedNorm(z[:, 64:], (1 + 0.1 * torch.randn(head, device=DEV)).bfloat16(), 1e-6)
                summed, sumsq = residual_gemv(core, w, residual, config, gated=gated)
                normed = gated_rms_norm(core.view(m, -1, head), gated.gate.view(m, -1, head), gated.weight, 1e-6)
                rows.append({"n": n, "k": k, "m": m, "input": "gated", "residual_gemv": _diff(
                    summed, residual + gemv(normed.reshape(m, k), w, config)),
                    "vs_fp32": _diff(summed, residual.float() + naive_gated_gemv(
                        core.float(), GatedNorm(gated.gate.float(), gated.weight.float(), 1e-6), w.float()))})
        if k == hidden and kind != SILU_MUL_INPUT:
            x = (torch.randn(m, k, device=DEV) * 4).bfloat16()
            weight = (0.1 * torch.randn(k, device=DEV)).bfloat16()  # Qwen3.5's: (1 + weight) * x
            # the sums as a residual_gemv with 16-column blocks leaves them
            norm = RowNorm(x.float().pow(2).view(m, -1, 16).sum(-1).contiguous(), weight, 1e-6, True)
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.float())
            want = normed @ w.float().t()
            got = normed_gemv(x, norm, w, config)
            unfused = gemv(rms_norm(x, weight, 1e-6, True)[0], w, config)
            rows.append({"n": n, "k": k, "m": m, "normed_gemv": _diff(got, want), "unfused": _diff(unfused, want),
                         "vs_unfused": _diff(got, unfused)})
            if m > 1:
                # the rows as residual_prescaled_gemv leaves them: the weight applied, 1 / rms in the output rows
                scaled = (x.float() * (1 + weight.float())).bfloat16()
                prescaled = RowNorm(norm.sumsq, weight, 1e-6, True, prescaled=True)
                got = normed_gemv(scaled, prescaled, w, config)
                rows[-1].update({"prescaled_normed_gemv": _diff(got, want), "prescaled_vs_unfused": _diff(got, unfused)})
                if n % 2 == 0 and config.block_n % 2 == 0:
                    rows[-1]["prescaled_swiglu_vs_silu_mul"] = _diff(swiglu_gemv(scaled, w, config, prescaled),
                                                                     silu_mul(got[:, 0::2], got[:, 1::2]))
    return rows


def _conv_gemv_check(conv_channels: int = 8192, taps: int = 4) -> list[dict]:
    """Gated DeltaNet's in-projection with its decode conv in the epilogue (conv_gemv, the 4B model's q|k|v: the
    first 8,192 of 12,352 columns) at every row count the shipped table has that shape for, against the GEMV and
    then conv_update's kernel on its stored output (equal bit for bit expected: the same step on the same bf16
    values), output and rolled states; also with the layer's RMSNorm in front (normed_gemv then the kernel), and
    the time of each (the states reset before every call would cost more than the step: they roll on)."""
    from headroom.kernels.conv_update import causal_conv1d_update
    from headroom.kernels.gemv import (
        PLAIN_INPUT,
        ConvStep,
        RowNorm,
        conv_gemv,
        gemv,
        load_tuned_configs,
        normed_gemv,
    )

    rows = []
    for (n, k, m, kind), config in sorted(load_tuned_configs(DEV).items()):
        if kind != PLAIN_INPUT or n < conv_channels + 4096 or n > 2 * conv_channels:
            continue  # the in-projection's shapes only (q|k|v|z|b|a), not lm_head or the MLP
        w = (torch.randn(n, k, device=DEV) * 0.02).bfloat16()
        x = torch.randn(m, k, device=DEV).bfloat16()
        weight = torch.randn(conv_channels, 1, taps, device=DEV).bfloat16()[:, 0, :]
        states = torch.randn(48, conv_channels, taps - 1, device=DEV).bfloat16()
        slots = torch.randperm(48, device=DEV)[:m].to(torch.int32)
        norm = RowNorm(x.float().pow(2).view(m, -1, 16).sum(-1).contiguous(),
                       (0.1 * torch.randn(k, device=DEV)).bfloat16(), 1e-6, True)
        for normed in (False, True):
            given = norm if normed else None
            fused_states, apart_states = states.clone(), states.clone()
            fused = functools.partial(conv_gemv, x, w, ConvStep(weight, fused_states, slots), config, given)
            project = functools.partial(normed_gemv, x, norm, w, config) if normed \
                else functools.partial(gemv, x, w, config)
            got = fused()
            want = project()
            want[:, :conv_channels] = causal_conv1d_update(want[:, :conv_channels].contiguous(), weight,
                                                           apart_states, slots)
            apart = functools.partial(_project_then_convolve, project, weight, apart_states, slots)
            rows.append({"n": n, "k": k, "m": m, "normed": normed, "output": _diff(got, want),
                         "states": _diff(fused_states, apart_states), "ms": _bench(fused),
                         "apart_ms": _bench(apart)})
    return rows


def _project_then_convolve(project, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from headroom.kernels.conv_update import causal_conv1d_update

    y = project()
    return causal_conv1d_update(y[:, :weight.shape[0]], weight, states, slots)


def _gdn_rows_check() -> dict:
    """Short chunks token by token from their pool slots (gated_delta_decode with bounds; 4B sizes, bf16 pool):
    three sequences of 30, 1 and 64 rows against naive_gated_delta_rule per sequence."""
    from headroom.kernels.gated_delta import naive_gated_delta_rule
    from headroom.kernels.gdn_decode import gated_delta_decode

    bf = torch.bfloat16
    lengths = [30, 1, 64]
    n = sum(lengths)
    qk = torch.randn(n, 32, 128, device=DEV, dtype=bf)
    q, k = qk[:, :16], qk[:, 16:]
    v = torch.randn(n, 32, 128, device=DEV, dtype=bf)
    g, beta = -torch.rand(n, 32, device=DEV) * 0.5, torch.rand(n, 32, device=DEV, dtype=bf)
    pool = (torch.randn(8, 32, 128, 128, device=DEV) * 0.1).to(bf)
    slots = torch.tensor([5, 0, 2], device=DEV)
    bounds = torch.tensor([0, 30, 31, 95], device=DEV)
    before = pool.clone()
    got = gated_delta_decode(q, k, v, g, beta, pool, slots, bounds)
    outs, states = [], []
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b].item(), bounds[b + 1].item()
        out, final = naive_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], before[slot])
        outs.append(out)
        states.append(final.to(bf))
    return {"out": _diff(got, torch.cat(outs)), "states": _diff(pool[slots], torch.stack(states)),
            "ms": _bench(lambda: gated_delta_decode(q, k, v, g, beta, before.clone(), slots, bounds))}


def _gdn_tail_check() -> dict:
    """The tail launch of in-pass checkpoints (4B sizes: 16 q/k heads, 32 value heads, 128 x 128 states): two
    sequences' last 128 and 200 rows with 2 and 3 snapshots, against naive_gated_delta_tail."""
    from headroom.kernels.gated_delta import naive_gated_delta_tail
    from headroom.kernels.gdn_decode import gated_delta_tail

    bf = torch.bfloat16
    n = 328
    qk = torch.randn(n, 32, 128, device=DEV, dtype=bf)
    q, k = qk[:, :16], qk[:, 16:]
    v = torch.randn(n, 32, 128, device=DEV, dtype=bf)
    g, beta = -torch.rand(n, 32, device=DEV) * 0.5, torch.rand(n, 32, device=DEV, dtype=bf)
    states = torch.randn(2, 32, 128, 128, device=DEV) * 0.1
    pool = torch.zeros(8, 32, 128, 128, device=DEV)
    lo, hi, snaps = [0, 128], [128, 328], [[(64, 1), (127, 2)], [(1, 3), (72, 4), (199, 5)]]
    want_states, want_pool, want_out = states.clone(), pool.clone(), torch.zeros_like(v)
    naive_gated_delta_tail(q, k, v, g, beta, want_states, want_out, want_pool, lo, hi, snaps)
    at = torch.tensor([[a for a, _ in s] + [0] * (3 - len(s)) for s in snaps], dtype=torch.int32, device=DEV)
    slot = torch.tensor([[x for _, x in s] + [0] * (3 - len(s)) for s in snaps], dtype=torch.int32, device=DEV)
    lo_t, hi_t = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in (lo, hi))
    got_states, got_out = states.clone(), torch.zeros_like(v)
    gated_delta_tail(q, k, v, g, beta, got_states, got_out, pool, lo_t, hi_t, at, slot)
    return {"out": _diff(got_out, want_out), "states": _diff(got_states, want_states), "pool": _diff(pool, want_pool),
            "ms": _bench(lambda: gated_delta_tail(q, k, v, g, beta, states.clone(), torch.zeros_like(v), pool.clone(),
                                                 lo_t, hi_t, at, slot))}


def _conv_varlen_check() -> dict:
    """The prefill conv of three sequences (8,000 + 190 + 2 tokens, 4B channels) against the per-sequence reference."""
    from headroom.kernels.conv import naive_causal_conv1d_varlen
    from headroom.kernels.conv_varlen import causal_conv1d_varlen

    bf = torch.bfloat16
    lengths, channels = [8000, 190, 2], 8192
    x = torch.randn(sum(lengths), channels, device=DEV, dtype=bf)
    w = torch.randn(channels, 4, device=DEV, dtype=bf) * 0.5
    states = torch.randn(8, channels, 3, device=DEV, dtype=bf)
    slots = torch.tensor([6, 1, 3], device=DEV)
    cu = torch.tensor([0, 8000, 8190, 8192], device=DEV)
    ref_states = states.clone()
    want = naive_causal_conv1d_varlen(x, w, ref_states, slots, lengths)
    got = causal_conv1d_varlen(x, w, states, slots, cu, max(lengths))
    return {"out": _diff(got, want), "states": _diff(states, ref_states),
            "ms": _bench(lambda: causal_conv1d_varlen(x, w, states.clone(), slots, cu, max(lengths))),
            "naive_ms": _bench(lambda: naive_causal_conv1d_varlen(x, w, states.clone(), slots, lengths))}


def capture_check(model: Path) -> dict:
    """In-pass checkpoints on the GPU (bf16, the 4B-shaped model): a 3,000-token chunk with captures at
    64, 1,472 and 2,999 against runs that stopped there: max |difference| of every GDN layer's conv and
    recurrent state, beside their scale, and of the chunk's logits against a pass without captures."""
    from headroom.engine.config import EngineConfig
    from headroom.engine.runtime.forward_batch import BatchItem
    from headroom.engine.runtime.model_runner import ModelRunner
    from headroom.engine.sequence import Sequence

    runner = ModelRunner(EngineConfig(model_path=str(model), device="cuda", dtype="bfloat16", kv_dtype="bf16",
                                      max_total_tokens=16384, ssm_slots=12, context_length=4096,
                                      max_running_requests=4, cuda_graph_max_batch=0))
    ids = [random.Random(9).randrange(1000, 200000) for _ in range(3000)]

    def sequence(name: str) -> Sequence:
        seq = Sequence(name, list(ids))
        seq.kv_slots = runner.kv_allocator.alloc(len(ids)) or []
        seq.ssm_slot = runner.ssm_pool.alloc()
        return seq

    def state(slot: int) -> list[torch.Tensor]:
        return [t[slot].float() for layers in (runner.ssm_pool.conv, runner.ssm_pool.recurrent) for t in layers]

    at = (64, 1472, 2999)
    captured = sequence("captured")
    slots = [runner.ssm_pool.alloc() for _ in at]
    logits = runner.forward([BatchItem(captured, ids, tuple(zip(at, slots, strict=True)))]).float()
    out: dict = {"logits_vs_no_captures": _diff(logits, runner.forward([BatchItem(sequence("plain"), ids)]).float())}
    for position, slot in zip(at, slots, strict=True):
        stopped = sequence(f"stopped-{position}")
        runner.forward([BatchItem(stopped, ids[:position])])
        pairs = list(zip(state(slot), state(stopped.ssm_slot), strict=True))
        out[f"state_at_{position}"] = {"max_abs_diff": max(float((g - w).abs().max()) for g, w in pairs),
                                      "max_abs": max(float(w.abs().max()) for _, w in pairs)}
        runner.release(stopped)
    return out


def _gdn_decode_check(batch: int) -> dict:
    """Fused GDN decode step (4B sizes) against the naive recurrence, and fla's kernel with the gather/scatter it needs."""
    from headroom.kernels import gated_delta, gdn_decode
    from headroom.kernels.gdn_fla import gated_delta_rule_varlen

    bf = torch.bfloat16
    conv = torch.randn(batch, 2 * 16 * 128 + 32 * 128, device=DEV, dtype=bf)
    qd, kd, vd = torch.split(conv, [2048, 2048, 4096], dim=-1)
    qd, kd, vd = qd.reshape(batch, 16, 128), kd.reshape(batch, 16, 128), vd.reshape(batch, 32, 128)
    gd, bd = -torch.rand(batch, 32, device=DEV), torch.rand(batch, 32, device=DEV, dtype=bf)
    states = torch.randn(40, 32, 128, 128, device=DEV) * 0.1
    slots = torch.randperm(40, device=DEV)[:batch]
    ref_states, fla_states = states.clone(), states[slots].clone()
    got = gdn_decode.gated_delta_decode(qd, kd, vd, gd, bd, states, slots)
    want = gated_delta.naive_gated_delta_decode(qd, kd, vd, gd, bd, ref_states, slots)
    bounds = torch.arange(batch + 1, device=DEV)
    fla_out, fla_final = gated_delta_rule_varlen(qd, kd, vd, gd, bd, fla_states, bounds)
    # The graphs' step: gates made in the kernel from the raw projection (a, b) against gdn_gates + the naive rule.
    from headroom.kernels.gates import naive_gdn_gates

    raw_a, raw_b = torch.randn(batch, 32, device=DEV, dtype=bf) * 4, torch.randn(batch, 32, device=DEV, dtype=bf) * 4
    neg_a, dt_bias = -torch.rand(32, device=DEV) * 8, torch.randn(32, device=DEV, dtype=bf)
    raw_states, raw_ref = states.clone(), states.clone()
    raw = gdn_decode.gated_delta_decode(qd, kd, vd, raw_a, raw_b, raw_states, slots, raw_gates=(neg_a, dt_bias))
    raw_beta, raw_g = naive_gdn_gates(raw_b, raw_a, neg_a, dt_bias)
    raw_want = gated_delta.naive_gated_delta_decode(qd, kd, vd, raw_g, raw_beta, raw_ref, slots)
    # The step with the layer's gated output norm (a head's value blocks meeting at the last) against the naive
    # rule, then the norm.
    from headroom.kernels.norm import naive_gated_rms_norm

    z, norm_w = torch.randn(batch, 32, 128, device=DEV, dtype=bf), torch.rand(128, device=DEV, dtype=bf) + 0.5
    normed_states, normed_ref = states.clone(), states.clone()
    normed = gdn_decode.gated_delta_decode(qd, kd, vd, gd, bd, normed_states, slots, gate_norm=(z, norm_w, 1e-6))
    normed_want = naive_gated_rms_norm(gated_delta.naive_gated_delta_decode(qd, kd, vd, gd, bd, normed_ref, slots),
                                       z, norm_w, 1e-6)
    # The step convolving the in-projection's raw columns itself (and norming) against the conv kernel, then the
    # step: the same bits expected (the conv is the kernel's own step), the conv states rolled alike.
    from headroom.kernels.conv_update import causal_conv1d_update

    mixed = torch.randn(batch, 8192, device=DEV, dtype=bf)
    conv_w = torch.randn(8192, 4, device=DEV, dtype=bf) * 0.3
    conv_states = torch.randn(40, 8192, 3, device=DEV, dtype=bf)

    def heads(x):
        q, k, v = torch.split(x, [2048, 2048, 4096], dim=-1)
        return q.reshape(batch, 16, 128), k.reshape(batch, 16, 128), v.reshape(batch, 32, 128)

    conv_ref, step_ref, step_states = conv_states.clone(), states.clone(), states.clone()
    convolved = gdn_decode.gated_delta_decode(*heads(mixed), gd, bd, step_states, slots, gate_norm=(z, norm_w, 1e-6),
                                              conv=(mixed, conv_w, conv_states))
    convolved_want = gdn_decode.gated_delta_decode(*heads(causal_conv1d_update(mixed, conv_w, conv_ref, slots)), gd, bd,
                                                   step_ref, slots, gate_norm=(z, norm_w, 1e-6))
    # Every comparison before any timing: the timed launches step `states` in place (session 30's check took the
    # plain step's states_vs_naive after them and read 0.48, against 1.8e-7 in sessions 3-19).
    checks = {
        "conv_in_step_out_vs_apart": _diff(convolved, convolved_want),
        "conv_in_step_states_vs_apart": _diff(step_states, step_ref),
        "conv_in_step_conv_states_vs_apart": _diff(conv_states, conv_ref),
        "gate_norm_out_vs_naive": _diff(normed, normed_want),
        "gate_norm_states_vs_naive": _diff(normed_states, normed_ref),
        "raw_gates_out_vs_naive": _diff(raw, raw_want), "raw_gates_states_vs_naive": _diff(raw_states, raw_ref),
        "out_vs_naive": _diff(got, want), "states_vs_naive": _diff(states, ref_states),
        "fla_out_vs_naive": _diff(fla_out, want), "fla_states_vs_naive": _diff(fla_final, ref_states[slots])}
    return {
        **checks,
        "conv_in_step_ms": _bench(lambda: gdn_decode.gated_delta_decode(
            *heads(mixed), gd, bd, states, slots, gate_norm=(z, norm_w, 1e-6), conv=(mixed, conv_w, conv_states))),
        "gate_norm_ms": _bench(lambda: gdn_decode.gated_delta_decode(qd, kd, vd, gd, bd, states, slots,
                                                                     gate_norm=(z, norm_w, 1e-6))),
        "ms": _bench(lambda: gdn_decode.gated_delta_decode(qd, kd, vd, gd, bd, states, slots)),
        "fla_with_gather_scatter_ms": _bench(lambda: states.index_copy_(
            0, slots, gated_delta_rule_varlen(qd, kd, vd, gd, bd, states[slots], bounds)[1]))}


def _merge_check() -> dict:
    """Split-K merge of a batch-16 decode (32 splits, 16 heads, 256 dims) against merge_attention_states."""
    from headroom.kernels.attention_merge import merge_attention_states
    from headroom.kernels.attention_merge_triton import merge_splits_into

    parts = torch.randn(32, 16, 16, 256, device=DEV)
    lses = torch.randn(32, 16, 16, device=DEV) * 4
    lses[5:, 0] = float("-inf")  # a short sequence: most splits saw no key
    out = torch.full((16, 16, 256), float("nan"), device=DEV, dtype=torch.bfloat16)
    out_lse = torch.full((16, 16), float("nan"), device=DEV)
    merge_splits_into(parts, lses, out, out_lse)
    want, want_lse = merge_attention_states(parts, lses, torch.bfloat16)
    return {"out": _diff(out, want), "lse": _diff(out_lse, want_lse),
            "ms": _bench(lambda: merge_splits_into(parts, lses, out, out_lse)),
            "naive_ms": _bench(lambda: merge_attention_states(parts, lses, torch.bfloat16))}


def _sequence(runner, name: str, tokens: list[int]):
    from headroom.engine.sequence import Sequence

    seq = Sequence(name, list(tokens))
    seq.kv_slots = runner.kv_allocator.alloc(len(tokens)) or []
    seq.ssm_slot = runner.ssm_pool.alloc() if runner.ssm_pool else None
    return seq


class _AnyShapeGemvTable(dict):
    """A GEMV table with an entry for every shape and input at every row count (logit_check's tiny model, whose shapes
    no shipped table has): one row as bf16 pairs in 16-row blocks, several rows on swapped tensor-core tiles, one
    split; K must be a multiple of the 64-element tile (the launchers refuse other inputs and the caller takes
    cuBLAS)."""

    def get(self, key, default=None):
        from headroom.kernels.gemv import GemvConfig

        n, k, rows, _ = key
        if k % 64 or n % 2:
            return default
        return GemvConfig(block_n=16 if rows == 1 else 32, block_k=64, split=1, num_stages=2, swap_ab=rows > 1)


@contextlib.contextmanager
def _transformers_torch_delta_rule():
    """transformers' Gated DeltaNet on its own torch functions instead of fla's kernels inside (LOGIT_HF_TORCH=1):
    fla's first fp32 calls at the 4B model's head sizes compile for minutes of device time, and the torch functions
    are transformers' reference arithmetic. transformers (5.17, the GPU machine's) wraps each torch function in one
    that calls fla where fla imports; the layer calls the module's names, so those are set to the functions the
    wrappers wrap, and back after. Anything else there (the hub's kernel modules) is an error, not a silent fla
    reference."""
    import importlib
    import inspect

    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = {name: getattr(module, name) for name in names}
    for name, wrapper in saved.items():
        function = getattr(wrapper, "__wrapped__", wrapper)
        if not inspect.isfunction(function) or function.__module__ != module.__name__:
            raise RuntimeError(f"LOGIT_HF_TORCH=1: transformers' {name} is a {type(function).__name__}, not the "
                               "torch function this check can call")
    try:
        for name, wrapper in saved.items():
            setattr(module, name, getattr(wrapper, "__wrapped__", wrapper))
        yield
    finally:
        for name, wrapper in saved.items():
            setattr(module, name, wrapper)


def _logits_of(path: Path, inputs: list[list[int]], decode_tokens: int, kv: str, fused: bool, batched: bool,
               device: str = "cuda") -> torch.Tensor:
    """logit_check's run of one engine: each prompt prefilled but its last decode_tokens, which then go one a pass
    (batched: every prompt's in one pass); the logits at the prefill's last position and every decoded one, prompt
    after prompt, fp32."""
    from headroom.engine.config import EngineConfig
    from headroom.engine.runtime.forward_batch import BatchItem
    from headroom.engine.runtime.model_runner import ModelRunner

    prompts, length = len(inputs), len(inputs[0])
    runner = ModelRunner(EngineConfig(
        model_path=str(path), device=device, dtype="bfloat16", kv_dtype=kv,
        max_total_tokens=max(4096, -(-prompts * (length + 64) // 256) * 256), ssm_slots=max(8, prompts + 1),
        context_length=4096, max_running_requests=4,
        cuda_graph_max_batch=4 if fused and kv == "bf16" and device == "cuda" else 0))
    runner.capture_decode_graphs()
    seqs = [_sequence(runner, f"check{k}", tokens) for k, tokens in enumerate(inputs)]
    per_prompt = [[runner.forward([BatchItem(seq, tokens[: length - decode_tokens])])[0]]
                  for seq, tokens in zip(seqs, inputs, strict=True)]
    for p in range(length - decode_tokens, length):
        if batched:
            step = runner.forward([BatchItem(seq, [tokens[p]]) for seq, tokens in zip(seqs, inputs, strict=True)])
            for k, logits in enumerate(step):
                per_prompt[k].append(logits)
        else:
            for k, (seq, tokens) in enumerate(zip(seqs, inputs, strict=True)):
                per_prompt[k].append(runner.forward([BatchItem(seq, [tokens[p]])])[0])
    got = torch.stack([row for rows in per_prompt for row in rows]).float()
    del runner
    if device == "cuda":
        torch.cuda.empty_cache()
    return got


def logit_check(models: tuple[str, ...], decode_tokens: int = 8, prompts: int = 4) -> dict:
    """Tiny random Qwen3.5 (gpu_engine's) and the 4B-shaped model: `prompts` random prompts, each prefilled but its last
    decode_tokens, which then go one per pass (graphed decode). Logits at those positions and at the prefill's last,
    against transformers fp32 (max and root-mean-square difference over every prompt's positions); transformers bf16's
    own distance is the bound. The "_batched" runs decode every prompt's token in one pass instead (`prompts` rows a
    step: the several-row GEMVs), with the next norm factored out of the next projection (engine/layers/residual.py
    PRESCALED_NORM) off and on. "_no_fla": the naive run with the delta rule's fp32 reference instead of fla's chunked
    kernel, which the naive run takes too. On the tiny model also the fused path with each fused op in turn on its
    reference. Session 9 call 4 ran one prompt, whose nine positions could not separate rounding choices at the 5%
    level."""
    import gpu_engine
    from headroom.engine.layers import residual
    from headroom.kernels import gdn_fla, gemv, ops
    from transformers import Qwen3_5ForCausalLM

    fla_available = gdn_fla.fla_available
    tiny = Path("/tmp/headroom-tiny-0")
    if not (tiny / "config.json").exists():
        gpu_engine._save_random(gpu_engine._tiny_config(0), tiny, 0)
    # LOGIT_HF_TORCH=1: the fp32 truth from transformers' torch functions (fla's fp32 compile is minutes at the 4B
    # sizes), the bf16 bound both as transformers runs by default (fla where installed) and on those functions.
    hf_torch = os.environ.get("LOGIT_HF_TORCH") == "1"
    out: dict = {"transformers_fp32_delta_rule": "transformers' torch functions" if hf_torch
                 else "as transformers picks (fla where installed)"}
    cases = {"tiny": (tiny, 777, 1000), "4b": (gpu_engine.MODEL_4B, 1500, 200000)}
    for label in models:
        path, length, vocab = cases[label]
        # Seed 3 is the one prompt of the runs before session 9's last.
        inputs = [[random.Random(3 + k).randrange(vocab) for _ in range(length)] for k in range(prompts)]
        positions = slice(length - decode_tokens - 1, length)
        case: dict = {"prompts": prompts, "positions_per_prompt": decode_tokens + 1}
        refs = {}
        references = [("fp32", torch.float32, hf_torch), ("bf16", torch.bfloat16, False)]
        references += [("bf16_torch", torch.bfloat16, True)] if hf_torch else []
        for name, dtype, on_torch in references:
            model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=dtype).to(DEV).eval()
            with torch.no_grad(), _transformers_torch_delta_rule() if on_torch else contextlib.nullcontext():
                refs[name] = torch.cat([model(torch.tensor([tokens], device=DEV)).logits[0, positions].float()
                                        for tokens in inputs])
            del model
            torch.cuda.empty_cache()
        truth = refs["fp32"]
        decoded = torch.ones(len(truth), dtype=torch.bool, device=truth.device)
        decoded[:: decode_tokens + 1] = False  # each prompt's first row is its prefill's last position
        for name in refs.keys() - {"fp32"}:
            label = "transformers_" + name
            case[label + "_vs_fp32_max_abs"] = float((refs[name] - truth).abs().max())
            case[label + "_vs_fp32_rms"] = float((refs[name] - truth).square().mean().sqrt())
        case["logit_scale"] = float(truth.abs().max())
        # bf16 KV fused (decode graphed) and naive (eager); int2 KV fused (eager here); on the tiny model, the
        # fused path with one op at a time back on its reference (which fused kernel moves the logits).
        # (name, fused, ops off, KV, one pass for all prompts' decode tokens, PRESCALED_NORM)
        shipped = residual.PRESCALED_NORM
        runs = [("headroom_bf16_fused_graphs", True, (), "bf16", False, shipped),
                ("headroom_bf16_naive_eager", False, (), "bf16", False, shipped),
                ("headroom_int2_fused_eager", True, (), "int2", False, shipped),
                ("headroom_bf16_fused_graphs_batched", True, (), "bf16", True, False),
                ("headroom_bf16_fused_graphs_batched_prescaled", True, (), "bf16", True, True)]
        # LOGIT_ABLATION=0 leaves the per-op runs out (11 of the 16 runs; 160 s of device time with them).
        if label == "tiny" and os.environ.get("LOGIT_ABLATION", "1") != "0":
            runs += [(f"headroom_bf16_fused_graphs_without_{op}", True, (op,), "bf16", False, shipped)
                     for op in ops.FUSED_OPS]
        # The naive run still takes fla's delta rule where fla is installed (ops.gated_delta_rule_varlen), whose
        # chunked kernel rounds its intermediates (the triangular solve, w, u, the chunk states) to bf16; this one
        # takes the reference's fp32 recurrence, as transformers' torch functions run it.
        runs.append(("headroom_bf16_naive_eager_no_fla", False, (), "bf16", False, shipped))
        # The tiny model's shapes are in no shipped GEMV table, so its runs above take cuBLAS for every linear; these
        # take the GEMV kernels at one and at four rows (_AnyShapeGemvTable). An error there is recorded, not raised:
        # the runs above are the check.
        if label == "tiny":
            runs += [("headroom_bf16_fused_graphs_gemv_table", True, (), "bf16", False, shipped),
                     ("headroom_bf16_fused_graphs_batched_gemv_table", True, (), "bf16", True, False),
                     ("headroom_bf16_fused_graphs_batched_prescaled_gemv_table", True, (), "bf16", True, True)]

        for key, fused, off, kv, batched, prescaled in runs:
            ops.set_fused(fused, off)
            residual.PRESCALED_NORM = prescaled
            gdn_fla.fla_available = (lambda: False) if key.endswith("_no_fla") else fla_available
            gemv._tuned = _AnyShapeGemvTable() if key.endswith("_gemv_table") else None  # None: the shipped table
            try:
                got = _logits_of(path, inputs, decode_tokens, kv, fused, batched)
            except Exception as exc:
                if not key.endswith("_gemv_table"):
                    raise
                case[key + "_error"] = f"{type(exc).__name__}: {exc}"[:2000]  # (the check's own runs went before)
                torch.cuda.empty_cache()
                continue
            case[key + "_vs_fp32_max_abs"] = float((got - truth).abs().max())
            case[key + "_vs_fp32_rms"] = float((got - truth).square().mean().sqrt())
            case[key + "_decode_only_vs_fp32_max_abs"] = float((got[decoded] - truth[decoded]).abs().max())
        gemv._tuned = None
        ops.set_fused(True)
        residual.PRESCALED_NORM = shipped
        gdn_fla.fla_available = fla_available
        case["transformers_bf16_decode_positions_vs_fp32_max_abs"] = float(
            (refs["bf16"][decoded] - truth[decoded]).abs().max())
        out[label] = case
    return out


EXTEND_TILE_CONFIGS = [{}, {"num_stages": 2}, {"num_stages": 3}, {"block_n": 32}, {"block_n": 128}, {"num_warps": 4},
                       {"page_tile": 0}, {"block_n": 32, "num_stages": 3}, {"mask_split": 0}, {"mask_split": 1},
                       {"lazy_rescale": 1}, {"mask_split": 1, "lazy_rescale": 1},
                       {"mask_split": 1, "lazy_rescale": 1, "block_n": 128},
                       {"mask_split": 1, "lazy_rescale": 1, "num_stages": 2},
                       {"load_per_token": 0, "magic_register": 0}, {"load_per_token": 1, "magic_register": 0}]
# The KIVI load variants alone (kivi_load_sweep): each packed byte loaded once per token it holds, the magic exponent
# in a register, both (kernels/paged_attention.py _load_kivi_pages; both are the defaults since session 16).
KIVI_LOAD_CONFIGS = [{}, {"load_per_token": 0, "magic_register": 0}, {"load_per_token": 1, "magic_register": 0},
                     {"load_per_token": 0, "magic_register": 1},
                     # fp16 tiles (HALF_TILES, session 17): the codes by inline PTX, four a register, dequantized in
                     # fp16x2; 1,983 -> 1,304 sm_90 instructions in the decode loop, 255 -> 186 registers (1,372 and
                     # 168 under a cap), extend 1,361 -> 1,021 (bench/results/session17).
                     {"half_tiles": 1}]


def attention_tile_sweep(configs: list[dict] | None = None, kinds: tuple[str, ...] = ("bf16", "int2"),
                         decode: bool = True) -> dict:
    """Extend (prefill) tile configs of the paged attention (EXTEND_TILE_CONFIGS, the first the current default): an
    8,192-query chunk at the end of 32K keys (bf16 and int2), ms and TFLOP/s per config; then the decode sweep."""
    import gpu_kernels
    from headroom.kernels import paged_attention as pa

    configs = EXTEND_TILE_CONFIGS if configs is None else configs
    out: dict = {}
    context, chunk = 32768, 8192
    flops = 4 * gpu_kernels.HQ * gpu_kernels.D * sum(context - chunk + i + 1 for i in range(chunk))
    for kind in kinds:
        kv, table = gpu_kernels.filled_pool(kind, [context])
        args = gpu_kernels.attention_args(kv, table, [context], [chunk])
        reference = None
        for config in configs:
            key = f"{kind}_" + ("default" if not config else "_".join(f"{k}{v}" for k, v in config.items()))
            try:
                with pa.tuned(extend=config):
                    result = pa.paged_attention(*args, max_q_len=chunk)
                    if reference is None:
                        reference = result[0].float()
                    ms = _bench(lambda args=args, chunk=chunk: pa.paged_attention(*args, max_q_len=chunk))
                out[key] = {"ms": ms, "TFLOPs": flops / ms / 1e9,
                            "max_abs_vs_default": float((result[0].float() - reference).abs().max())}
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is recorded, not fatal
                out[key] = {"error": str(exc)[:200]}
    if decode:
        out.update(decode_tile_sweep())
    return out


def kivi_load_sweep() -> dict:
    """KIVI_LOAD_CONFIGS over an int2 pool: the extend tile (8,192 queries at the end of 32K keys) and decode at
    batch 8 and 1 (32K keys a sequence), each against the default's output."""
    out = attention_tile_sweep(KIVI_LOAD_CONFIGS, ("int2",), decode=False)
    out.update(decode_tile_sweep(("int2",), (8, 1), KIVI_LOAD_CONFIGS + [
        {"splits_x": 2}, {"half_tiles": 1, "splits_x": 2},
        # fp16 tiles under a cap of 168 registers: three programs a multiprocessor (186 uncapped, sm_90 SASS).
        {"half_tiles": 1, "max_registers": 168}, {"half_tiles": 1, "max_registers": 168, "splits_x": 2}]))
    return out


# page_tile 0: KIVI's per-element gather instead of whole-page tiles (kernels/paged_attention.py _load_kivi_pages);
# bf16 ignores it. splits_x: that many times the default split count (pa.default_num_splits) of the key range.
DECODE_TILE_CONFIGS = [{}, {"page_tile": 0}, {"block_n": 32}, {"num_warps": 4}, {"num_warps": 8},
                       {"num_stages": 3}, {"block_n": 128}, {"splits_x": 2}, {"splits_x": 4}, {"splits_x": 2, "num_warps": 4},
                       {"num_stages": 1}, {"num_stages": 4}, {"block_n": 32, "splits_x": 2}, {"block_n": 128, "num_stages": 1},
                       {"splits_x": 2, "num_stages": 3}, {"splits_x": 4, "num_warps": 4}, {"block_n": 16},
                       {"lazy_rescale": 1}, {"mask_split": 1, "lazy_rescale": 1},
                       # KIVI (bf16 ignores them): the head in chunks (kernels/kivi_decode.py: 168 registers against
                       # 246, three programs a multiprocessor instead of two, hence also more splits), and the general
                       # kernel's loads plain or with one of the two defaults (load_per_token, magic_register) off.
                       {"d_chunks": 2}, {"d_chunks": 2, "splits_x": 2}, {"d_chunks": 4, "max_registers": 168},
                       {"d_chunks": 4, "max_registers": 168, "splits_x": 2}, {"load_per_token": 0},
                       {"d_chunks": 2, "magic_register": 1}, {"d_chunks": 2, "magic_register": 1, "splits_x": 2},
                       {"load_per_token": 0, "magic_register": 0}, {"magic_register": 0}]


# Decode settings a bf16 pool has no use for (its sweep skips the configs that hold them).
KIVI_ONLY = {"page_tile", "d_chunks", "magic_register", "max_registers", "load_per_token", "half_tiles"}


def decode_tile_sweep(kinds: tuple[str, ...] = ("bf16", "int2"), batches: tuple[int, ...] = (8, 1),
                      configs: list[dict] | None = None) -> dict:
    """Decode tile configs of the paged attention over 32K keys a sequence (ms of one layer's call, splits
    merged), DECODE_TILE_CONFIGS, the first the current default; each against the default's output."""
    import gpu_kernels
    from headroom.kernels import paged_attention as pa

    out: dict = {}
    decode_configs = DECODE_TILE_CONFIGS if configs is None else configs
    for kind in kinds:
        for batch in batches:
            lens = [32768] * batch
            kv, table = gpu_kernels.filled_pool(kind, lens)
            args = gpu_kernels.attention_args(kv, table, lens, [1] * batch)
            splits = pa.default_num_splits(batch, 1, gpu_kernels.HQ // gpu_kernels.HKV, gpu_kernels.HKV, kind != "bf16")
            reference = None
            for config in decode_configs:
                if kind == "bf16" and KIVI_ONLY.intersection(config):
                    continue
                key = f"{kind}_decode_b{batch}_32k_" + ("default" if not config else "_".join(f"{k}{v}" for k, v in config.items()))
                run = functools.partial(pa.paged_attention, *args, max_q_len=1, num_splits=splits * config.get("splits_x", 1))
                try:
                    with pa.tuned(decode={k: v for k, v in config.items() if k != "splits_x"}):
                        result = run()
                        if reference is None:
                            reference = result[0].float()
                        out[key] = {"ms": _bench(run), "num_splits": splits * config.get("splits_x", 1),
                                    "max_abs_vs_default": float((result[0].float() - reference).abs().max())}
                except Exception as exc:  # noqa: BLE001 - a config that does not fit is recorded, not fatal
                    out[key] = {"error": str(exc)[:200]}
    return out


def decode_window_check(batches: tuple[int, ...] = (1, 8), context: int = 32768, window: int = 17) -> dict:
    """A graphed int2 decode step's attention layer, its residual windows (`window` open keys a sequence, bf16)
    after `context` closed ones: the window attended in the pool's launch (paged_attention's window, one more split,
    the engine's default) against the pool pass then a window pass continuing it (session 16's three launches); ms of each,
    the largest difference between their outputs, and each one's from the naive attention over both key ranges."""
    return {f"int2_decode_b{batch}_{context // 1024}k_window{window}": _decode_window_case(batch, context, window)
            for batch in batches}


def _decode_window_case(batch: int, context: int, window: int) -> dict:
    import gpu_kernels
    from headroom.kernels import paged_attention as pa
    from headroom.kernels.paged_kv import KeyWindow, PagedKV

    lens = [context] * batch
    kv, table = gpu_kernels.filled_pool("int2", lens)
    q, positions, offsets, table, starts, closed, kv, scale = gpu_kernels.attention_args(
        kv, table, [n + window for n in lens], [1] * batch)
    closed = closed - window
    shape = (batch * 32, gpu_kernels.HKV, gpu_kernels.D)
    window_kv = PagedKV("dense", torch.randn(shape, device=DEV).to(torch.bfloat16),
                        torch.randn(shape, device=DEV).to(torch.bfloat16))
    # Window rows in reverse order of the sequences, as a pool's window rows need not follow the batch.
    window_table = ((batch - 1 - torch.arange(batch, device=DEV))[:, None] * 32
                    + torch.arange(32, device=DEV)[None]).to(torch.int32)
    window_lens = torch.full((batch,), window, dtype=torch.int32, device=DEV)
    keys = KeyWindow(window_kv, window_table, closed, window_lens)
    fused_out, two_out = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=DEV)
    acc = torch.empty(q.shape, device=DEV)

    def fused():
        return pa.paged_attention(q, positions, offsets, table, starts, closed, kv, scale, max_q_len=1,
                                  out=fused_out, out_lse=lse, window=keys)

    def two_passes():
        prev = pa.paged_attention(q, positions, offsets, table, starts, closed, kv, scale, max_q_len=1,
                                  out=acc, out_lse=lse)
        return pa.paged_attention(q, positions, offsets, window_table, closed, window_lens, window_kv, scale,
                                  max_q_len=1, prev=prev, out=two_out, out_lse=lse)

    a, b = fused()[0].float().clone(), two_passes()[0].float().clone()
    # The reference: the naive attention over the pool's keys and over the window's, merged in fp32.
    from headroom.kernels.attention_merge import merge_two
    from headroom.kernels.paged_kv import naive_paged_attention

    pool, pool_lse = naive_paged_attention(q, positions, offsets, table, starts, closed, kv, scale)
    seen, seen_lse = naive_paged_attention(q, positions, offsets, window_table, closed, window_lens, window_kv, scale)
    want, _ = merge_two(pool.float(), pool_lse, seen.float(), seen_lse)
    return {"fused_ms": _bench(fused), "two_passes_ms": _bench(two_passes),
            "max_abs_fused_vs_two_passes": float((a - b).abs().max()),
            "max_abs_fused_vs_naive": float((a - want.float()).abs().max()),
            "max_abs_two_passes_vs_naive": float((b - want.float()).abs().max()), "finite": bool(torch.isfinite(a).all())}


def _block_path_case(context: int, chunk: int) -> dict:
    """One int2 chunk at the end of `context` keys: the fused kernel against the block path."""
    import gpu_kernels
    from headroom.kernels import paged_attention as pa
    from headroom.kernels.paged_kv import BLOCKWISE_WORKSPACE_TOKENS, PagedKV

    block = BLOCKWISE_WORKSPACE_TOKENS
    kv, table = gpu_kernels.filled_pool("int2", [context])
    q, positions, offsets, table, starts, lens, kv, scale = gpu_kernels.attention_args(kv, table, [context], [chunk])
    k_ws = q.new_empty((block, gpu_kernels.HKV, gpu_kernels.D))
    v_ws = torch.empty_like(k_ws)
    ws_table = torch.arange(block, device=DEV, dtype=torch.int32)[None]
    rows = torch.zeros(1, dtype=torch.int32, device=DEV)
    count = -(-context // block)
    block_lens = [torch.tensor([min(block, context - i * block)], dtype=torch.int32, device=DEV) for i in range(count)]
    block_starts = [torch.tensor([i * block], dtype=torch.int32, device=DEV) for i in range(count)]
    acc, lse = torch.empty(q.shape, device=DEV), torch.empty(q.shape[:2], device=DEV)
    final = torch.empty_like(q)
    dense = PagedKV("dense", k_ws, v_ws)

    def blocks() -> torch.Tensor:
        prev = None
        for i in range(count):
            pa.dequantize_block(kv, table, block_lens[i], rows, i * block, block, k_ws, v_ws)
            target = final if i == count - 1 else acc
            pa.paged_attention(q, positions, offsets, ws_table, block_starts[i], block_lens[i], dense, scale,
                               max_q_len=chunk, prev=prev, out=target, out_lse=lse)
            prev = (target, lse)
        return final

    def fused() -> torch.Tensor:
        return pa.paged_attention(q, positions, offsets, table, starts, lens, kv, scale, max_q_len=chunk)[0]

    want = fused().clone()
    got = blocks()
    return {"fused_ms": _bench(fused), "blocks_ms": _bench(blocks), "blocks": count, "vs_fused": _diff(got, want)}


def kivi_block_path() -> dict:
    """The block path of a long KIVI chunk (engine/layers/paged_attention.py) against the fused dequantizing kernel:
    an 8,192-query int2 chunk at the end of 32K and 128K keys; and dequantize_block against naive_dequantize_block
    at a real block (16,384 keys of 4 heads x 256)."""
    import gpu_kernels
    from headroom.kernels import paged_attention as pa
    from headroom.kernels.paged_kv import BLOCKWISE_WORKSPACE_TOKENS

    out: dict = {f"int2_chunk8192_ctx{c}": _block_path_case(c, 8192) for c in (32768, 131072)}
    block = BLOCKWISE_WORKSPACE_TOKENS
    kv, table = gpu_kernels.filled_pool("int2", [block + 4096])
    want_k = torch.zeros(block, gpu_kernels.HKV, gpu_kernels.D, device=DEV, dtype=torch.bfloat16)
    want_v, got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_k), torch.zeros_like(want_k)
    lens_t, rows = torch.tensor([block], dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV)
    pa.dequantize_block(kv, table, lens_t, rows, 4096, block, got_k, got_v)
    pa.naive_dequantize_block(kv, table, lens_t, rows, 4096, block, want_k, want_v)
    out["dequantize_block_16k"] = {
        "k": _diff(got_k, want_k), "v": _diff(got_v, want_v),
        "ms": _bench(lambda: pa.dequantize_block(kv, table, lens_t, rows, 4096, block, got_k, got_v))}
    return out

def profile_passes(model: Path) -> dict:
    """Where the time goes, through the LLM API with decode graphs: one 8,192- and one 32,768-token prefill (wall
    vs kernel time, and where the GPU sat idle) and 32 graphed decode steps at batch 1."""
    from decode_parts import gpu_timeline
    from gpu_engine import kernels_by_name
    from headroom.engine.llm import LLM
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(5)
    llm = LLM(str(model), device="cuda", dtype="bfloat16", kv_dtype="bf16", max_total_tokens=72000, ssm_slots=24,
              chunked_prefill_size=8192, context_length=40000, max_running_requests=8, enable_prefix_cache=False)
    prompt = [rng.randrange(1000, 200000) for _ in range(8192)]
    long_prompt = [rng.randrange(1000, 200000) for _ in range(32768)]
    llm.generate([prompt], max_new_tokens=1, ignore_eos=True)
    llm.generate([long_prompt[::-1]], max_new_tokens=1, ignore_eos=True)
    llm.generate([prompt[:256]], max_new_tokens=8, ignore_eos=True)
    out: dict = {}
    for name, prompts, new in (("prefill_8192", [prompt[::-1]], 1), ("prefill_32768", [long_prompt], 1),
                               ("decode_bs1_32_steps", [prompt[:200]], 33)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, max_new_tokens=new, ignore_eos=True)
            torch.cuda.synchronize()
        out[name] = {"wall_ms_profiled": (time.perf_counter() - started) * 1000, **kernels_by_name(prof),
                     "timeline": gpu_timeline(prof)}
        cpu = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:15]
        out[name]["cpu_top"] = [{"name": e.key[:80], "count": e.count, "cpu_ms": e.cpu_time_total / 1000} for e in cpu]
    return out


def _step_grids(full: dict, prefill: dict, steps: int) -> dict:
    """Per grid, a decode step's launches and us a launch: the full run's less the prefill-only run's."""
    out = {}
    for grid, entry in full.items():
        count = entry["count"] - prefill.get(grid, {"count": 0})["count"]
        if count > 0:
            us = entry["us"] - prefill.get(grid, {"us": 0.0})["us"]
            out[grid] = {"launches_a_step": count / steps, "us_a_launch": us / count}
    return dict(sorted(out.items(), key=lambda item: -item[1]["launches_a_step"] * item[1]["us_a_launch"]))


def profile_decode_batches(model: Path, batches: tuple[int, ...] = (1, 8, 16), steps: int = 32,
                           device: str = "cuda", kv_dtype: str = "bf16") -> dict:
    """Where a graphed decode step's time goes at batch 1, 8 and 16 (issue 18: batch 8 and 16 reach a smaller share of
    their bandwidth limits than batch 1; the graph replay grows ~58 us a sequence against ~26 us of extra bytes,
    session 13). PDL off (HEADROOM_PDL=0, for this part's engine only): with it a kernel's measured time includes its
    wait for the one before, and the split by kernel means nothing. Per batch: GPU time a step by kernel name, the
    prompts' prefill (max_new_tokens=1, profiled alike) subtracted from the same prompts' 1 + steps tokens, and
    launches a step by kernel name. kv_dtype: the pool's format (profile_decode_int2: an int2 step beside a bf16 one,
    where int2 decode is 0.2 ms a step slower at 256 tokens of context, session 16)."""
    from gpu_engine import kernels_by_grid, kernels_by_name
    from headroom.engine.llm import LLM
    from headroom.kernels import pdl
    from torch.profiler import ProfilerActivity, profile

    with pdl_off():
        llm = LLM(str(model), device=device, dtype="bfloat16", kv_dtype=kv_dtype, max_total_tokens=16384, ssm_slots=40,
                  chunked_prefill_size=8192, context_length=4096, max_running_requests=16, enable_prefix_cache=False)
        rng = random.Random(9)
        vocab = llm.runner.model_config.vocab_size
        out: dict = {"pdl": pdl.use_pdl(torch.device(device))}
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for batch in batches:
            prompts = [[rng.randrange(vocab) for _ in range(256)] for _ in range(batch)]
            llm.generate(prompts, max_new_tokens=steps + 1, ignore_eos=True)  # warm: this batch's graph and shapes
            by_run, grids = {}, {}
            for new in (1, steps + 1):
                sync()
                # (CPU activity off the GPU, where there is no kernel to count: a dry run of the part.)
                with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
                    llm.generate(prompts, max_new_tokens=new, ignore_eos=True)
                    sync()
                by_run[new] = {row["name"]: row for row in kernels_by_name(prof, top=400)["top"]}
                grids[new] = kernels_by_grid(prof, "gemv")
            full, prefill = by_run[steps + 1], by_run[1]
            per_step = {name: (row["ms"] - prefill.get(name, {"ms": 0.0})["ms"]) / steps for name, row in full.items()}
            launches = {name: (row["count"] - prefill.get(name, {"count": 0})["count"]) / steps
                        for name, row in full.items()}
            ranked = sorted(per_step.items(), key=lambda item: -item[1])
            out[f"bs{batch}"] = {"step_kernel_ms": sum(per_step.values()), "launches_a_step": sum(launches.values()),
                                 "top": [{"name": name[:100], "ms_a_step": ms, "launches_a_step": launches[name]}
                                         for name, ms in ranked[:24]],
                                 # The GEMVs apart by grid (their shapes; PDL off, so each launch's own time): which
                                 # projection takes longer in the step than in the sweep's chains
                                 "gemv_by_grid": _step_grids(grids[steps + 1], grids[1], steps)}
        return out


def save_fla_configs(outdir: Path) -> dict:
    """The configs fla's autotuners picked in this process -> OUTDIR/fla_tuned_configs.json (merged into what
    kernels/fla_tuned_configs.json holds for other GPUs)."""
    import json

    from headroom.kernels.gdn_fla import TUNED_CONFIGS, harvest_fla_configs

    harvested = harvest_fla_configs()
    shipped = json.loads(TUNED_CONFIGS.read_text()) if TUNED_CONFIGS.exists() else {}
    text = json.dumps({**shipped, **harvested}, indent=1, sort_keys=True)
    (outdir / "fla_tuned_configs.json").write_text(text)
    TUNED_CONFIGS.write_text(text)
    return {gpu: {kernel: len(keys) for kernel, keys in v["autotuners"].items()} for gpu, v in harvested.items()}


def timed_prompts(llm, lengths: list[int], checkpoints: bool, rng: random.Random) -> float:
    """Seconds of one run of LLM.generate's own loop over fresh random prompts of these lengths, each taking one
    token (Sequences that may decline their checkpoint stops), synchronised on the GPU at both ends."""
    from headroom.engine.sequence import SamplingParams, Sequence, SequenceStatus

    vocab = llm.runner.model_config.vocab_size
    seqs = [Sequence(f"p{rng.random()}", [rng.randrange(vocab) for _ in range(n)],
                     SamplingParams(max_new_tokens=1, ignore_eos=True), take_checkpoints=checkpoints) for n in lengths]
    sync = torch.cuda.synchronize if llm.runner.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    try:
        llm._run(seqs, 8192, {})
    finally:
        for seq in seqs:
            if seq.status is not SequenceStatus.WAITING:
                llm._finish(seq)
    sync()
    return time.perf_counter() - started


def profile_small_passes(model: Path, device: str = "cuda") -> dict:
    """Where an eager prefill pass's host time goes (issue 15's idle TTFT, issue 18's HTTP rows): through the LLM
    API with the prefix cache on, as `headroom serve` runs, lone prompts of 30 tokens (no checkpoint stop),
    256 tokens (3 stops) and 8,192 tokens (3 stops), each shape warmed first; wall time and the top Python
    functions by own time (cProfile), and the same prompts with stops declined."""
    import cProfile
    import pstats

    from headroom.engine.llm import LLM

    rng = random.Random(6)
    llm = LLM(str(model), device=device, dtype="bfloat16", kv_dtype="bf16", max_total_tokens=40000, ssm_slots=24,
              chunked_prefill_size=8192, context_length=16384, max_running_requests=8)

    def run(n: int, checkpoints: bool) -> float:
        return timed_prompts(llm, [n], checkpoints, rng)

    out: dict = {}
    for n in (30, 256, 8192):
        for checkpoints in (True, False):
            run(n, checkpoints)
            walls = [run(n, checkpoints) for _ in range(3)]
            out[f"prompt_{n}_{'stops' if checkpoints else 'no_stops'}_ms"] = min(walls) * 1000
        profiler = cProfile.Profile()
        profiler.enable()
        run(n, True)
        profiler.disable()
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]  # (file, line, fn) -> (cc, nc, tt, ct, _)
        out[f"prompt_{n}_python_top"] = [{"fn": f"{Path(f).name}:{line}:{fn}", "calls": nc, "own_ms": tt * 1000,
                                          "cum_ms": ct * 1000} for (f, line, fn), (_, nc, tt, ct, _) in rows]
    return out


def kivi_graph_check(model: Path, kv: str = "int2", device: str = "cuda") -> dict:
    """Graphed KIVI decode against the same decode run eagerly (cuda_graph_max_batch=0), on the 4B-shaped
    model: three prompts (1,000, 1,030 and 2,050 tokens) decoding 70 tokens each, so graphed steps fill and
    close pages while others only append to their window rows; greedy tokens and prompt logits."""
    import gc

    from headroom.engine.llm import LLM

    settings = {"device": device, "dtype": "bfloat16", "kv_dtype": kv, "max_total_tokens": 16384, "ssm_slots": 16,
                "chunked_prefill_size": 8192, "context_length": 8192, "max_running_requests": 4,
                "enable_prefix_cache": False}
    runs = {}
    for graphs in (4, 0):
        llm = LLM(str(model), cuda_graph_max_batch=graphs, **settings)
        vocab = llm.runner.model_config.vocab_size
        prompts = [[random.Random(n).randrange(vocab) for _ in range(n)] for n in (1000, 1030, 2050)]
        runs[graphs] = (llm.generate(prompts, max_new_tokens=70, ignore_eos=True),
                        llm.runner.decode_graphs.captured_sizes if llm.runner.decode_graphs else ())
        del llm
        gc.collect()
    (graphed, captured), (eager, _) = runs[4], runs[0]
    pairs = list(zip(graphed, eager, strict=True))
    return {"captured": list(captured), "tokens_equal": [a.token_ids == b.token_ids for a, b in pairs],
            "first_divergence": [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None)
                                 for a, b in pairs],
            "prompt_logits": [_diff(a.prompt_logits, b.prompt_logits) for a, b in pairs]}


def attention_backends() -> dict:
    """The prefill attention of an 8,192-query chunk (alone, and at the end of 32K keys): this engine's paged
    kernel against torch's SDPA backends (flash, cuDNN, memory-efficient) on contiguous K/V with the same causal
    alignment (queries at the end of the keys), ms and TFLOP/s each, errors against the paged kernel's output;
    and what gathering a chunk's K/V out of the pool would add. Decides whether a dense-KV prefill path is worth
    having (issue 18: 32K prefill >= 1.5x transformers)."""
    import gpu_kernels
    from headroom.kernels import paged_attention as pa
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv, d = gpu_kernels.HQ, gpu_kernels.HKV, gpu_kernels.D
    out: dict = {}
    for context, chunk in ((8192, 8192), (32768, 8192)):
        flops = 4 * hq * d * sum(context - chunk + i + 1 for i in range(chunk))
        case: dict = {}
        kv, table = gpu_kernels.filled_pool("bf16", [context])
        args = gpu_kernels.attention_args(kv, table, [context], [chunk])
        ours = pa.paged_attention(*args, max_q_len=chunk)[0]
        ms = _bench(lambda args=args, chunk=chunk: pa.paged_attention(*args, max_q_len=chunk))
        case["paged_triton"] = {"ms": ms, "TFLOPs": flops / ms / 1e9}
        q = args[0]
        # The keys and values in order, out of the pool (what a dense path would gather each layer).
        slots = table[0, :context].long()
        keys, values = kv.k[slots], kv.v[slots]
        case["gather_kv_ms"] = _bench(lambda kv=kv, slots=slots: (kv.k[slots], kv.v[slots]))
        qt, kt, vt = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        mask = None if context == chunk else causal_lower_right(chunk, context)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            for gqa in (True, False):
                key = f"sdpa_{name}" + ("_gqa" if gqa else "_expanded")
                k_in = kt if gqa else kt.repeat_interleave(hq // hkv, dim=1)
                v_in = vt if gqa else vt.repeat_interleave(hq // hkv, dim=1)

                def run(k_in=k_in, v_in=v_in, backend=backend, gqa=gqa, qt=qt, mask=mask):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            qt, k_in, v_in, attn_mask=mask, is_causal=mask is None, scale=d**-0.5,
                            **({"enable_gqa": True} if gqa else {}))
                try:
                    got = run()[0].transpose(0, 1)
                    ms = _bench(run)
                    case[key] = {"ms": ms, "TFLOPs": flops / ms / 1e9,
                                 "max_abs_vs_paged": float((got.float() - ours.float()).abs().max())}
                except Exception as exc:  # noqa: BLE001 - a backend that refuses the shape is recorded
                    case[key] = {"error": str(exc)[:300]}
        out[f"chunk{chunk}_keys{context}"] = case
        torch.cuda.empty_cache()
    return out


def profile_decode_long(model: Path, context: int = 32768, batches: tuple[int, ...] = (1, 8), pdl: bool = True) -> dict:
    """Where a decode step at long context goes, bf16 KV against int2 (issue 18: int2 decode >= bf16 at 32K):
    B prompts of `context` tokens through the LLM API, eager decode (no graphs, so each kernel is named), one
    step under torch's profiler after a few untimed ones; kernel time by name and the step's wall time. pdl=False:
    programmatic dependent launch off (pdl_off says why)."""
    import gc

    from gpu_engine import kernels_by_name
    from headroom.engine.llm import LLM
    from torch.profiler import ProfilerActivity, profile

    with contextlib.nullcontext() if pdl else pdl_off():
        rng = random.Random(12)
        out: dict = {}
        for kv in ("bf16", "int2"):
            llm = LLM(str(model), device="cuda", dtype="bfloat16", kv_dtype=kv,
                      max_total_tokens=max(batches) * (context + 64), ssm_slots=max(batches) + 4,
                      chunked_prefill_size=8192, context_length=context + 64,
                      max_running_requests=max(batches), enable_prefix_cache=False, cuda_graph_max_batch=0)
            runner, inner = llm.runner, llm.runner.forward
            for batch in batches:
                decode_steps = [0]
                record: dict = {}

                def forward(items, all_positions=False, batch=batch, decode_steps=decode_steps, record=record,
                            inner=inner, **kwargs):
                    if len(items) != batch or any(len(i.token_ids) != 1 for i in items):
                        return inner(items, all_positions, **kwargs)
                    decode_steps[0] += 1
                    if decode_steps[0] != 4:
                        return inner(items, all_positions, **kwargs)
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        logits = inner(items, all_positions, **kwargs)
                        torch.cuda.synchronize()
                    record.update(wall_ms=(time.perf_counter() - started) * 1000, **kernels_by_name(prof, top=20))
                    return logits

                runner.forward = forward
                llm.generate([[rng.randrange(1000, 200000) for _ in range(context)] for _ in range(batch)],
                             max_new_tokens=6, ignore_eos=True)
                runner.forward = inner
                out[f"{kv}_bs{batch}_ctx{context}"] = record
            del llm, runner
            gc.collect()
            torch.cuda.empty_cache()
    return out


def kivi_dense_check() -> dict:
    """The dense path of a long KIVI chunk (engine/layers/paged_attention.py: ranges dequantized into the workspace,
    cuDNN over the chunk's own keys and whole prefix blocks, the paged kernel over the rest) against the paged
    passes it replaces (the block path and the window) on the same int2 pool: one layer at the 4B model's heads,
    an 8,192-token chunk after 24K and after 120K cached tokens (page-aligned, as a lone prompt's chunks are), and a
    7,990-token chunk starting and ending mid-page (as one after other requests' tokens), beside a decode step;
    ms of each and their difference, and both against fp32 attention over the dequantized context on 256 rows."""
    out: dict = {}
    for name, start, length in (("chunk8192_after24576", 24576, 8192), ("chunk8192_after122880", 122880, 8192),
                                ("chunk7990_after24690", 24690, 7990)):
        out[name] = _kivi_dense_case(start, length)
        torch.cuda.empty_cache()
    return out


def _chunk_beside_decode(kv_dtype: str, start: int, length: int):
    """One layer's pool (kv_dtype, the 4B model's heads) holding a `length`-token chunk after `start` cached tokens
    beside a decode step after 70, K/V stored: (pool, long, short, the pass's items, q [length + 1, Hq, D], the
    pass's own K/V)."""
    import gpu_kernels
    from headroom.engine.runtime.forward_batch import BatchItem
    from headroom.engine.runtime.kv_pool import KVPool
    from headroom.engine.sequence import Sequence

    hq, hkv, d = gpu_kernels.HQ, gpu_kernels.HKV, gpu_kernels.D
    gen = torch.Generator(device=DEV).manual_seed(start)
    end = start + length
    pages_end = -(-end // gpu_kernels.PAGE) * gpu_kernels.PAGE
    pool = KVPool(pages_end + 96, 1, hkv, d, kv_dtype, torch.bfloat16, DEV, residual_rows=2)
    long, short = Sequence("long", list(range(end + 1))), Sequence("short", list(range(71)))
    long.kv_slots, short.kv_slots = list(range(pages_end)), list(range(pages_end, pages_end + 96))
    news = []
    for seq, done, new in ((long, start, length), (short, 70, 1)):
        k = torch.randn(done + new, hkv, d, device=DEV, dtype=torch.bfloat16, generator=gen) * 2
        v = torch.randn(done + new, hkv, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        pool.store(0, seq, 0, k[:done], v[:done])
        seq.num_computed_tokens = done
        pool.store(0, seq, done, k[done:], v[done:])
        news.append((k[done:], v[done:]))
    q = torch.randn(length + 1, hq, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    items = [BatchItem(long, list(range(length))), BatchItem(short, [5])]
    return pool, long, short, items, q, (torch.cat([k for k, _ in news]), torch.cat([v for _, v in news]))


def _kivi_dense_case(start: int, length: int) -> dict:
    import gpu_kernels
    from headroom.engine.layers import paged_attention as layer
    from headroom.engine.runtime.forward_batch import ForwardBatch
    from headroom.kernels.attention import naive_prefix_attention

    hq, d = gpu_kernels.HQ, gpu_kernels.D
    end = start + length
    pool, long, short, items, q, _ = _chunk_beside_decode("int2", start, length)

    def run(dense_min_rows: int) -> tuple[torch.Tensor, ForwardBatch]:
        layer.DENSE_MIN_ROWS = dense_min_rows
        layer.DENSE_ATTENTION = dense_min_rows < 10**9
        batch = ForwardBatch.build(items, DEV)
        return layer.paged_attention_over_pool(q, batch, pool, 0, d**-0.5), batch

    default_rows, default_dense = layer.DENSE_MIN_ROWS, layer.DENSE_ATTENTION
    try:
        got, batch = run(default_rows)
        took_dense = bool(batch.cached(layer.KIVI_DENSE, lambda: {}))
        want, _ = run(10**9)
        dense_ms = _bench(lambda: run(default_rows))
        paged_ms = _bench(lambda: run(10**9))
    finally:
        layer.DENSE_MIN_ROWS = default_rows
        layer.DENSE_ATTENTION = default_dense
    sample = torch.arange(0, length, length // 256, device=DEV)[:256]
    k_ctx, v_ctx = pool.context(0, long, end)
    truth = naive_prefix_attention(q[sample].float(), k_ctx.float(), v_ctx.float(), batch.positions[sample], d**-0.5)
    k_s, v_s = pool.context(0, short, 71)
    short_truth = naive_prefix_attention(q[length:].float(), k_s.float(), v_s.float(), batch.positions[length:],
                                         d**-0.5)
    # The element where the two paths differ most, against fp32 at its row: which of them is off there.
    gap = (got[:length].float() - want[:length].float()).abs()
    flat = int(gap.argmax())
    row, head, dim = flat // (hq * d), flat // d % hq, flat % d
    row_truth = naive_prefix_attention(q[row:row + 1].float(), k_ctx.float(), v_ctx.float(),
                                       batch.positions[row:row + 1], d**-0.5)
    worst = {"row": row, "head": head, "dim": dim, "dense": float(got[row, head, dim]),
             "paged": float(want[row, head, dim]), "fp32": float(row_truth[0, head, dim]),
             "dense_row_vs_fp32": _diff(got[row:row + 1], row_truth), "paged_row_vs_fp32": _diff(want[row:row + 1], row_truth),
             "rms_dense_vs_paged": float(gap.pow(2).mean().sqrt())}
    return {"took_dense_path": took_dense, "dense_ms": dense_ms, "paged_ms": paged_ms, "worst": worst,
            "dense_vs_paged": _diff(got[:length], want[:length]),
            "dense_vs_fp32": _diff(got[sample], truth), "paged_vs_fp32": _diff(want[sample], truth),
            "decode_row_vs_fp32": _diff(got[length:], short_truth)}


def dense_path_variants(start: int = 24576, length: int = 8192) -> dict:
    """A long span's dense path at the layer (engine/layers/paged_attention.py) on an int2 and a bf16 pool, an
    8,192-token chunk after `start` cached tokens beside a decode step, against the paged passes: as it runs, with
    every cuDNN call given copies of its K/V, and with the device synchronised after every cuDNN call (a piece read
    after a later write of its memory would differ from the copies'). Max |dense - paged| of each."""
    import gpu_kernels
    from headroom.engine.layers import paged_attention as layer
    from headroom.engine.runtime.forward_batch import ForwardBatch
    from headroom.kernels import dense_attention

    d = gpu_kernels.D
    real = dense_attention.dense_attention
    out: dict = {}
    for kv_dtype in ("int2", "auto"):
        case_inputs = _chunk_beside_decode(kv_dtype, start, length)
        pool, _, _, items, q, chunk_kv = case_inputs

        def run(dense_min_rows: int, q=q, pool=pool, items=items, chunk_kv=chunk_kv) -> torch.Tensor:
            layer.DENSE_MIN_ROWS = dense_min_rows
            layer.DENSE_ATTENTION = dense_min_rows < 10**9
            return layer.paged_attention_over_pool(q, ForwardBatch.build(items, DEV), pool, 0, d**-0.5, chunk_kv)

        def copies(q_, k, v, causal, scale):
            return real(q_, k.clone(), v.clone(), causal, scale)

        def synced(q_, k, v, causal, scale):
            got = real(q_, k, v, causal, scale)
            torch.cuda.synchronize()
            return got

        default_rows, default_dense = layer.DENSE_MIN_ROWS, layer.DENSE_ATTENTION
        case: dict = {}
        try:
            want = run(10**9)
            for name, fn in (("as_run", real), ("kv_copies", copies), ("synchronised", synced)):
                dense_attention.dense_attention = fn
                got = run(default_rows)
                case[name] = _diff(got[:length], want[:length])
            dense_attention.dense_attention = real
            alone = _span_alone(case_inputs, length, True)
            case["lone_span"] = _diff(alone, want[:length])
            case["lone_span_paged"] = _diff(_span_alone(case_inputs, length, False), want[:length])
            case["lone_span_twice"] = _diff(_span_alone(case_inputs, length, True), alone)
        finally:
            layer.DENSE_MIN_ROWS = default_rows
            layer.DENSE_ATTENTION = default_dense
            dense_attention.dense_attention = real
        out["int2" if kv_dtype == "int2" else "bf16"] = case
        del pool, case_inputs
        torch.cuda.empty_cache()
    return out


def _attention_inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 q [rows, Hq, D], k and v [rows, Hkv, D] at the 4B model's heads (keys twice the scale), the
    cuDNN checks' inputs."""
    import gpu_kernels

    hq, hkv, d = gpu_kernels.HQ, gpu_kernels.HKV, gpu_kernels.D
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(rows, hq, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(rows, hkv, d, device=DEV, dtype=torch.bfloat16, generator=gen) * 2
    v = torch.randn(rows, hkv, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    return q, k, v


def _span_alone(case: tuple, length: int, dense: bool) -> torch.Tensor:
    """The long span of _chunk_beside_decode's case alone in its pass (no paged pass over the other sequence
    before it), through the layer with its dense path on or off."""
    import gpu_kernels
    from headroom.engine.layers import paged_attention as layer
    from headroom.engine.runtime.forward_batch import ForwardBatch

    pool, _, _, items, q, chunk_kv = case
    layer.DENSE_ATTENTION = dense
    return layer.paged_attention_over_pool(q[:length], ForwardBatch.build(items[:1], DEV), pool, 0,
                                           gpu_kernels.D**-0.5, (chunk_kv[0][:length], chunk_kv[1][:length]))


def _fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention in fp32, one query head at a time (GQA: head h reads K/V head h // group): out [L, Hq, D]
    and lse [L, Hq], the reference the cuDNN checks take."""
    from headroom.kernels import dense_attention as dense

    rows, hq, d = q.shape
    group = hq // k.shape[1]
    want = torch.empty(rows, hq, d, device=q.device)
    want_lse = torch.empty(rows, hq, device=q.device)
    for h in range(hq):
        o, lse = dense.naive_dense_attention(q[:, h:h + 1].float(), k[:, h // group:h // group + 1].float(),
                                             v[:, h // group:h // group + 1].float(), causal, scale)
        want[:, h:h + 1], want_lse[:, h:h + 1] = o, lse
    return want, want_lse


def dense_pieces(start: int = 24576, length: int = 8192, runs: int = 3) -> dict:
    """Where the layer's dense path goes wrong (session 13, calls 3-5): an 8,192-token span alone after `start`
    cached tokens, over a bf16 and an int2 pool, `runs` times with the dense path on, every cuDNN call recorded
    with clones of its inputs and outputs taken right after it. Each piece is then checked against fp32 on its own
    inputs and against cuDNN re-run alone on the clones; each run's output against the paged passes'. A piece off
    from its own re-run: cuDNN's result inside the layer depends on more than its inputs; equal to its re-run but
    off from fp32: wrong for those inputs; every piece right and the output off: the merges."""
    from headroom.engine.layers import paged_attention as layer
    from headroom.kernels import dense_attention
    from headroom.kernels.attention_merge import merge_two

    real = dense_attention.dense_attention
    recorded: list[tuple] = []

    live: list[tuple] = []
    clobbered: list[float] = []

    def recording(q_, k, v, causal, scale):
        got = real(q_, k, v, causal, scale)
        # Did this call change an earlier piece's output, still held by the layer (an out-of-bounds write)? (Not
        # its lse: the layer's merges update the first piece's lse in place.)
        for o_live, o_was in live:
            clobbered.append(float((o_live.float() - o_was.float()).abs().max()))
        recorded.append((q_.clone(), k.clone(), v.clone(), got[0].clone(), got[1].clone(), causal, scale))
        live.append((got[0], recorded[-1][3]))
        return got

    out: dict = {}
    for kv_dtype in ("auto", "int2"):
        case_inputs = _chunk_beside_decode(kv_dtype, start, length)
        default_dense = layer.DENSE_ATTENTION
        case: dict = {"runs": []}
        try:
            want = _span_alone(case_inputs, length, False)
            dense_attention.dense_attention = recording
            for _ in range(runs):
                recorded.clear()
                live.clear()
                clobbered.clear()
                got = _span_alone(case_inputs, length, True)
                torch.cuda.synchronize()
                dense_attention.dense_attention = real
                pieces = []
                for q_, k, v, o, lse, causal, scale in recorded:
                    again, again_lse = real(q_, k, v, causal, scale)
                    fp32, fp32_lse = _fp32_attention(q_, k, v, causal, scale)
                    pieces.append({"causal": causal, "keys": k.shape[0], "out_vs_rerun": _diff(o, again),
                                   "lse_vs_rerun": _diff(lse, again_lse), "out_vs_fp32": _diff(o, fp32),
                                   "lse_vs_fp32": _diff(lse, fp32_lse)})
                # The same pieces merged again outside the layer, from the clones: by the layer's own merge
                # (its Triton merges, a fresh output) and in fp32 by merge_two. Equal to the paged passes but not
                # to got: the merges in the layer saw other data than the clones (a race); off from them too: the
                # merge arithmetic. A continuation (the paged passes over the keys the pieces leave) is not
                # replayed, so this compares only where the layer ran pieces alone.
                replay = [functools.partial(lambda o, lse: (o.clone(), lse.clone()), o, lse) for _, _, _, o, lse, _, _ in recorded]
                remerged = torch.empty_like(got)
                layer._merge_pieces(remerged, replay, [])
                fp32, fp32_lse = recorded[0][3].float(), recorded[0][4].clone()
                for _, _, _, o, lse, _, _ in recorded[1:]:
                    fp32, fp32_lse = merge_two(fp32, fp32_lse, o, lse)
                case["runs"].append({"out_vs_paged": _diff(got, want), "pieces": pieces,
                                     "remerged_vs_got": _diff(remerged, got), "remerged_vs_paged": _diff(remerged, want),
                                     "fp32_merge_vs_paged": _diff(fp32, want), "fp32_merge_vs_got": _diff(fp32, got),
                                     "pdl": os.environ.get("HEADROOM_PDL", "1"),
                                     "earlier_pieces_changed_by_later_calls": list(clobbered)})
                dense_attention.dense_attention = recording
        finally:
            layer.DENSE_ATTENTION = default_dense
            dense_attention.dense_attention = real
        out["bf16" if kv_dtype == "auto" else kv_dtype] = case
        del case_inputs
        recorded.clear()
        live.clear()
        torch.cuda.empty_cache()
    return out


def cudnn_layout_check(rows: int = 8192) -> dict:
    """cuDNN's attention (kernels/dense_attention.py) over a causal 8,192-query block and an 8,192-key prefix block
    at the 4B model's heads, every output row against fp32 (naive_dense_attention, one query head at a time):
    as the engine calls it (views of row-major [L, H, D], GQA), with each operand a contiguous [1, H, L, D], with
    K/V repeated to the query heads, twice each (a difference between two identical calls is nondeterminism);
    and torch's flash attention (_scaled_dot_product_flash_attention) beside it."""
    import gpu_kernels
    from headroom.kernels import dense_attention as dense

    q, k, v = _attention_inputs(rows, seed=11)
    scale = gpu_kernels.D**-0.5
    group = gpu_kernels.HQ // gpu_kernels.HKV
    out: dict = {}
    for causal in (True, False):
        want, want_lse = _fp32_attention(q, k, v, causal, scale)

        def engine(causal=causal):
            return dense._cudnn(q, k, v, causal, scale)

        def contiguous(causal=causal):
            got = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q.transpose(0, 1)[None].contiguous(), k.transpose(0, 1)[None].contiguous(),
                v.transpose(0, 1)[None].contiguous(), None, True, 0.0, causal, False, scale=scale)
            return dense.to_rows(got[0], got[1])

        def repeated(causal=causal):
            kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            got = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q.transpose(0, 1)[None], kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], None, True, 0.0, causal,
                False, scale=scale)
            return dense.to_rows(got[0], got[1])

        def flash(causal=causal):
            kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            got = torch.ops.aten._scaled_dot_product_flash_attention(
                q.transpose(0, 1)[None], kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], 0.0, causal, False,
                scale=scale)
            return dense.to_rows(got[0], got[1])

        case: dict = {}
        for name, fn in (("engine", engine), ("contiguous", contiguous), ("repeated_kv", repeated), ("flash", flash)):
            try:
                first, first_lse = fn()
                second, _ = fn()
                err = (first.float() - want).abs()
                worst_row = int(err.amax(dim=(1, 2)).argmax())
                case[name] = {"out": _diff(first, want), "lse": _diff(first_lse, want_lse),
                              "rows_off_by_0.05": int((err.amax(dim=(1, 2)) > 0.05).sum()), "worst_row": worst_row,
                              "repeat_max_abs": float((first.float() - second.float()).abs().max()),
                              "ms": _bench(fn)}
            except Exception as exc:  # noqa: BLE001 - a variant this torch lacks is reported, not fatal
                case[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out["causal" if causal else "prefix"] = case
    return out


def cudnn_dirty_memory(rows: int = 8192, fills: int = 4) -> dict:
    """Whether cuDNN's attention depends on what the memory it is handed held before (session 13's lead for the
    dense path's unrepeatable results: an uninitialised workspace or scratch read): a causal 8,192 x 8,192 block and
    8,192 queries over an 8,192-key block at the 4B model's heads, each computed on a clean start, then after the
    caching allocator's free blocks were filled with random bytes (a 4 GiB tensor written and freed), `fills` times;
    each result against the clean one and against fp32."""
    import gpu_kernels
    from headroom.kernels import dense_attention as dense

    q, k, v = _attention_inputs(rows, seed=12)
    scale = gpu_kernels.D**-0.5
    out: dict = {}
    for causal in (True, False):
        want, _ = _fp32_attention(q, k, v, causal, scale)
        clean, _ = dense._cudnn(q, k, v, causal, scale)
        clean = clean.clone()
        case: dict = {"clean_vs_fp32": _diff(clean, want), "dirty": []}
        for i in range(fills):
            junk = torch.empty(4 << 30, dtype=torch.uint8, device=DEV)
            junk.random_(0, 256, generator=torch.Generator(device=DEV).manual_seed(i))
            del junk
            got, _ = dense._cudnn(q, k, v, causal, scale)
            case["dirty"].append({"vs_clean": _diff(got, clean), "vs_fp32": _diff(got, want)})
        out["causal" if causal else "prefix"] = case
    return out


def _first_divergences(llm, prompts: list[list[int]], fused: list[list[int]], unfused: list[list[int]],
                       most: int = 4) -> list[dict]:
    """Where the fused engine's greedy tokens first left the unfused one's, for up to `most` sequences: the step,
    both tokens, and this (unfused) engine's logits at that step (a prefill over the common prefix): the top two
    logits' margin and each chosen token's logit. A near tie (a margin of a rounding or two) is what the 1 / rms
    summed in another order can flip; a wide margin would be a fault."""
    found = []
    for index, (a, b) in enumerate(zip(fused, unfused, strict=True)):
        step = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if step is None or len(found) >= most:
            continue
        logits = llm.generate([prompts[index] + b[:step]], max_new_tokens=1, ignore_eos=True)[0].prompt_logits.float()
        top = torch.topk(logits, 2).values
        found.append({"sequence": index, "step": step, "fused_token": a[step], "unfused_token": b[step],
                      "top2_margin": float(top[0] - top[1]), "fused_token_logit": float(logits[a[step]]),
                      "unfused_token_logit": float(logits[b[step]]), "logit_scale": float(logits.abs().max())})
    return found


# The decode fusions fusion_speed switches: name -> its switches, each (module of engine/layers/, attribute), True
# for "fused" and False for "unfused", or (module, attribute, fused value, unfused value).
FUSIONS = {"residual": (("residual", "FUSED_RESIDUAL"),), "conv": (("linear_attention", "FUSED_CONV"),),
           "gate_norm": (("linear_attention", "DECODE_GATE_NORM"),),
           "conv_in_step": (("linear_attention", "DECODE_CONV_IN_STEP"),),
           "step": (("linear_attention", "DECODE_GATE_NORM"), ("linear_attention", "DECODE_CONV_IN_STEP")),
           "swiglu": (("mlp", "FUSED_SWIGLU"),), "prescaled_norm": (("residual", "PRESCALED_NORM"),),
           "conv_rows": (("linear_attention", "FUSED_CONV_ROWS", 16, 1),),
           "prescaled_conv_rows": (("residual", "PRESCALED_NORM"), ("linear_attention", "FUSED_CONV_ROWS", 16, 1)),
           "early_residual": (("kernels.gemv", "EARLY_RESIDUAL"),),
           "prescaled_early_residual": (("residual", "PRESCALED_NORM"), ("kernels.gemv", "EARLY_RESIDUAL"))}


def fusion_module(name: str):
    """The module of a FUSIONS switch: a dotted name under headroom (kernels.gemv), else an engine layer's."""
    import importlib

    return importlib.import_module(f"headroom.{name}" if "." in name else f"headroom.engine.layers.{name}")


def fusion_speed(model: Path, fusion: str = "residual", batches: tuple[int, ...] = (1, 8, 16), steps: int = 64,
                 device: str = "cuda") -> dict:
    """Graphed decode with a fusion on against off (FUSIONS: "residual", the residual add and the RMSNorm inside the
    GEMVs, engine/layers/residual.py, against add_rms_norm between them; "conv", Gated DeltaNet's decode conv in the
    in-projection's GEMV, engine/layers/linear_attention.py, against its own kernel; "gate_norm", its output norm
    in the delta rule's decode kernel at 2 or more sequences, against gated_rms_norm's launch; "conv_in_step", its
    conv in that kernel, against the conv's launch; "step", both; "swiglu", SwiGLU's activation in the gate|up
    GEMV's epilogue, engine/layers/mlp.py, against silu_mul's launch; "prescaled_norm", the next RMSNorm's weight in
    the residual GEMVs' epilogue and its 1 / rms on the next GEMV's output rows at 2-16 sequences,
    engine/layers/residual.py, against add_rms_norm's launch; "conv_rows", Gated DeltaNet's decode conv in the
    in-projection's GEMV at every decode-sized pass, FUSED_CONV_ROWS 16 against 1 (session 19 measured it losing at
    8 and 16 rows on the H200, before the tables tuned in the step); "prescaled_conv_rows", both; "early_residual",
    the residual GEMVs' residual rows loaded before their loop, kernels/gemv.py EARLY_RESIDUAL, the same bits;
    "prescaled_early_residual", with the prescaled norm), one engine after the other in this process, each
    capturing its own graphs: per batch the median step (wall, as the decode rows time it), the graph replayed
    alone (GPU time a step) and whether both engines chose the same greedy tokens (fused, the residual's rows' 1
    / rms is summed in another order, which may flip a near tie of a random model's logits, not more; the conv
    gives the same bits)."""
    import gc
    import statistics

    from headroom.engine.llm import LLM

    switches = [(fusion_module(name), attribute, *(values or (True, False)))
                for name, attribute, *values in FUSIONS[fusion]]
    saved = [getattr(module, attribute) for module, attribute, _, _ in switches]
    out: dict = {"fusion": fusion}
    tokens: dict[bool, dict[int, list[list[int]]]] = {}
    try:
        for fused in (True, False):
            for module, attribute, on, off in switches:
                setattr(module, attribute, on if fused else off)
            llm = LLM(str(model), device=device, dtype="bfloat16", max_total_tokens=16384, ssm_slots=40,
                      chunked_prefill_size=8192, context_length=4096, max_running_requests=16,
                      enable_prefix_cache=False)
            passes = time_passes(llm.runner)
            rng = random.Random(9)
            vocab = llm.runner.model_config.vocab_size
            label = "fused" if fused else "unfused"
            out[label], tokens[fused] = {}, {}
            for batch in batches:
                prompts = [[rng.randrange(vocab) for _ in range(256)] for _ in range(batch)]
                llm.generate(prompts, max_new_tokens=8, ignore_eos=True)  # warm: this batch's graph and shapes
                passes.clear()
                results = llm.generate(prompts, max_new_tokens=steps + 1, ignore_eos=True)
                timed = [p for p in passes if p["decode"] and "seconds" in p]
                median = statistics.median(p["seconds"] for p in timed)
                row = {"passes": len(timed), "graphed": all(p["graphed"] for p in timed),
                       "median_step_ms": median * 1000, "tokens_per_s": batch / median}
                graphs = llm.runner.decode_graphs
                if graphs is not None and batch in graphs.captured_sizes:
                    row["graph_replay_ms"] = graphs.replay_seconds(batch) * 1000
                out[label][f"bs{batch}"] = row
                tokens[fused][batch] = [r.token_ids for r in results]
                if not fused:
                    row["divergences"] = _first_divergences(llm, prompts, tokens[True][batch], tokens[False][batch])
            del llm, passes
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        for (module, attribute, _, _), value in zip(switches, saved, strict=True):
            setattr(module, attribute, value)
    for batch in batches:
        fused_row, unfused_row = out["fused"][f"bs{batch}"], out["unfused"][f"bs{batch}"]
        same = [a == b for a, b in zip(tokens[True][batch], tokens[False][batch], strict=True)]
        out[f"bs{batch}"] = {"step_ratio_fused_to_unfused": fused_row["median_step_ms"] / unfused_row["median_step_ms"],
                             "sequences_with_the_same_tokens": f"{sum(same)}/{len(same)}"}
        if "graph_replay_ms" in fused_row and "graph_replay_ms" in unfused_row:
            out[f"bs{batch}"]["replay_ratio_fused_to_unfused"] = \
                fused_row["graph_replay_ms"] / unfused_row["graph_replay_ms"]
    return out


def _sample_thread_stacks(ident: int, stop, interval_s: float, out: list) -> None:
    """Append (seconds, innermost-first frame path) of thread `ident` every interval_s until stop is set."""
    import sys

    while not stop.is_set():
        frame = sys._current_frames().get(ident)
        path = []
        while frame is not None and len(path) < 14:
            path.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        out.append((time.perf_counter(), " < ".join(path)))
        time.sleep(interval_s)


def prefill_host(model: Path, settings: dict, lengths: tuple[int, ...] = (8192, 32768), repeats: int = 3) -> dict:
    """Where a prefill's wall time outside the GPU's span goes (issue 18: prefill 32K at 1.46x transformers; session
    20's profile_passes found the GPU busy 548 of the 557 ms between its first and last kernel, against 589 ms of
    wall time). Through the LLM API with `settings` (the issue's rows' engine_speed.llm_settings): per length, one
    profiled run (CPU and CUDA activity in one timeline) gives the host's seconds before the first kernel starts and
    after the last ends, and the CPU ops there; then `repeats` unprofiled runs with the calling thread's Python stack
    sampled every 0.5 ms give the frames of those two windows (at the profiled run's lengths), and the unprofiled
    wall times."""
    import threading
    from collections import Counter

    from headroom.engine.llm import LLM
    from torch.profiler import ProfilerActivity, profile, record_function

    rng = random.Random(7)
    llm = LLM(str(model), **settings)
    out: dict = {}
    for n in lengths:
        prompts = [[rng.randrange(1000, 200000) for _ in range(n)] for _ in range(repeats + 2)]

        def run(prompts=prompts):
            return llm.generate([prompts.pop()], max_new_tokens=1, ignore_eos=True)
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("headroom_generate"):
                run()
            torch.cuda.synchronize()
        events = list(prof.events())
        marker = next(e for e in events if e.name == "headroom_generate")
        t0, t1 = marker.time_range.start, marker.time_range.end
        gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")
                     and not e.name.startswith("Memset"))
        first, last = gpu[0][0], max(end for _, end in gpu)
        pre_ms, post_ms = (first - t0) / 1000, max(0.0, t1 - last) / 1000

        def ops_in(lo: float, hi: float, events: list = events) -> list[dict]:
            cpu = Counter()
            for e in events:
                if e.device_type == torch.autograd.DeviceType.CPU and e.name != "headroom_generate" \
                        and lo <= e.time_range.start and e.time_range.end <= hi:
                    cpu[e.name[:70]] += e.time_range.elapsed_us()
            return [{"name": name, "ms": us / 1000} for name, us in cpu.most_common(12)]

        record = {"profiled_wall_ms": (t1 - t0) / 1000, "host_before_first_kernel_ms": pre_ms,
                  "gpu_span_ms": (last - first) / 1000, "host_after_last_kernel_ms": post_ms,
                  "cpu_ops_before_first_kernel": ops_in(t0, first), "cpu_ops_after_last_kernel": ops_in(last, t1)}
        walls, pre_frames, post_frames = [], Counter(), Counter()
        for _ in range(repeats):
            samples: list = []
            stop = threading.Event()
            sampler = threading.Thread(target=_sample_thread_stacks,
                                       args=(threading.get_ident(), stop, 0.0005, samples), daemon=True)
            torch.cuda.synchronize()
            sampler.start()
            started = time.perf_counter()
            run()
            torch.cuda.synchronize()
            ended = time.perf_counter()
            stop.set()
            sampler.join()
            walls.append((ended - started) * 1000)
            for at, path in samples:
                if started <= at <= started + pre_ms / 1000:
                    pre_frames[path] += 1
                elif ended - post_ms / 1000 <= at <= ended:
                    post_frames[path] += 1
        record.update(wall_ms=walls, tokens_per_s=[n / (w / 1000) for w in walls],
                      frames_before_first_kernel=pre_frames.most_common(12),
                      frames_after_last_kernel=post_frames.most_common(8))
        out[str(n)] = record
    return out
