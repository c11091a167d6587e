"""Byte layout of one KV token and one SSM state slot: the single source the planner and the pools share.

The builtin engine allocates exactly these layouts, so a plan's ledger is what the engine takes.
Low-bit KV follows KIVI: keys are quantized per channel over groups of `key_group_tokens`
consecutive tokens of one sequence (scale and zero point per channel per group), values per token
over groups of `value_group_channels` channels; both asymmetric with fp16 scale and zero point.
The newest tokens of a sequence (fewer than one key group) stay in full precision in a per-request
residual window, which is why the quantized pool hands out token slots in pages of one key group.
"""

from __future__ import annotations

from dataclasses import dataclass

from headroom.engine.plan.geometry import ModelGeometry

KV_DTYPES = ("bf16", "fp8", "int8", "int4", "int2")
SSM_DTYPES = ("fp32", "bf16", "fp16")
_SSM_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp16 scale + fp16 zero point per group.
_SCALE_ZERO_BYTES = 4


@dataclass(frozen=True)
class KVFormat:
    """Storage of one KV dtype. Bit widths per element; group sizes in tokens or channels."""

    name: str
    bits: int
    is_kivi: bool
    key_group_tokens: int = 1
    value_group_channels: int = 0
    # fp8: one fp32 scale per token per head for K and for V.
    per_token_head_scale_bytes: int = 0

    @property
    def page_tokens(self) -> int:
        """Token slots are handed out in pages of this many tokens (one key group)."""
        return self.key_group_tokens if self.is_kivi else 1

    @property
    def residual_tokens(self) -> int:
        """Full-precision tokens a running request holds outside the pool (the open key group)."""
        return self.key_group_tokens if self.is_kivi else 0

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        """K and V together, scales amortised, for one KV head of one layer."""
        data = 2 * head_dim * self.bits / 8
        if not self.is_kivi:
            return data + 2 * self.per_token_head_scale_bytes
        value_groups = -(-head_dim // self.value_group_channels)
        key_scales = head_dim * _SCALE_ZERO_BYTES / self.key_group_tokens
        return data + key_scales + value_groups * _SCALE_ZERO_BYTES


KV_FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat("bf16", 16, False),
    "fp8": KVFormat("fp8", 8, False, per_token_head_scale_bytes=4),
    "int8": KVFormat("int8", 8, True, key_group_tokens=32, value_group_channels=32),
    "int4": KVFormat("int4", 4, True, key_group_tokens=32, value_group_channels=32),
    "int2": KVFormat("int2", 2, True, key_group_tokens=32, value_group_channels=32),
}


def kv_format(dtype: str) -> KVFormat:
    if dtype not in KV_FORMATS:
        raise ValueError(f"kv dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return KV_FORMATS[dtype]


def kv_heads_per_gpu(geometry: ModelGeometry, tp: int) -> int:
    """KV heads are split across tensor-parallel ranks, replicated when there are fewer heads than ranks."""
    return max(1, -(-geometry.num_kv_heads // tp))


def kv_bytes_per_token(geometry: ModelGeometry, dtype: str, tp: int = 1) -> int:
    """Bytes one cached token takes in the pool of one GPU: every full-attention layer, K and V, scales."""
    per_head = kv_format(dtype).bytes_per_token_per_head(geometry.head_dim)
    return int(-(-per_head * kv_heads_per_gpu(geometry, tp) * geometry.num_full_attention_layers // 1))


def dense_kv_bytes_per_token_layer(geometry: ModelGeometry, tp: int = 1) -> int:
    """fp16/bf16 K and V of one token of one layer on one GPU (what a dequantized prefix costs)."""
    return 2 * kv_heads_per_gpu(geometry, tp) * geometry.head_dim * 2


def ssm_slot_bytes(geometry: ModelGeometry, tp: int = 1, ssm_dtype: str = "fp32") -> int:
    """One SSM state slot on one GPU: conv state (model dtype) + recurrent state, every linear layer.

    conv state: (2 * key_dim + value_dim) / tp channels x (conv_kernel - 1) positions.
    recurrent state: value_heads / tp x key_head_dim x value_head_dim.
    """
    if not geometry.is_hybrid:
        return 0
    if ssm_dtype not in _SSM_DTYPE_BYTES:
        raise ValueError(f"ssm dtype {ssm_dtype!r} is not one of {', '.join(SSM_DTYPES)}")
    key_dim = geometry.linear_num_key_heads * geometry.linear_key_head_dim
    value_dim = geometry.linear_num_value_heads * geometry.linear_value_head_dim
    conv_channels = -(-(2 * key_dim + value_dim) // tp)
    conv = conv_channels * (geometry.linear_conv_kernel_dim - 1) * geometry.dtype_bytes
    value_heads = -(-geometry.linear_num_value_heads // tp)
    recurrent = value_heads * geometry.linear_key_head_dim * geometry.linear_value_head_dim
    return geometry.num_linear_attention_layers * (conv + recurrent * _SSM_DTYPE_BYTES[ssm_dtype])
