"""The one dispatch point between the engine and its kernels.

Callers use only these names. Each picks an implementation from its inputs: on the CPU the pure-torch
naive_* reference; on CUDA the Triton kernel (paged attention, quantize-on-write, conv decode step,
quantized-weight GEMM) or fla-core's Gated DeltaNet where one exists. Triton modules are imported only
inside the CUDA branch, and every naive_* reference lives in a module that imports no Triton, so the CPU
path runs without Triton installed.
"""

from __future__ import annotations

import torch
from headroom.kernels.attention import naive_prefix_attention
from headroom.kernels.conv import naive_causal_conv1d
from headroom.kernels.gated_delta import naive_gated_delta_rule
from headroom.kernels.kv_quant import (
    naive_fp8_dequantize,
    naive_fp8_quantize,
    naive_kivi_dequantize_keys,
    naive_kivi_dequantize_values,
    naive_kivi_quantize_keys,
    naive_kivi_quantize_values,
)
from headroom.kernels.norm import naive_gated_rms_norm, naive_rms_norm
from headroom.kernels.quant_weight import QuantizedWeight, naive_quant_linear
from headroom.kernels.rotary import naive_apply_rotary, rotary_inv_freq

rms_norm = naive_rms_norm
gated_rms_norm = naive_gated_rms_norm
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
    "apply_rotary", "causal_conv1d", "fp8_dequantize", "fp8_quantize", "gated_delta_rule", "gated_rms_norm",
    "kivi_dequantize_keys", "kivi_dequantize_values", "kivi_quantize_keys", "kivi_quantize_values",
    "prefix_attention", "quant_linear", "rms_norm", "rotary_inv_freq",
]


# GPU paths. Imported on first use: triton.jit decides at import whether a kernel compiles or runs in
# the interpreter, and the CPU path must not import Triton at all.
def paged_attention(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale, max_q_len=None):
    """(out [N, Hq, D], lse [N, Hq]) over the paged pool: Triton on CUDA, the reference elsewhere."""
    if q.is_cuda:
        from headroom.kernels.paged_attention import paged_attention as run

        return run(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale, max_q_len)
    from headroom.kernels.paged_kv import naive_paged_attention

    return naive_paged_attention(q, q_positions, q_offsets, kv_table, kv_start, kv_lens, kv, scale)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ a quantized weight's [N, K].T: Triton GEMM over the packed weight on CUDA,
    dequantize-then-matmul elsewhere."""
    if x.is_cuda:
        from headroom.kernels.quant_matmul import quant_matmul

        return quant_matmul(x, weight, bias)
    return naive_quant_linear(x, weight, bias)


def gated_delta_rule_varlen(q, k, v, g, beta, states, cu_seqlens):
    """Many sequences in one call: fla-core on CUDA when installed, the reference elsewhere."""
    from headroom.kernels.gdn_fla import fla_available

    if q.is_cuda and fla_available():
        from headroom.kernels.gdn_fla import gated_delta_rule_varlen as run
    else:
        from headroom.kernels.gdn_fla import naive_gated_delta_rule_varlen as run
    return run(q, k, v, g, beta, states, cu_seqlens)


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

    pages = torch.tensor(slots[::page_tokens], dtype=torch.int32, device=k.device) // page_tokens
    kivi_quantize_pages(k, v, pages, PagedKV.from_store(store, kv_dtype, bits, page_tokens, value_group))
    return True
