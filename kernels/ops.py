"""The one dispatch point between the engine and its kernels.

Callers use only these names. Each picks an implementation from its inputs; today every op runs its
pure-torch naive_* reference (the CPU path). GPU Triton kernels (issue 8) plug in here, per op,
without any caller changing.
"""

from __future__ import annotations

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
    "prefix_attention", "rms_norm", "rotary_inv_freq",
]
