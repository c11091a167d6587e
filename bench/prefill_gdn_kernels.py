"""Gated DeltaNet prefill kernels at the 4B model's shapes (issue 18: 11 ms off an 8,192-token prefill): the
conv's q | k | v planes with the fused q/k L2 norm and the row-block gated RMSNorm against their naive_*
references and against the kernels they replace, plus the config sweeps that pick their defaults.

For 8,192 and 32,768 tokens as one sequence and as four of varied lengths:
- conv: error of causal_conv1d_varlen_qkv (norm fused) against naive_causal_conv1d_varlen_qkv (bf16 ulps, states
  exact), and ms of the old path (the previous kernel, a strided [N, C] output, two l2_norm, and the copy of v
  fla's input_guard made), of the new one, of the new planes with the separate l2_norm, and of the reference;
  the rows kernel (ROWS_CONFIG) against the tile kernel (rows_vs_tile: bit-equal or not, ulps) and its ms;
- gated_norm: error against naive_gated_rms_norm, ms of the old one-row kernel (with the copy of the strided z its
  reshape made) and of the new one; decode-sized row counts too;
- sweep (8,192 tokens, one sequence): every (BLOCK_T, BLOCK_C, num_warps[, variant]) of the conv (both kernels:
  conv_best overall, conv_best_tile, conv_best_rows) and (BLOCK_R, num_warps) of the gated norm, ms each: the
  fastest become conv_varlen.DEFAULT_CONFIG and norm_triton.GATED_CONFIG;
- fla: fla's chunked rule on the old inputs (strided v, separate l2_norm) and the new (contiguous planes, normed).
The JSON is rewritten after every measurement; sections past the deadline (75 s after the imports) are skipped, and say so.

On the H200 (repo root):  source bench/device_env.sh && python3 bench/prefill_gdn_kernels.py OUT.json
On the CPU (tiny shapes, Triton interpreter, fp32): python3 bench/prefill_gdn_kernels.py --cpu OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

CPU = "--cpu" in sys.argv
if CPU:
    # Read by triton.jit when the kernel modules are imported below.
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from headroom.kernels.conv import naive_causal_conv1d_varlen, naive_causal_conv1d_varlen_qkv  # noqa: E402
from headroom.kernels.conv_varlen import (  # noqa: E402
    DEFAULT_CONFIG,
    TILE_CONFIG,
    _store_new_state,
    _window_input,
    causal_conv1d_varlen,
    causal_conv1d_varlen_qkv,
)
from headroom.kernels.norm import naive_gated_rms_norm  # noqa: E402
from headroom.kernels.norm_triton import GATED_CONFIG, GATED_FEW_ROWS_CONFIG, gated_rms_norm, l2_norm  # noqa: E402

DEV = torch.device("cpu" if CPU else "cuda")
DTYPE = torch.float32 if CPU else torch.bfloat16
# 4B model: 16 q/k heads and 32 v heads of 128, conv width 4; z and b|a follow q|k|v in the merged projection.
HK, HV, D, KERNEL = (2, 4, 16, 4) if CPU else (16, 32, 128, 4)
KEY_DIM, CHANNELS = HK * D, 2 * HK * D + HV * D
PROJ_WIDTH = CHANNELS + HV * D + 2 * HV
TOKENS = (40, 70) if CPU else (8192, 32768)
EPS = 1e-6
# The whole run must end within 90 s, imports and CUDA start included.
DEADLINE_S = 75.0
# (BLOCK_T, BLOCK_C, num_warps[, variant]); BLOCK_C >= 128: the fused norm needs whole 128-channel heads in a block.
# The tile kernel's (session 10's best five; the rest were 0.19-2.7 ms) first, then the rows kernel's (each input
# row loaded once): BLOCK_C / (32 num_warps) = 8 channels a thread (126 registers at sm_90, ptxas) or 4 (80).
ROWS_CONFIG = (64, 128, 4, "rows") if CPU else (64, 1024, 4, "rows")
CONV_SWEEP = [(32, 128, 4), ROWS_CONFIG] if CPU else [
    (32, 128, 2), (64, 128, 4), (32, 256, 4),
    (16, 1024, 4, "rows"), (32, 1024, 4, "rows"), (64, 1024, 4, "rows"), (128, 1024, 4, "rows"),
    (32, 512, 4, "rows"), (64, 512, 4, "rows"), (128, 512, 4, "rows"), (64, 256, 2, "rows"), (64, 2048, 8, "rows"),
    (16, 256, 4), (32, 128, 4)]
# (BLOCK_R, num_warps)
NORM_SWEEP = [(4, 2)] if CPU else [(r, w) for r in (4, 8, 16, 32, 64) for w in (2, 4, 8)] + [(1, 4), (2, 4)]
START = time.perf_counter()


@triton.jit
def legacy_conv_kernel(
    x, weight, states, slots, offsets, out, new_states, stride_x, stride_wc, stride_ss, stride_sc, stride_o,
    stride_nb, stride_nc, CHANNELS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """kernels/conv_varlen.py's kernel before the q | k | v planes (commit aea9637), for the old-path timing."""
    i_b, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(offsets + i_b).to(tl.int32)
    length = tl.load(offsets + i_b + 1).to(tl.int32) - row0
    t0 = i_t * BLOCK_T
    if t0 >= length:
        return
    slot = tl.load(slots + i_b).to(tl.int64)
    o_t = t0 + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < CHANNELS
    m = (o_t < length)[:, None] & m_c[None, :]
    b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        b_in = _window_input(x, states, row0, slot, o_t - (KERNEL - 1) + j, o_c, m, stride_x, stride_ss, stride_sc,
                             KERNEL)
        b_w = tl.load(weight + o_c * stride_wc + j, mask=m_c, other=0).to(tl.float32)
        b_acc += b_in * b_w[None, :]
    b_out = b_acc / (1.0 + tl.exp(-b_acc))
    tl.store(out + (row0 + o_t)[:, None].to(tl.int64) * stride_o + o_c[None, :], b_out.to(out.dtype.element_ty),
             mask=m)
    if t0 + BLOCK_T >= length:
        _store_new_state(x, states, new_states, row0, slot, length, i_b, o_c, m_c, stride_x, stride_ss, stride_sc,
                         stride_nb, stride_nc, KERNEL, BLOCK_S)


def legacy_conv(x, weight, states, slots, cu, max_len):
    out = torch.empty_like(x)
    new_states = states.new_empty((slots.shape[0], CHANNELS, KERNEL - 1))
    grid = (slots.shape[0], triton.cdiv(max_len, 32), triton.cdiv(CHANNELS, 128))
    legacy_conv_kernel[grid](
        x, weight, states, slots, cu, out, new_states, x.stride(0), weight.stride(0), states.stride(0),
        states.stride(1), out.stride(0), new_states.stride(0), new_states.stride(1), CHANNELS=CHANNELS,
        KERNEL=KERNEL, BLOCK_T=32, BLOCK_C=128, BLOCK_S=triton.next_power_of_2(KERNEL - 1), num_warps=4)
    states[slots] = new_states
    return out


@triton.jit
def legacy_gated_norm_kernel(x, gate, weight, out, stride_x, stride_g, dim, eps, BLOCK_D: tl.constexpr):
    """kernels/norm_triton.py's gated_rms_norm_fwd_kernel before row blocks: one row a program."""
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    b_x = tl.load(x + i_r * stride_x + o_d, mask=m_d, other=0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 0) / dim + eps)
    b_w = tl.load(weight + o_d, mask=m_d, other=0).to(tl.float32)
    b_y = ((b_x * rstd).to(out.dtype.element_ty).to(tl.float32) * b_w).to(out.dtype.element_ty).to(tl.float32)
    b_g = tl.load(gate + i_r * stride_g + o_d, mask=m_d, other=0).to(tl.float32)
    b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
    tl.store(out + i_r * dim + o_d, b_y.to(out.dtype.element_ty), mask=m_d)


def legacy_gated_norm(x, gate, weight):
    # The old wrapper's reshape: a strided z is copied whole here.
    x2, g2 = x.reshape(-1, D), gate.reshape(-1, D)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    legacy_gated_norm_kernel[(x2.shape[0],)](x2, g2, weight, out, x2.stride(0), g2.stride(0), D, EPS,
                                             BLOCK_D=triton.next_power_of_2(D))
    return out


def left_s() -> float:
    return DEADLINE_S - (time.perf_counter() - START)


def timed_ms(fn) -> float:
    """do_bench's median on CUDA (short runs: the sweep has many entries); one call on the CPU."""
    if CPU:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=5, rep=25)


def ulp_error(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Max abs error and max error in bf16 ulps of the reference (2^(exponent - 7)); within_bf16: <= 2 ulps."""
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-100))) - 7)
    ulps = (diff / ulp).max().item() if diff.numel() else 0.0
    return {"max_abs": diff.max().item() if diff.numel() else 0.0, "max_bf16_ulps": ulps, "within_bf16": ulps <= 2,
            "share_over_1_ulp": (diff > ulp).float().mean().item() if diff.numel() else 0.0}


def scenario(tokens: int, num_seqs: int) -> dict:
    """Inputs as the layer sees them: x and z column slices of one projection output, pool states, slots."""
    gen = torch.Generator(device=DEV).manual_seed(tokens + num_seqs)
    lengths = [tokens] if num_seqs == 1 else [tokens // 2, tokens // 4 + 3, 2, tokens - tokens // 2 - tokens // 4 - 5]
    proj = torch.randn(tokens, PROJ_WIDTH, device=DEV, dtype=DTYPE, generator=gen)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return {
        "lengths": lengths, "x": proj[:, :CHANNELS], "z": proj[:, CHANNELS : CHANNELS + HV * D].view(tokens, HV, D),
        "core": torch.randn(tokens, HV, D, device=DEV, dtype=DTYPE, generator=gen),
        "weight": (torch.randn(CHANNELS, KERNEL, device=DEV, generator=gen) * 0.5).to(DTYPE),
        "norm_weight": (1 + 0.1 * torch.randn(D, device=DEV, generator=gen)).to(DTYPE),
        "states": torch.randn(8, CHANNELS, KERNEL - 1, device=DEV, dtype=DTYPE, generator=gen),
        "slots": torch.tensor([3, 0, 5, 1][:num_seqs], device=DEV),
        "cu": torch.tensor(bounds, device=DEV),
    }


def rows_vs_tile(s: dict, tile_qkv) -> dict:
    """The rows kernel (ROWS_CONFIG) against the tile kernel (TILE_CONFIG): one matrix unnormed, states, and the normed
    q | k | v planes (tile_qkv, the tile kernel's)."""
    x, w, slots, cu, max_len = s["x"], s["weight"], s["slots"], s["cu"], max(s["lengths"])
    tile_states, rows_states = s["states"].clone(), s["states"].clone()
    tile = causal_conv1d_varlen(x, w, tile_states, slots, cu, max_len, config=TILE_CONFIG)
    rows = causal_conv1d_varlen(x, w, rows_states, slots, cu, max_len, config=ROWS_CONFIG)
    res = {"unnormed_bit_equal": bool(torch.equal(rows, tile)),
           "states_bit_equal": bool(torch.equal(rows_states, tile_states)), "unnormed": ulp_error(rows, tile)}
    rows_qkv = causal_conv1d_varlen_qkv(x, w, s["states"].clone(), slots, cu, max_len, KEY_DIM, D, EPS,
                                        config=ROWS_CONFIG)
    for name, g, t in zip("qkv", rows_qkv, tile_qkv, strict=True):
        res[f"{name}_bit_equal"] = bool(torch.equal(g, t))
        res[name] = ulp_error(g, t)
    return res


def conv_section(s: dict) -> dict:
    x, w, slots, cu, lengths = s["x"], s["weight"], s["slots"], s["cu"], s["lengths"]
    max_len = max(lengths)
    ref_states, states = s["states"].clone(), s["states"].clone()
    want = naive_causal_conv1d_varlen_qkv(x, w, ref_states, slots, lengths, KEY_DIM, D, EPS)
    got = causal_conv1d_varlen_qkv(x, w, states, slots, cu, max_len, KEY_DIM, D, EPS)
    res = {name: ulp_error(g, r) for name, g, r in zip("qkv", got, want, strict=True)}
    res["states_exact"] = bool(torch.equal(states, ref_states))
    plain_states = s["states"].clone()
    res["planes_unnormed"] = ulp_error(causal_conv1d_varlen(x, w, plain_states, slots, cu, max_len),
                                       naive_causal_conv1d_varlen(x, w, s["states"].clone(), slots, lengths))
    # The rows kernel against the tile kernel (the default config): the unnormed outputs and states should be
    # bit-equal (the same taps in the same order); the normed q/k may differ where the heads' sums of squares are
    # reduced in another order (the two kernels' register layouts differ). On the CPU (the interpreter runs the rows
    # kernel's per-row steps slowly: ~2 s a call) only for the shorter tokens' several sequences, so that the whole
    # run keeps its deadline.
    if not CPU or (len(lengths) > 1 and x.shape[0] == TOKENS[0]):
        res["rows_vs_tile"] = rows_vs_tile(s, causal_conv1d_varlen_qkv(x, w, s["states"].clone(), slots, cu, max_len,
                                                                      KEY_DIM, D, EPS, config=TILE_CONFIG))
    legacy_states = s["states"].clone()
    res["legacy_vs_new_unnormed"] = ulp_error(legacy_conv(x, w, legacy_states, slots, cu, max_len),
                                              causal_conv1d_varlen(x, w, s["states"].clone(), slots, cu, max_len))

    def old_path():
        out = legacy_conv(x, w, states, slots, cu, max_len)
        q, k, v = out.split([KEY_DIM, KEY_DIM, HV * D], dim=-1)
        return l2_norm(q.view(-1, HK, D), EPS), l2_norm(k.view(-1, HK, D), EPS), v.contiguous()

    def planes_then_l2():
        q, k, v = causal_conv1d_varlen_qkv(x, w, states, slots, cu, max_len, KEY_DIM, 0)
        return l2_norm(q.view(-1, HK, D), EPS), l2_norm(k.view(-1, HK, D), EPS), v

    res["ms"] = {
        "old_conv_l2norm_vcopy": timed_ms(old_path),
        "old_conv_kernel_only": timed_ms(lambda: legacy_conv(x, w, states, slots, cu, max_len)),
        "new_fused_norm": timed_ms(lambda: causal_conv1d_varlen_qkv(x, w, states, slots, cu, max_len, KEY_DIM, D, EPS)),
        "new_planes_then_l2_norm": timed_ms(planes_then_l2),
        "new_one_matrix": timed_ms(lambda: causal_conv1d_varlen(x, w, states, slots, cu, max_len)),
        "naive_torch": timed_ms(lambda: naive_causal_conv1d_varlen_qkv(x, w, states, slots, lengths, KEY_DIM, D, EPS)),
    }
    if not CPU:
        res["ms"]["rows_fused_norm"] = timed_ms(lambda: causal_conv1d_varlen_qkv(
            x, w, states, slots, cu, max_len, KEY_DIM, D, EPS, config=ROWS_CONFIG))
    moved = 2 * x.numel() * x.element_size()
    res["new_fused_norm_share_of_4_8_TBps"] = moved / (res["ms"]["new_fused_norm"] * 1e-3) / 4.8e12
    return res


def gated_norm_section(s: dict) -> dict:
    core, z, w = s["core"], s["z"], s["norm_weight"]
    res = {"error": ulp_error(gated_rms_norm(core, z, w, EPS), naive_gated_rms_norm(core, z, w, EPS)),
           "legacy_error": ulp_error(legacy_gated_norm(core, z, w), naive_gated_rms_norm(core, z, w, EPS))}
    res["ms"] = {"old_with_z_copy": timed_ms(lambda: legacy_gated_norm(core, z, w)),
                 "new_strided_z": timed_ms(lambda: gated_rms_norm(core, z, w, EPS)),
                 "naive_torch": timed_ms(lambda: naive_gated_rms_norm(core, z, w, EPS))}
    return res


def decode_norm_rows(report: dict, save) -> None:
    """Decode-sized passes (1, 8, 64 tokens x HV heads): the few-row config against row blocks."""
    for tokens in (1, 8, 64):
        s = scenario(tokens, 1)
        report[f"decode_{tokens}_tokens"] = {
            str(c): timed_ms(lambda c=c, s=s: gated_rms_norm(s["core"], s["z"], s["norm_weight"], EPS, config=c))
            for c in (GATED_FEW_ROWS_CONFIG, (2, 4), (4, 2), GATED_CONFIG)}
        save()


def guarded(fn) -> float | str:
    """fn()'s ms, or its error's last line: a config that fails to compile must not end the sweep."""
    try:
        return fn()
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e)[-300:]}"


def sweeps(report: dict, save) -> None:
    s = scenario(TOKENS[0], 1)
    x, w, slots, cu, lengths = s["x"], s["weight"], s["slots"], s["cu"], s["lengths"]
    conv, norm = report.setdefault("conv", {}), report.setdefault("gated_norm", {})
    for config in CONV_SWEEP:
        if left_s() < 20:
            conv["skipped_from"] = str(config)
            break
        conv[str(config)] = guarded(lambda c=config: timed_ms(lambda: causal_conv1d_varlen_qkv(
            x, w, s["states"], slots, cu, max(lengths), KEY_DIM, D, EPS, config=c)))
        save()
    for config in NORM_SWEEP:
        if left_s() < 12:
            norm["skipped_from"] = str(config)
            break
        norm[str(config)] = guarded(lambda c=config: timed_ms(
            lambda: gated_rms_norm(s["core"], s["z"], s["norm_weight"], EPS, config=c)))
        save()
    for name, table in (("conv", conv), ("gated_norm", norm)):
        timed = {k: v for k, v in table.items() if k.startswith("(") and isinstance(v, float)}
        if timed:
            report[f"{name}_best"] = min(timed, key=timed.get)
    for variant in ("tile", "rows"):
        timed = {k: v for k, v in conv.items() if k.startswith("(") and isinstance(v, float)
                 and ("'rows'" in k) == (variant == "rows")}
        if timed:
            report[f"conv_best_{variant}"] = min(timed, key=timed.get)


def fla_section(report: dict, save) -> None:
    """fla's chunked rule on the old inputs and the new, 8,192 tokens, one sequence (fla autotunes on first use)."""
    from headroom.kernels.gdn_fla import gated_delta_rule_varlen, use_tuned_fla_configs

    report["tuned_configs"] = use_tuned_fla_configs(DEV)
    s = scenario(TOKENS[0], 1)
    x, w, slots, cu = s["x"], s["weight"], s["slots"], s["cu"]
    n = x.shape[0]
    gen = torch.Generator(device=DEV).manual_seed(5)
    g = -torch.rand(n, HV, device=DEV, generator=gen) * 0.1
    beta = torch.rand(n, HV, device=DEV, generator=gen).to(DTYPE)
    init = torch.zeros(1, HV, D, D, device=DEV)
    old = legacy_conv(x, w, s["states"].clone(), slots, cu, n).split([KEY_DIM, KEY_DIM, HV * D], dim=-1)
    oq, ok, ov = old[0].view(n, HK, D), old[1].view(n, HK, D), old[2].view(n, HV, D)
    nq, nk, nv = causal_conv1d_varlen_qkv(x, w, s["states"].clone(), slots, cu, n, KEY_DIM, D, EPS)
    nq, nk, nv = nq.view(n, HK, D), nk.view(n, HK, D), nv.view(n, HV, D)

    def old_rule():
        return gated_delta_rule_varlen(l2_norm(oq, EPS), l2_norm(ok, EPS), ov, g, beta, init, cu, cu_seqlens_cpu=cu.cpu())

    def new_rule():
        return gated_delta_rule_varlen(nq, nk, nv, g, beta, init, cu, cu_seqlens_cpu=cu.cpu(), qk_normed=True)

    res = report.setdefault("rule_8192", {})
    res["out_error_new_vs_old"] = ulp_error(new_rule()[0], old_rule()[0])
    save()
    res["ms"] = {"old_strided_v_l2norm": timed_ms(old_rule), "new_planes_normed": timed_ms(new_rule)}
    save()


def main(path: str) -> None:
    report: dict = {"device": "cpu (interpreter)" if CPU else torch.cuda.get_device_name(), "dtype": str(DTYPE),
                    "shapes": {"hk": HK, "hv": HV, "d": D, "channels": CHANNELS, "kernel": KERNEL},
                    "defaults": {"conv": DEFAULT_CONFIG, "conv_tile": TILE_CONFIG, "conv_rows": ROWS_CONFIG, "gated_norm": GATED_CONFIG,
                                 "gated_norm_few_rows": GATED_FEW_ROWS_CONFIG}}

    def save() -> None:
        report["elapsed_s"] = round(time.perf_counter() - START, 2)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    save()

    def attempt(name: str, fn, min_left: float) -> None:
        if left_s() < min_left:
            report[name] = {"skipped": f"deadline ({left_s():.0f} s left)"}
            return
        try:
            report[name] = fn()
        except Exception:  # one section's failure must not lose the rest of the run
            report[name] = {"error": traceback.format_exc()[-3000:]}
        save()
        print(name, json.dumps(report[name])[:600], flush=True)

    for tokens in TOKENS:
        for num_seqs in (1, 4):
            s = scenario(tokens, num_seqs)
            attempt(f"conv_{tokens}x{num_seqs}", lambda s=s: conv_section(s), 45)
            attempt(f"gated_norm_{tokens}x{num_seqs}", lambda s=s: gated_norm_section(s), 40)
            del s
    report["sweep"] = {}
    attempt("sweep", lambda: sweeps(report["sweep"], save) or report["sweep"], 25)
    report["decode_norm"] = {}
    attempt("decode_norm", lambda: decode_norm_rows(report["decode_norm"], save) or report["decode_norm"], 8)
    if not CPU:
        report["fla"] = {}
        attempt("fla", lambda: fla_section(report["fla"], save) or report["fla"], 10)
    save()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    main(args[0] if args else "prefill_gdn_kernels.json")
