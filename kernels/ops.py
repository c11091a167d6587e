"""The one dispatch point between the engine and its kernels.

Callers use only these names. Each picks an implementation from its inputs: on the CPU the pure-torch
naive_* reference; on CUDA the Triton kernel (paged attention, quantize-on-write, conv decode step,
quantized-weight GEMM) or fla-core's Gated DeltaNet where one exists. Triton modules are imported only
inside the CUDA branch, and every naive_* reference lives in a module that imports no Triton, so the CPU
path runs without Triton installed.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.nn.functional as F
from headroom.kernels.attention import naive_prefix_attention
from headroom.kernels.attention_merge import merge_two as naive_merge_two
from headroom.kernels.conv import naive_causal_conv1d
from headroom.kernels.gated_delta import naive_gated_delta_rule, naive_gated_delta_tail
from headroom.kernels.gates import naive_gdn_gates, naive_sigmoid_mul, naive_silu_mul
from headroom.kernels.host_copy import to_device
from headroom.kernels.kv_quant import (
    naive_fp8_dequantize,
    naive_fp8_quantize,
    naive_kivi_dequantize_keys,
    naive_kivi_dequantize_values,
    naive_kivi_quantize_keys,
    naive_kivi_quantize_values,
)
from headroom.kernels.norm import naive_add_rms_norm, naive_gated_rms_norm, naive_rms_norm
from headroom.kernels.quant_weight import QuantizedWeight, naive_quant_linear
from headroom.kernels.rotary import naive_apply_rotary, naive_rms_norm_rotary, rotary_inv_freq

apply_rotary = naive_apply_rotary
causal_conv1d = naive_causal_conv1d
gated_delta_rule = naive_gated_delta_rule
prefix_attention = naive_prefix_attention
fp8_quantize = naive_fp8_quantize
fp8_dequantize = naive_fp8_dequantize
kivi_quantize_keys = naive_kivi_quantize_keys
kivi_dequantize_keys = naive_kivi_dequantize_keys
kivi_quantize_values = naive_kivi_quantize_values
kivi_dequantize_values = naive_kivi_dequantize_values

__all__ = [
    "add_rms_norm", "apply_rotary", "causal_conv1d", "causal_conv1d_varlen", "conv_dense_linear", "dense_linear", "fp8_dequantize", "fp8_quantize", "gated_delta_decode",
    "gated_delta_rule", "gated_delta_tail", "gated_rms_norm", "gdn_gates", "kivi_dequantize_keys", "kivi_dequantize_values",
    "kivi_quantize_keys", "kivi_quantize_values", "normed_dense_linear", "prefix_attention", "quant_linear",
    "residual_dense_linear", "residual_prescaled_dense_linear", "rms_norm", "rms_norm_rotary", "swiglu_dense_linear",
    "rotary_inv_freq", "RowNormArgs", "FUSED_OPS", "set_fused", "sigmoid_mul", "silu_mul", "silu_mul_dense_linear", "TailIndex",
]

# The fused kernels (norms, rotary, gates, the decode GEMV, the GDN decode step and tail, the prefill conv) on
# CUDA; "on" False runs the naive_* references there too (bench/engine_speed.py measures both in one process),
# and the ops named in "off" run theirs alone (bench/engine_speed_parts.logit_check: which one moves the logits).
FUSED_OPS = ("rms_norm", "add_rms_norm", "gated_rms_norm", "rms_norm_rotary", "silu_mul", "sigmoid_mul",
             "gdn_gates", "dense_linear", "gated_delta_decode", "gated_delta_tail", "causal_conv1d_varlen")
_FUSED: dict = {"on": True, "off": frozenset()}
# The most rows a pass's linears run through kernels/gemv.py (decode-sized; cuBLAS above).
GEMV_ROWS = 16


def _on_gemv(x: torch.Tensor, *ops: str) -> bool:
    """Whether x's rows go through kernels/gemv.py: 2-D, decode-sized, and every op named fused (set_fused)."""
    return x.dim() == 2 and x.shape[0] <= GEMV_ROWS and all(_fused(x, op) for op in ops)


def set_fused(on: bool, off: tuple[str, ...] = ()) -> None:
    """Fused kernels on or off on CUDA; with on, the ops named in off still run their references."""
    unknown = sorted(set(off) - set(FUSED_OPS))
    if unknown:
        raise ValueError(f"set_fused: no fused op named {unknown}; the ops are {list(FUSED_OPS)}")
    _FUSED.update(on=on, off=frozenset(off))


def _fused(x: torch.Tensor, op: str) -> bool:
    return x.is_cuda and _FUSED["on"] and op not in _FUSED["off"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """x [T, D] or [T, H, D] -> rms_norm over D (kernels/norm.py)."""
    if _fused(x, "rms_norm"):
        from headroom.kernels.norm_triton import rms_norm as run

        return run(x, weight, eps, unit_offset)[0]
    return naive_rms_norm(x, weight, eps, unit_offset)


def add_rms_norm(delta, residual, weight, eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta), both [T, D]: the decoder's residual step."""
    if _fused(residual, "add_rms_norm"):
        from headroom.kernels.norm_triton import rms_norm as run

        normed, summed = run(residual, weight, eps, unit_offset, delta=delta)
        assert summed is not None
        return normed, summed
    return naive_add_rms_norm(delta, residual, weight, eps, unit_offset)


def gated_rms_norm(x, gate, weight, eps: float) -> torch.Tensor:
    if _fused(x, "gated_rms_norm"):
        from headroom.kernels.norm_triton import gated_rms_norm as run

        return run(x, gate, weight, eps)
    return naive_gated_rms_norm(x, gate, weight, eps)


def rms_norm_rotary(x, weight, eps: float, unit_offset: bool, positions, inv_freq) -> torch.Tensor:
    """q/k per-head norm then rotary: x [T, H, D] -> [T, H, D] contiguous."""
    if _fused(x, "rms_norm_rotary"):
        from headroom.kernels.rotary_triton import rms_norm_rotary as run

        return run(x, weight, eps, unit_offset, positions, inv_freq)
    return naive_rms_norm_rotary(x, weight, eps, unit_offset, positions, inv_freq)


def qk_norm_rotary_store(q, k, v, wq, wk, eps: float, unit_offset: bool, positions, inv_freq, pool_k, pool_v, rows,
                         close=None):
    """rms_norm_rotary of q and k, with k and v stored into a token-granular pool's rows: (q, k) [T, H, D]. One
    launch on CUDA instead of four (q, k, and the two row stores). close (paged_kv.PageClose): a graphed KIVI
    step's page close of the windows pool_k / pool_v, in that launch too (else the reference after the stores)."""
    # (A page close on the GPU always takes the kernel, whatever set_fused says: the reference reads the pages to
    # close on the host, which a graph being captured cannot.)
    if _fused(q, "rms_norm_rotary") or (close is not None and q.is_cuda):
        from headroom.kernels.rotary_triton import qk_norm_rotary_store as run

        return run(q, k, v, wq, wk, eps, unit_offset, positions, inv_freq, pool_k, pool_v, rows, close=close)
    from headroom.kernels.paged_kv import naive_close_pages
    from headroom.kernels.rotary import naive_qk_norm_rotary_store

    out = naive_qk_norm_rotary_store(q, k, v, wq, wk, eps, unit_offset, positions, inv_freq, pool_k, pool_v, rows)
    if close is not None:
        naive_close_pages(close, pool_k, pool_v)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _fused(gate, "silu_mul"):
        from headroom.kernels.gates_triton import silu_mul as run

        return run(gate, up)
    return naive_silu_mul(gate, up)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if _fused(x, "sigmoid_mul"):
        from headroom.kernels.gates_triton import sigmoid_mul as run

        return run(x, gate)
    return naive_sigmoid_mul(x, gate)


def gdn_gates(b, a, neg_a, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta [N, Hv] model dtype, g [N, Hv] fp32) of Gated DeltaNet (kernels/gates.py)."""
    if _fused(b, "gdn_gates"):
        from headroom.kernels.gates_triton import gdn_gates as run

        return run(b, a, neg_a, dt_bias)
    return naive_gdn_gates(b, a, neg_a, dt_bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias): on CUDA, decode-sized products (at most 16 rows) through
    kernels/gemv.py where its shipped table has this GPU, shape and row count (measured faster than cuBLAS
    there); cuBLAS (torch's F.linear) everywhere else."""
    if bias is None and _on_gemv(x, "dense_linear"):
        from headroom.kernels.gemv import tuned_gemv

        out = tuned_gemv(x, weight)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def silu_mul_dense_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's down projection with its activation fused, (silu(gate) * up) [N, I] @ weight [H, I].T, in one GEMV
    launch (kernels/gemv.py silu_mul_gemv): on CUDA, decode-sized (at most 16 rows), where the shipped table has
    the fused shape at this row count (measured faster than silu_mul + cuBLAS there). None everywhere else, and
    whenever silu_mul or dense_linear runs its reference (set_fused): the caller runs silu_mul, then its linear."""
    if _on_gemv(gate, "silu_mul", "dense_linear"):
        from headroom.kernels.gemv import tuned_silu_mul_gemv

        return tuned_silu_mul_gemv(gate, up, weight)
    return None


def residual_dense_linear(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, up: torch.Tensor | None = None,
                          gate_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(residual + a @ weight.T, the sum's rows' partial sums of squares [N, parts] fp32) in one GEMV launch
    (kernels/gemv.py residual_gemv; up: SwiGLU's down projection, a the gate, as silu_mul_dense_linear; gate_norm
    (z, norm weight [head], eps): Gated DeltaNet's out-projection, a = gated_rms_norm(a, z) by heads first): on
    CUDA, decode-sized, where the GEMV table has the projection's shape. None everywhere else, and whenever the
    residual norm, the linear, silu_mul (with up) or gated_rms_norm (with gate_norm) runs its reference: the caller
    projects, then add_rms_norm."""
    if _on_gemv(a, "dense_linear", "add_rms_norm") and (up is None or _fused(a, "silu_mul")) \
            and (gate_norm is None or _fused(a, "gated_rms_norm")):
        from headroom.kernels.gemv import GatedNorm, tuned_residual_gemv

        gated = GatedNorm(*gate_norm) if gate_norm is not None else None
        return tuned_residual_gemv(a, weight, residual, up, gated)
    return None


def residual_prescaled_dense_linear(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                                    norm_weight: torch.Tensor, unit_offset: bool, up: torch.Tensor | None = None,
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(residual + a @ weight.T, the sum's rows' partial sums of squares, the sum times the next RMSNorm's weight)
    in one GEMV launch (kernels/gemv.py residual_prescaled_gemv; up as residual_dense_linear): the next linear
    reads the third with the rows' 1 / rms factored out (a norm tuple with prescaled True). Where
    residual_dense_linear would run its GEMV, None elsewhere (the caller projects, then add_rms_norm)."""
    if _on_gemv(a, "dense_linear", "add_rms_norm", "rms_norm") and (up is None or _fused(a, "silu_mul")):
        from headroom.kernels.gemv import NextNorm, tuned_residual_prescaled_gemv

        return tuned_residual_prescaled_gemv(a, weight, residual, NextNorm(norm_weight, unit_offset), up)
    return None


# A norm still to apply to a linear's input rows, as its GEMV takes it: (sums of squares [N, parts] fp32, weight,
# eps, unit offset, prescaled: the rows carry the weight already and only their 1 / rms is left).
RowNormArgs: TypeAlias = tuple[torch.Tensor, torch.Tensor, float, bool, bool]


def normed_dense_linear(x: torch.Tensor, norm: RowNormArgs, weight: torch.Tensor) -> torch.Tensor | None:
    """rms_norm(x) @ weight.T in one GEMV launch, x's rows' sums of squares given (residual_dense_linear's):
    kernels/gemv.py normed_gemv where residual_dense_linear would run, None elsewhere and whenever rms_norm runs its
    reference (the caller norms first, through ops.rms_norm). Prescaled rows (residual_prescaled_dense_linear's):
    their product scaled by the rows' 1 / rms."""
    if _on_gemv(x, "dense_linear", "add_rms_norm", "rms_norm"):
        from headroom.kernels.gemv import RowNorm, tuned_normed_gemv

        return tuned_normed_gemv(x, RowNorm(*norm), weight)
    return None


def swiglu_dense_linear(x: torch.Tensor, weight: torch.Tensor,
                        norm: RowNormArgs | None = None) -> torch.Tensor | None:
    """silu(gate) * up [N, I] of x @ weight.T, weight's gate and up rows interleaved (gate row i at 2i, up row i at
    2i + 1), in one GEMV launch: kernels/gemv.py swiglu_gemv where the table has the shape (its plain entry), None
    elsewhere and whenever the linear or silu_mul runs its reference (the caller projects, then silu_mul of the
    pairs). norm (RowNormArgs): x is still to norm, as normed_dense_linear norms it."""
    if _on_gemv(x, "dense_linear", "silu_mul") \
            and (norm is None or (_fused(x, "add_rms_norm") and _fused(x, "rms_norm"))):
        from headroom.kernels.gemv import RowNorm, tuned_swiglu_gemv

        return tuned_swiglu_gemv(x, weight, RowNorm(*norm) if norm is not None else None)
    return None


def conv_dense_linear(x: torch.Tensor, weight: torch.Tensor, conv_weight: torch.Tensor, conv_states: torch.Tensor,
                      slots: torch.Tensor, norm: RowNormArgs | None = None) -> torch.Tensor | None:
    """x @ weight.T with its first conv_weight.shape[0] columns through the decode conv step (silu(conv), each
    row's states rolled in place at conv_states[slots]) in one GEMV launch: kernels/gemv.py conv_gemv where the
    table has the shape, None elsewhere (nothing has run: the caller projects, then runs causal_conv1d_update).
    norm (RowNormArgs): x is still to norm, as normed_dense_linear norms it."""
    needed = ("dense_linear", "add_rms_norm", "rms_norm") if norm is not None else ("dense_linear",)
    if _on_gemv(x, *needed):
        from headroom.kernels.gemv import ConvStep, RowNorm, tuned_conv_gemv

        return tuned_conv_gemv(x, weight, ConvStep(conv_weight, conv_states, slots),
                               RowNorm(*norm) if norm is not None else None)
    return None


def gated_delta_decode(q, k, v, g, beta, states, slots, bounds=None, qk_normed: bool = False,
                       raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
                       gate_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                       conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """One decode token per sequence (bounds None), or each sequence's rows bounds[b]..bounds[b+1] token by token;
    states updated in place at slots. qk_normed: q and k already L2-normed (causal_conv1d_varlen's fused norm).
    raw_gates (neg_a, dt_bias): g and beta are the raw a and b, gated in the step (one token per sequence).
    gate_norm (z, weight, eps; only where decodes_with_gate_norm says so): the output is gated_rms_norm'd in the
    step. conv (mixed, weight, conv states; only where decodes_with_raw_gates says so): q, k, v are mixed's raw
    columns, convolved in the step (states rolled in place).
    None: not fused here, the caller takes the varlen path (fla or the reference)."""
    if _fused(q, "gated_delta_decode"):
        from headroom.kernels.gdn_decode import gated_delta_decode as run

        return run(q, k, v, g, beta, states, slots, bounds, qk_normed=qk_normed, raw_gates=raw_gates,
                   gate_norm=gate_norm, conv=conv)
    return None


def decodes_with_gate_norm(x: torch.Tensor) -> bool:
    """Whether a decode step's delta rule can apply Gated DeltaNet's output norm itself (gated_delta_decode's
    gate_norm): where both the fused step and the fused norm run (the layer decides whether it asks)."""
    return _fused(x, "gated_delta_decode") and _fused(x, "gated_rms_norm")


def decodes_with_raw_gates(x: torch.Tensor) -> bool:
    """Whether a decode step's delta rule makes its own gates here (gated_delta_decode's raw_gates), so that the
    layer skips gdn_gates: where the fused step runs."""
    return _fused(x, "gated_delta_decode")


TAIL_SNAPSHOT_WIDTH = 8


class TailIndex:
    """gated_delta_tail's pieces: sequence b owns rows row_lo[b]..row_hi[b]-1 and takes snapshots[b] ((rows done,
    pool slot), ascending). A pass builds one for all its layers: on the fused path the kernel's int32 tables are
    uploaded once, on first use, instead of four host-to-device copies in every layer."""

    def __init__(self, row_lo: list[int], row_hi: list[int], snapshots: list[list[tuple[int, int]]]):
        self.row_lo, self.row_hi, self.snapshots = row_lo, row_hi, snapshots
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(row_lo, row_hi, snap_at, snap_slot) int32 on device, the snapshot tables padded with 0s to a fixed
        width (TAIL_SNAPSHOT_WIDTH, or the next power of 2), so that no snapshot count compiles a variant while
        serving; a request takes at most 6 stops (engine/cache/checkpoint_policy.py)."""
        if device not in self._tables:
            width = max(TAIL_SNAPSHOT_WIDTH, 1 << (max(len(s) for s in self.snapshots) - 1).bit_length())
            at = [[n for n, _ in s] + [0] * (width - len(s)) for s in self.snapshots]
            slots = [[slot for _, slot in s] + [0] * (width - len(s)) for s in self.snapshots]
            self._tables[device] = tuple(to_device(values, torch.int32, device)
                                         for values in (self.row_lo, self.row_hi, at, slots))
        return self._tables[device]


def gated_delta_tail(q, k, v, g, beta, states, out, pool, index: TailIndex, qk_normed: bool = False) -> None:
    """The last rows of B prefill pieces token by token, with state snapshots into pool slots (kernels/
    gated_delta.py's naive_gated_delta_tail; index: the pieces): one Triton launch on CUDA, the reference
    elsewhere. qk_normed: q and k already L2-normed."""
    if _fused(q, "gated_delta_tail"):
        from headroom.kernels.gdn_decode import gated_delta_tail as run

        run(q, k, v, g, beta, states, out, pool, *index.tables(q.device), qk_normed=qk_normed)
        return
    naive_gated_delta_tail(q, k, v, g, beta, states, out, pool, index.row_lo, index.row_hi, index.snapshots, qk_normed)


# GPU paths. Imported on first use: triton.jit decides at import whether a kernel compiles or runs in
# the interpreter, and the CPU path must not import Triton at all.
def paged_attention(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale, max_q_len=None, prev=None,
                    out=None, out_lse=None, window=None, gate=None):
    """(out [N, Hq, D], lse [N, Hq]) over the paged pool: Triton on CUDA, the reference elsewhere. prev: (out, lse)
    over an earlier key range to continue from; out, out_lse: where to write (out may be prev's, or fp32);
    window: a decode launch's keys outside the pool (paged_kv.KeyWindow), merged in; gate [N, Hq, D]: out times
    sigmoid(gate) (Qwen3.5's output gate; without prev), lse not."""
    if q.is_cuda:
        from headroom.kernels.paged_attention import paged_attention as run

        return run(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale, max_q_len, out=out,
                   out_lse=out_lse, prev=prev, window=window, gate=gate)
    if gate is not None and prev is not None:
        raise ValueError("paged_attention: a gated launch continues no earlier range (prev)")
    from headroom.kernels.paged_kv import naive_paged_attention

    got, got_lse = naive_paged_attention(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale)
    if prev is not None:
        got, got_lse = naive_merge_two(prev[0].float(), prev[1], got.float(), got_lse)
    if window is not None:
        window.check(q, kv.num_kv_heads)
        if q.shape[0]:
            window.require_decode(q.shape[0], kv_table.shape[0], int((q_offsets[1:] - q_offsets[:-1]).max()),
                                  prev is not None)
        rows = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        seen, seen_lse = naive_paged_attention(q, q_positions, rows, window.table, window.start, window.lens, window.kv,
                                               scale)
        got, got_lse = naive_merge_two(got.float(), got_lse, seen.float(), seen_lse)
    if gate is not None:
        # as the unfused layer: the output rounded to q's dtype, then gated
        got = sigmoid_mul(got.to(q.dtype).reshape(q.shape[0], -1), gate).view(q.shape)
    if out is None:
        return got.to(q.dtype), got_lse
    out.copy_(got)
    out_lse.copy_(got_lse)
    return out, out_lse


def dequantize_block(kv, kv_table, block_lens, ws_rows, first_key: int, block_tokens: int, k_ws, v_ws) -> None:
    """KIVI pages of one key block into a dense workspace (kernels/paged_attention.py dequantize_block)."""
    if kv.k.is_cuda:
        from headroom.kernels.paged_attention import dequantize_block as run

        return run(kv, kv_table, block_lens, ws_rows, first_key, block_tokens, k_ws, v_ws)
    from headroom.kernels.paged_kv import naive_dequantize_block

    return naive_dequantize_block(kv, kv_table, block_lens, ws_rows, first_key, block_tokens, k_ws, v_ws)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ a quantized weight's [N, K].T: Triton GEMM over the packed weight on CUDA,
    dequantize-then-matmul elsewhere."""
    if x.is_cuda:
        from headroom.kernels.quant_matmul import quant_matmul

        return quant_matmul(x, weight, bias)
    return naive_quant_linear(x, weight, bias)


def gated_delta_rule_varlen(q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu=None, qk_normed: bool = False):
    """Many sequences in one call: fla-core on CUDA when installed, the reference elsewhere. qk_normed: q and k
    already L2-normed (causal_conv1d_varlen's fused norm), not normed again."""
    from headroom.kernels.gdn_fla import fla_available

    if q.is_cuda and fla_available():
        from headroom.kernels.gdn_fla import QK_NORM_EPS
        from headroom.kernels.gdn_fla import gated_delta_rule_varlen as run

        if q.shape[0] == cu_seqlens.shape[0] - 1 and not qk_normed:
            # Decode: fla's recurrent kernel norms q/k inside, free. (It always norms: normed q/k - one row a
            # sequence in a round of in-pass checkpoints - take the chunked kernel below.)
            return run(q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        if not qk_normed:
            # Chunked prefill: q/k normed by our kernel, not fla's l2norm, which autotunes per bucket of tokens x
            # heads / 65,536: passes just over 8,192 tokens met a new bucket while serving (25 compiles, H200).
            from headroom.kernels.norm_triton import l2_norm

            q, k = l2_norm(q, QK_NORM_EPS), l2_norm(k, QK_NORM_EPS)
        return run(q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, is_decode=False,
                   qk_normed=True)
    from headroom.kernels.gdn_fla import naive_gated_delta_rule_varlen

    return naive_gated_delta_rule_varlen(q, k, v, g, beta, states, cu_seqlens, qk_normed=qk_normed)


def causal_conv1d_varlen(x, weight, states, slots, cu_seqlens, lengths: list[int], key_dim: int,
                         qk_norm_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Prefill conv of every sequence of a pass, x's channels q | k | v (key_dim, key_dim, the rest), states
    updated in their pool slots -> (q [N, key_dim], k, v [N, C - 2 key_dim], qk_normed). On CUDA one Triton
    launch writing q, k, v contiguous (fla's chunked kernels would copy a strided v), and with qk_norm_dim > 0
    q and k L2-normed per head of that many channels in the same pass (qk_normed True). Elsewhere the reference
    per sequence, cut into views, not normed."""
    if _fused(x, "causal_conv1d_varlen"):
        from headroom.kernels.conv_varlen import causal_conv1d_varlen_qkv as run
        from headroom.kernels.gdn_fla import QK_NORM_EPS

        # The epilogue norms whole heads of a channel block: a power-of-two head size (else the separate l2_norm).
        norm_dim = qk_norm_dim if qk_norm_dim & (qk_norm_dim - 1) == 0 else 0
        q, k, v = run(x, weight, states, slots, cu_seqlens, max(lengths, default=0), key_dim, norm_dim, QK_NORM_EPS)
        return q, k, v, norm_dim > 0
    from headroom.kernels.conv import naive_causal_conv1d_varlen

    out = naive_causal_conv1d_varlen(x, weight, states, slots, lengths)
    q, k, v = torch.split(out, [key_dim, key_dim, x.shape[1] - 2 * key_dim], dim=-1)
    return q, k, v, False


def causal_conv1d_update(x, weight, states, slots):
    """Decode-step conv over pool slots, in place: Triton on CUDA, the reference elsewhere."""
    if x.is_cuda:
        from headroom.kernels.conv_update import causal_conv1d_update as run
    else:
        from headroom.kernels.conv import naive_causal_conv1d_update as run
    return run(x, weight, states, slots)


def fp8_quantize_into_rows(k, v, index, store) -> None:
    """fp8 quantize-on-write of k, v [T, H, D] into pool rows index [T] (Triton, CUDA only)."""
    from headroom.kernels.kv_quant_triton import fp8_quantize_into

    rows = index.to(torch.int32)
    fp8_quantize_into(k.contiguous(), rows, store["k"], store["k_scale"])
    fp8_quantize_into(v.contiguous(), rows, store["v"], store["v_scale"])


def kivi_quantize_into_pool(store, kv_dtype, bits, page_tokens, value_group, slots, k, v) -> bool:
    """KIVI quantize-on-write of whole pages with Triton on CUDA. False: the caller uses the reference."""
    if not k.is_cuda:
        return False
    from headroom.kernels.kv_quant_triton import kivi_quantize_pages
    from headroom.kernels.paged_kv import PagedKV

    pages = to_device(slots[::page_tokens], torch.int32, k.device) // page_tokens
    kivi_quantize_pages(k, v, pages, PagedKV.from_store(store, kv_dtype, bits, page_tokens, value_group))
    return True
