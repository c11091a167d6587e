"""GPU kernels on real sizes (Qwen3.5-4B attention: 16 q heads, 4 kv heads, head_dim 256): correctness against
naive_*, timings (triton.testing.do_bench, ms) and the paged attention's peak workspace at 32K and 128K.

Run on a CUDA machine: python3 bench/gpu_kernels.py OUT.json  (headroom.kernels importable; fla-core for GDN).
Each section records its own error instead of stopping the rest.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import triton
from headroom.kernels.conv import naive_causal_conv1d_update
from headroom.kernels.conv_update import causal_conv1d_update
from headroom.kernels.gdn_fla import gated_delta_rule_varlen, naive_gated_delta_rule_varlen
from headroom.kernels.kv_quant_triton import fp8_quantize_into, kivi_quantize_pages
from headroom.kernels.paged_attention import naive_paged_attention, paged_attention
from headroom.kernels.paged_kv import PagedKV, naive_fp8_quantize_into, naive_kivi_quantize_pages
from triton.testing import do_bench

HQ, HKV, D, PAGE, GROUP = 16, 4, 256, 32, 32
KINDS = {"bf16": ("dense", 16), "fp8": ("fp8", 8), "int8": ("kivi", 8), "int4": ("kivi", 4), "int2": ("kivi", 2)}
DEV = torch.device("cuda")


def empty_pool(name: str, num_tokens: int) -> PagedKV:
    kind, bits = KINDS[name]
    shape, pages = (num_tokens, HKV, D), num_tokens // PAGE
    if kind == "dense":
        return PagedKV("dense", torch.zeros(shape, dtype=torch.bfloat16, device=DEV), torch.zeros(shape, dtype=torch.bfloat16, device=DEV))
    if kind == "fp8":
        codes = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEV) for _ in range(2)]
        scales = [torch.zeros(shape[:2], device=DEV) for _ in range(2)]
        return PagedKV("fp8", codes[0], codes[1], k_scale=scales[0], v_scale=scales[1])
    packed = (pages, PAGE * bits // 8, HKV, D)
    half = {"device": DEV, "dtype": torch.float16}
    return PagedKV(
        "kivi", torch.zeros(packed, dtype=torch.uint8, device=DEV), torch.zeros(packed, dtype=torch.uint8, device=DEV),
        torch.zeros(pages, HKV, D, **half), torch.zeros(pages, HKV, D, **half),
        torch.zeros(num_tokens, HKV, D // GROUP, **half), torch.zeros(num_tokens, HKV, D // GROUP, **half),
        bits=bits, page_tokens=PAGE, value_group=GROUP,
    )


def filled_pool(name: str, seq_lens: list[int]) -> tuple[PagedKV, torch.Tensor]:
    """Random K/V for each sequence written by the Triton quantizers into shuffled pages; table [B, pages]."""
    page = PAGE if KINDS[name][0] == "kivi" else 1
    pages_per_seq = [-(-n // PAGE) * PAGE // page for n in seq_lens]
    kv = empty_pool(name, sum(pages_per_seq) * page)
    order = torch.randperm(sum(pages_per_seq), device=DEV, dtype=torch.int64).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32, device=DEV)
    start = 0
    for b, num_pages in enumerate(pages_per_seq):
        pages = order[start : start + num_pages]
        table[b, :num_pages] = pages
        start += num_pages
        k = torch.randn(num_pages * page, HKV, D, device=DEV, dtype=torch.bfloat16) * 2
        v = torch.randn(num_pages * page, HKV, D, device=DEV, dtype=torch.bfloat16)
        if kv.kind == "kivi":
            kivi_quantize_pages(k, v, pages, kv)
        elif kv.kind == "fp8":
            fp8_quantize_into(k, pages, kv.k, kv.k_scale)
            fp8_quantize_into(v, pages, kv.v, kv.v_scale)
        else:
            kv.k[pages.long()], kv.v[pages.long()] = k, v
    return kv, table


def attention_args(kv: PagedKV, table: torch.Tensor, seq_lens: list[int], q_lens: list[int]):
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(n - t, n, device=DEV) for n, t in zip(seq_lens, q_lens, strict=True)])
    offsets = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    starts = torch.zeros(len(seq_lens), dtype=torch.int32, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, positions, offsets, table, starts, lens, kv, D**-0.5


def max_error(out, lse, ref, ref_lse) -> dict:
    finite = torch.isfinite(ref_lse)
    return {
        "max_abs_out": (out.float() - ref.float()).abs().max().item(),
        "max_abs_lse": (lse[finite] - ref_lse[finite]).abs().max().item(),
        "all_finite": bool(torch.isfinite(out).all()),
    }


def check_quantizers() -> dict:
    res = {}
    x = torch.randn(8191, HKV, D, device=DEV, dtype=torch.bfloat16) * torch.logspace(-5, 2, D, device=DEV).bfloat16()
    slots = torch.randperm(8192, device=DEV)[:8191].to(torch.int32)
    pool, ref = empty_pool("fp8", 8192), empty_pool("fp8", 8192)
    fp8_quantize_into(x, slots, pool.k, pool.k_scale)
    naive_fp8_quantize_into(x, slots, ref.k, ref.k_scale)
    res["fp8_bit_exact"] = bool(torch.equal(pool.k.view(torch.uint8), ref.k.view(torch.uint8)) and torch.equal(pool.k_scale, ref.k_scale))
    res["fp8_write_8191_tokens_ms"] = do_bench(lambda: fp8_quantize_into(x, slots, pool.k, pool.k_scale))
    for name in ("int8", "int4", "int2"):
        pool, ref = empty_pool(name, 8192), empty_pool(name, 8192)
        k, v = x[:8192 - 64], torch.randn(8192 - 64, HKV, D, device=DEV, dtype=torch.bfloat16)
        pages = torch.randperm(256, device=DEV)[:254].to(torch.int32)
        kivi_quantize_pages(k, v, pages, pool)
        naive_kivi_quantize_pages(k, v, pages, ref)
        same = all(torch.equal(getattr(pool, n), getattr(ref, n)) for n in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"))
        res[f"{name}_bit_exact"] = same
        res[f"{name}_write_8128_tokens_ms"] = do_bench(lambda: kivi_quantize_pages(k, v, pages, pool))  # noqa: B023
    return res


def check_page_close(tokens: int = 16) -> dict:
    """The page close inside qk_norm_rotary_store (a graphed KIVI decode step's, paged_kv.PageClose) at the 4B
    model's heads: `tokens` sequences' tokens stored into their window rows (rows in another order than the
    sequences), every other one at its page's last slot, so that its row closes into a pool page; the pool against
    naive_close_pages on the windows the launch left, bit for bit, and on the GPU the launch's ms with and without
    the close (the separate close launch it replaces was 0.019 ms a step for 8 layers at batch 1)."""
    from headroom.kernels.paged_kv import PageClose, naive_close_pages
    from headroom.kernels.rotary import rotary_inv_freq
    from headroom.kernels.rotary_triton import qk_norm_rotary_store

    res: dict = {}
    bf = torch.bfloat16
    q = torch.randn(tokens, 16, D, device=DEV, dtype=bf)
    k, v = (torch.randn(tokens, HKV, D, device=DEV, dtype=bf) for _ in range(2))
    wq, wk = (torch.randn(D, device=DEV, dtype=bf) * 0.1 for _ in range(2))
    inv = rotary_inv_freq(64, 1e7).to(DEV)
    order = torch.arange(tokens, device=DEV)
    offsets = torch.where(order % 2 == 0, PAGE - 1, order % (PAGE - 1))
    rows = torch.randperm(tokens, device=DEV)
    positions, slots = 40 * PAGE + offsets, rows * PAGE + offsets
    for name in ("int8", "int4", "int2"):
        pool, ref = empty_pool(name, 8192), empty_pool(name, 8192)
        pages = torch.where(offsets == PAGE - 1, torch.randperm(8192 // PAGE, device=DEV)[:tokens], -1)
        windows = [torch.randn(tokens * PAGE, HKV, D, device=DEV, dtype=bf) for _ in range(2)]
        close = PageClose(pool, rows, pages)

        def store(close=close, windows=windows):
            return qk_norm_rotary_store(q, k, v, wq, wk, 1e-6, True, positions, inv, *windows, slots, close=close)

        store()
        naive_close_pages(PageClose(ref, rows, pages), *windows)
        res[f"{name}_bit_exact"] = all(torch.equal(getattr(pool, n), getattr(ref, n))
                                       for n in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"))
        res[f"{name}_pages_closed"] = int((pages >= 0).sum())
        if DEV.type == "cuda":
            res[f"{name}_ms"] = do_bench(store)
            res[f"{name}_without_close_ms"] = do_bench(lambda windows=windows: store(None, windows))
    return res


def check_attention() -> dict:
    res: dict = {}
    for name in KINDS:
        # Odd lengths, several sequences in one launch: decode and an extend chunk.
        for label, seq_lens, q_lens in (("decode_b3", [8191, 32771, 1001], [1, 1, 1]), ("extend_b2", [8193, 32767], [257, 63])):
            args = attention_args(*filled_pool(name, seq_lens), seq_lens, q_lens)
            res[f"{name}_{label}"] = max_error(*paged_attention(*args), *naive_paged_attention(*args))
    for name in ("bf16", "int2"):
        seq_lens = [131071]
        args = attention_args(*filled_pool(name, seq_lens), seq_lens, [64])
        res[f"{name}_extend_131071"] = max_error(*paged_attention(*args), *naive_paged_attention(*args))
    res.update(check_kivi_chunks())
    res.update(check_half_tiles())
    res["gated_merge"] = check_gated_merge()
    return res


def check_gated_merge(tokens: int = 16) -> dict:
    """The split merge with Qwen3.5's output gate (kernels/attention_merge_triton.py, GATE) against sigmoid_mul of
    the ungated merge (the unfused layer), bit for bit, at a decode step's shape (32 splits, 16 query heads of 256);
    the gated merge's ms against the ungated merge plus sigmoid_mul."""
    from headroom.kernels.attention_merge_triton import merge_splits_into
    from headroom.kernels.gates_triton import sigmoid_mul

    parts = torch.randn(32, tokens, HQ, D, device=DEV)
    lses = torch.randn(32, tokens, HQ, device=DEV) * 3
    lses[5:] = float("-inf")  # splits past the keys (a short context's), as a graphed step meets them
    gate = (torch.randn(tokens, HQ, 2 * D, device=DEV) * 2).bfloat16()[..., D:]
    plain, gated = (torch.empty(tokens, HQ, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.empty(tokens, HQ, device=DEV)

    def unfused():
        merge_splits_into(parts, lses, plain, lse)
        return sigmoid_mul(plain.view(tokens, -1), gate)

    want = unfused()
    merge_splits_into(parts, lses, gated, lse, gate)
    return {"bit_exact": bool(torch.equal(gated.view(tokens, -1), want)),
            "gated_merge_ms": do_bench(lambda: merge_splits_into(parts, lses, gated, lse, gate)),
            "merge_then_sigmoid_mul_ms": do_bench(unfused)}


def time_split_merges() -> dict:
    """The gated split merge at a graphed decode step's shapes (16 query heads of 256; splits as default_num_splits
    gives them: bf16 32 / 8 / 4 at batch 1 / 8 / 16, an int2 pool's 64 / 8 / 4 and its window one more), us a
    launch replayed in a CUDA graph (do_bench's launches would time the host), each against merge_attention_states'
    answer. Run it with this tree and with .old's kernels/attention_merge_triton.py for an A/B."""
    from headroom.kernels.attention_merge import merge_attention_states
    from headroom.kernels.attention_merge_triton import merge_splits_into
    from headroom.kernels.gates_triton import sigmoid_mul
    from triton.testing import do_bench_cudagraph

    res: dict = {}
    for tokens, splits in ((1, 32), (1, 65), (8, 8), (8, 9), (16, 4), (16, 5)):
        parts = torch.randn(splits, tokens, HQ, D, device=DEV)
        lses = torch.randn(splits, tokens, HQ, device=DEV) * 3
        gate = (torch.randn(tokens, HQ, 2 * D, device=DEV) * 2).bfloat16()[..., D:]
        out = torch.empty(tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
        lse = torch.empty(tokens, HQ, device=DEV)
        merge_splits_into(parts, lses, out, lse, gate)
        want, want_lse = merge_attention_states(parts, lses, torch.bfloat16)
        want = sigmoid_mul(want.view(tokens, -1), gate).view(tokens, HQ, D)
        res[f"bs{tokens}_splits{splits}"] = {
            "us": 1000 * do_bench_cudagraph(lambda: merge_splits_into(parts, lses, out, lse, gate)),  # noqa: B023
            "max_abs_err": (out.float() - want.float()).abs().max().item(),
            "lse_max_abs_err": (lse - want_lse).abs().max().item()}
    return res


# The decode sweep's KIVI decode variants (kernels/kivi_decode.py, off by default; the general kernel with its loads
# plain, against the defaults load_per_token and magic_register): each against naive_paged_attention at real sizes
# before its timings count.
KIVI_DECODE_VARIANTS = ({"d_chunks": 2}, {"d_chunks": 4, "max_registers": 168}, {"d_chunks": 2, "magic_register": 1},
                        {"load_per_token": 0, "magic_register": 0})


def check_kivi_chunks() -> dict:
    from headroom.kernels import paged_attention as pa

    res: dict = {}
    for name in ("int2", "int4"):
        seq_lens = [8191, 32771, 1001]
        args = attention_args(*filled_pool(name, seq_lens), seq_lens, [1, 1, 1])
        want = naive_paged_attention(*args)
        for variant in KIVI_DECODE_VARIANTS:
            with pa.tuned(decode=variant):
                key = "_".join(f"{k}{v}" for k, v in variant.items())
                res[f"{name}_decode_b3_{key}"] = max_error(*paged_attention(*args), *want)
    return res


def check_half_tiles() -> dict:
    """fp16 KIVI tiles (half_tiles: the codes by inline PTX, which the CPU tests cannot run) against
    naive_paged_attention at real sizes, decode and extend, every code width."""
    from headroom.kernels import paged_attention as pa

    res: dict = {}
    for name in ("int2", "int4", "int8"):
        for label, seq_lens, q_lens in (("decode_b3", [8191, 32771, 1001], [1, 1, 1]),
                                        ("extend_b2", [8193, 32767], [257, 63])):
            args = attention_args(*filled_pool(name, seq_lens), seq_lens, q_lens)
            want = naive_paged_attention(*args)
            with pa.tuned(extend={"half_tiles": 1}, decode={"half_tiles": 1}):
                res[f"{name}_{label}_half_tiles1"] = max_error(*paged_attention(*args), *want)
    return res


def check_fused_gemv(cases: int = 12, seed: int = 2) -> dict:
    """The decode GEMV's fused modes (kernels/gemv.py NORM, RESIDUAL, GATED; session 18; CONV, 19) against the unfused kernels
    they replace, compiled on this GPU, over random configurations (rows 1-16, splits, swapped and CUDA-core tiles,
    tiles loaded before the PDL wait, ragged K): normed_gemv against rms_norm then gemv, residual_gemv (plain and with
    SiLU) against the add after gemv (equal bit for bit: the same product, rounded, then the add), its sums of squares
    against fp32's, gated_gemv (and with the residual) against gated_rms_norm then gemv, residual_prescaled_gemv against
    residual_gemv (bit for bit) and its prescaled rows against r * (1 + g), normed_gemv of those rows (RowNorm
    prescaled: the 1 / rms on its output rows) against its reference and, within 2% of the outputs' scale, against
    rms_norm then gemv. A case is "bad" where more
    than 2% of the outputs differ or one differs by more than 5% of its size (the 1 / rms summed in another order
    may move a rounding, not more); a race between programs would show as either."""
    import random

    from headroom.kernels.conv_update import causal_conv1d_update
    from headroom.kernels.gates_triton import silu_mul
    from headroom.kernels.gemv import (
        ConvStep,
        GatedNorm,
        GemvConfig,
        NextNorm,
        RowNorm,
        conv_gemv,
        gated_gemv,
        gated_gemv_fits,
        gemv,
        naive_normed_gemv,
        normed_gemv,
        residual_gemv,
        residual_prescaled_gemv,
    )
    from headroom.kernels.norm_triton import gated_rms_norm, rms_norm

    rng = random.Random(seed)
    torch.manual_seed(seed)
    bad: list[dict] = []
    worst = {"max_abs": 0.0, "frac_differing": 0.0}

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV) * scale).bfloat16()

    def compare(name: str, got, want, exact: bool = False, rounded_apart: bool = False) -> None:
        """rounded_apart: the inputs are rounded at another point (not the bits of the unfused path), so any share
        of the outputs may differ in a last bit: only the 5% bound holds."""
        diff = (got.float() - want.float()).abs()
        differing = float((got != want).float().mean())
        relative = float((diff / (want.float().abs() + 1e-2)).max())
        worst["max_abs"] = max(worst["max_abs"], float(diff.max()))
        if not rounded_apart:
            worst["frac_differing"] = max(worst["frac_differing"], differing)
        if (exact and differing > 0) or relative > 0.05 or (differing > 0.02 and not rounded_apart):
            bad.append({"case": name, "max_abs": float(diff.max()), "relative": relative, "differing": differing})

    for case in range(cases):
        m, n = rng.choice([1, 2, 3, 5, 8, 9, 16]), rng.choice([40, 130, 520])
        k = rng.choice([256, 328, 512, 1024, 1536])
        config = GemvConfig(block_n=rng.choice([8, 16, 64]), block_k=rng.choice([64, 128, 256, 512]),
                            split=rng.choice([1, 2, 3]), num_stages=2, swap_ab=rng.random() < 0.5,
                            rows_on_cores=rng.random() < 0.5, prefetch=rng.choice([1, 2]),
                            l2_prefetch=rng.choice([0, 2, 4]))
        tag = f"{case}: m={m} n={n} k={k} {config}"
        w, x, residual = rand(n, k, scale=0.05), rand(m, k, scale=2), rand(m, n, scale=2)
        wide = rand(m, 2 * k)
        for unit_offset in (True, False):
            weight, squares = rand(k, scale=0.3), x.float().pow(2).sum(1, keepdim=True).contiguous()
            compare(f"{tag} norm {unit_offset}", normed_gemv(x, RowNorm(squares, weight, 1e-6, unit_offset), w, config),
                    gemv(rms_norm(x, weight, 1e-6, unit_offset)[0], w, config))
        summed, parts = residual_gemv(x, w, residual, config)
        compare(f"{tag} residual", summed, residual + gemv(x, w, config), exact=True)
        blocks = -(-n // config.block_n)
        padded = torch.nn.functional.pad(summed.float(), (0, blocks * config.block_n - n))
        want_parts = padded.pow(2).view(m, blocks, -1).sum(-1)
        if parts.shape != (m, blocks) or not torch.allclose(parts, want_parts, rtol=1e-4, atol=1e-3):
            bad.append({"case": f"{tag} sums of squares", "max_abs": float((parts - want_parts).abs().max())})
        summed, _ = residual_gemv(x, w, residual, config, up=wide[:, k:])
        compare(f"{tag} residual silu", summed, residual + gemv(silu_mul(x, wide[:, k:]), w, config), exact=True)
        # the next norm factored out of the next projection (residual.PRESCALED_NORM): the weighted sum, then a
        # GEMV of it (w.T: n in, k out) scaled by the rows' 1 / rms, against rms_norm of the sum then the GEMV
        following = NextNorm(rand(n, scale=0.3), True)
        pre_summed, pre_parts, scaled = residual_prescaled_gemv(x, w, residual, following, config)
        compare(f"{tag} prescaled sum", pre_summed, residual + gemv(x, w, config), exact=True)
        compare(f"{tag} prescaled rows", scaled, (pre_summed.float() * (1 + following.weight.float())).bfloat16(),
                exact=True)
        w_next = w.T.contiguous()
        prescaled = RowNorm(pre_parts, following.weight, 1e-6, True, True)
        got = normed_gemv(scaled, prescaled, w_next, config)
        # against its own reference (the same rows: fp32 order and the one output rounding apart), and against the
        # unfused path within 2% of the output's scale (every input is rounded at another point, so an output near
        # zero may move by more than 5% of itself)
        compare(f"{tag} prescaled next", got, naive_normed_gemv(scaled, prescaled, w_next), rounded_apart=True)
        unfused = gemv(rms_norm(pre_summed, following.weight, 1e-6, True)[0], w_next, config)
        apart = float((got.float() - unfused.float()).abs().max())
        if apart > 0.02 * float(unfused.float().abs().max()):
            bad.append({"case": f"{tag} prescaled next against the unfused path", "max_abs": apart})
        head = rng.choice([32, 64, 128])
        if gated_gemv_fits(k, head, config):
            gate = wide[:, :k]
            gated = GatedNorm(gate, (1 + 0.2 * torch.randn(head, device=DEV)).bfloat16(), 1e-6)
            normed = gated_rms_norm(x.view(m, -1, head), gate.view(m, -1, head), gated.weight, 1e-6).reshape(m, k)
            compare(f"{tag} gated {head}", gated_gemv(x, gated, w, config), gemv(normed, w, config))
            summed, _ = residual_gemv(x, w, residual, config, gated=gated)
            compare(f"{tag} residual gated {head}", summed, residual + gemv(normed, w, config))
        # CONV (session 19): the first channels through the decode conv step, against the GEMV then the conv
        # kernel, output and rolled states bit for bit (a store of one thread reaching another's load of the
        # same state would show here)
        channels, taps = rng.choice([n // 2, n]), rng.choice([2, 4])
        states = rand(2 * m + 3, channels, taps - 1)
        conv = ConvStep(rand(channels, taps), states.clone(), torch.randperm(2 * m + 3, device=DEV)[:m])
        kept = states.clone()
        want = gemv(x, w, config)
        want[:, :channels] = causal_conv1d_update(want[:, :channels].contiguous(), conv.weight, kept, conv.slots)
        compare(f"{tag} conv {channels}x{taps}", conv_gemv(x, w, conv, config), want, exact=True)
        compare(f"{tag} conv states", conv.states, kept, exact=True)
    return {"cases": cases, "bad": bad[:40], "bad_count": len(bad), "worst": worst}


def time_attention() -> dict:
    res: dict = {}
    for name in KINDS:
        for context in (8192, 32768, 131072):
            kv, table = filled_pool(name, [context])
            args = attention_args(kv, table, [context], [1])
            ms = do_bench(lambda: paged_attention(*args, max_q_len=1))  # noqa: B023
            pool_bytes = sum(t.numel() * t.element_size() for t in (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero) if t is not None)
            res[f"{name}_decode_b1_{context}"] = {"ms": ms, "pool_GBps": pool_bytes / ms / 1e6}
            chunk = 2048
            args = attention_args(kv, table, [context], [chunk])
            ms = do_bench(lambda: paged_attention(*args, max_q_len=chunk))  # noqa: B023
            # Causal chunk at the end of the context: query i sees context - chunk + i + 1 keys; 4 flops per key-dim.
            flops = 4 * HQ * D * sum(context - chunk + i + 1 for i in range(chunk))
            res[f"{name}_chunk{chunk}_{context}"] = {"ms": ms, "TFLOPs": flops / ms / 1e9}
        for batch in (8, 32):
            kv, table = filled_pool(name, [32768] * batch)
            args = attention_args(kv, table, [32768] * batch, [1] * batch)
            res[f"{name}_decode_b{batch}_32768"] = {"ms": do_bench(lambda: paged_attention(*args, max_q_len=1))}  # noqa: B023
    # Baseline: torch SDPA (flash) decode over a dense contiguous bf16 prefix.
    for context in (8192, 32768, 131072):
        q = torch.randn(1, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
        k, v = (torch.randn(1, HKV, context, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        res[f"torch_sdpa_dense_decode_b1_{context}"] = {"ms": do_bench(lambda: sdpa(q, k, v, enable_gqa=True))}  # noqa: B023
    return res


def peak_workspace() -> dict:
    res: dict = {}
    for name in ("int2", "int4", "bf16"):
        for context in (32768, 131072):
            kv, table = filled_pool(name, [context])
            for chunk in (1, 2048):
                args = attention_args(kv, table, [context], [chunk])
                paged_attention(*args, max_q_len=chunk)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                out, lse = paged_attention(*args, max_q_len=chunk)
                torch.cuda.synchronize()
                res[f"{name}_chunk{chunk}_{context}"] = {
                    "peak_above_inputs_bytes": torch.cuda.max_memory_allocated() - base,
                    "output_bytes": out.numel() * out.element_size() + lse.numel() * lse.element_size(),
                    "dense_bf16_prefix_bytes_avoided": context * HKV * D * 2 * 2,
                }
                del out, lse
    return res


def check_gdn() -> dict:
    res: dict = {}
    hk, hv, dk, dv = 16, 32, 128, 128
    for label, lens in (("decode_b8", [1] * 8), ("prefill_varlen", [1000, 1, 333])):
        n = sum(lens)
        q, k = (torch.randn(n, hk, dk, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(n, hv, dv, device=DEV, dtype=torch.bfloat16)
        g = -torch.rand(n, hv, device=DEV) * 0.5
        beta = torch.rand(n, hv, device=DEV).bfloat16()
        states = torch.randn(len(lens), hv, dk, dv, device=DEV) * 0.05
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
        out, final = gated_delta_rule_varlen(q, k, v, g, beta, states, cu)
        ref, ref_final = naive_gated_delta_rule_varlen(q, k, v, g, beta, states, cu)
        res[label] = {"max_abs_out": (out.float() - ref.float()).abs().max().item(),
                      "max_abs_state": (final - ref_final).abs().max().item()}
    for label, lens in (("prefill_8192", [8192]), ("decode_b32", [1] * 32)):
        n = sum(lens)
        q, k = (torch.randn(n, hk, dk, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(n, hv, dv, device=DEV, dtype=torch.bfloat16)
        g, beta = -torch.rand(n, hv, device=DEV) * 0.5, torch.rand(n, hv, device=DEV).bfloat16()
        states = torch.zeros(len(lens), hv, dk, dv, device=DEV)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
        res[f"{label}_ms"] = do_bench(lambda: gated_delta_rule_varlen(q, k, v, g, beta, states, cu))  # noqa: B023
    channels, width = 2 * hk * dk + hv * dv, 4
    x = torch.randn(32, channels, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(channels, width, device=DEV, dtype=torch.bfloat16)
    conv_states = torch.randn(64, channels, width - 1, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(64, device=DEV)[:32].to(torch.int32)
    ref_states = conv_states.clone()
    out = causal_conv1d_update(x, weight, conv_states, slots)
    ref = naive_causal_conv1d_update(x, weight, ref_states, slots)
    res["conv_update_b32"] = {"max_abs_out": (out.float() - ref.float()).abs().max().item(),
                              "states_equal": bool(torch.equal(conv_states, ref_states)),
                              "ms": do_bench(lambda: causal_conv1d_update(x, weight, conv_states, slots))}
    return res


def main(path: str) -> None:
    torch.manual_seed(0)
    report: dict = {
        "command": os.environ.get("BENCH_COMMAND", " ".join(sys.argv)),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "kivi_page": PAGE, "value_group": GROUP},
    }
    for section in (check_quantizers, check_page_close, check_attention, peak_workspace, time_attention, check_gdn):
        began = time.time()
        try:
            report[section.__name__] = section()
        except Exception:  # noqa: BLE001
            report[section.__name__] = {"error": traceback.format_exc()[-3000:]}
        report[section.__name__ + "_seconds"] = round(time.time() - began, 1)
        print(section.__name__, json.dumps(report[section.__name__], indent=1)[:4000], flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_kernels.json")
