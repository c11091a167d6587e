"""SGLang 0.5.23's sizing, applied to a parsed ServerArgs: its own functions where they run without a GPU,
else transcriptions naming the source (test_sglang_peer.py holds each transcription to its source line).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from headroom.engine.plan import ModelGeometry

MiB = 1024**2
# kv_cache_configurator.py: MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3
BASE_RATIO = 3
_KV_ELEMENT_BYTES = {"bfloat16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
_SSM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SGLangOutcome:
    pool_tokens: int
    running_cap: int
    checkpoint_room: int
    ratio: int


def slot_bytes(geometry: ModelGeometry, tp: int, ssm_dtype: str) -> int:
    """configs/mamba_utils.Mamba2CacheParams.mamba_cache_per_req over Mamba2StateShape.create (as
    configs/qwen3_next.py calls it): conv (2 x key_dim + value_dim) / tp x (kernel - 1) in the model dtype,
    temporal value_heads / tp x value_head_dim x key_head_dim in --mamba-ssm-dtype, every linear layer."""
    key_dim = geometry.linear_num_key_heads * geometry.linear_key_head_dim
    value_dim = geometry.linear_num_value_heads * geometry.linear_value_head_dim
    conv = (2 * key_dim + value_dim) // tp * (geometry.linear_conv_kernel_dim - 1) * geometry.dtype_bytes
    temporal = geometry.linear_num_value_heads // tp * geometry.linear_value_head_dim * geometry.linear_key_head_dim
    return geometry.num_linear_attention_layers * (conv + temporal * _SSM_BYTES[ssm_dtype])


def outcome(args: Any, geometry: ModelGeometry, gpu_memory: int, in_use_at_baseline: int) -> SGLangOutcome:
    """Pool, running cap and checkpoint room SGLang derives from `args` (a ServerArgs) on this GPU."""
    from sglang.srt.arg_groups.model_override_base import mamba_extra_buffer_of
    from sglang.srt.mem_cache.allocation_sizing import get_mamba_tracking_slots

    tp = args.tp_size
    # bootstrap.measure_pre_model_load_memory: free memory once the context (and NCCL) is up.
    pre = gpu_memory - in_use_at_baseline
    weights = -(-geometry.total_weight_bytes() // tp)
    slots = args.max_mamba_cache_size or 0
    per_slot = slot_bytes(geometry, tp, args.mamba_ssm_dtype) if geometry.is_hybrid else 0
    # _handle_max_mamba_cache: (K + 1) x per-request state ("+1 accounts for each pool's padding slot").
    mamba_bytes = (slots + 1) * per_slot if geometry.is_hybrid else 0
    # _profile_available_bytes: rest = available - pre x (1 - f); available = pre - weights.
    rest = (pre - weights) - pre * (1 - args.mem_fraction_static) - mamba_bytes
    # DefaultPoolConfigurator._compute_cell_size: kv heads (floored per rank) x (head + v_head) x layers x size.
    cell = (max(1, geometry.num_kv_heads // tp) * 2 * geometry.head_dim * geometry.num_full_attention_layers
            * _KV_ELEMENT_BYTES[args.kv_cache_dtype])
    pool = int(rest) // cell
    # _apply_token_constraints: --max-total-tokens is an upper bound only.
    if args.max_total_tokens is not None:
        pool = min(pool, args.max_total_tokens)
    # The radix cache is on and the strategy is explicit, so this is what _mamba_radix_cache_resolution keeps.
    view = SimpleNamespace(disable_radix_cache=args.disable_radix_cache,
                           mamba_radix_cache_strategy=args.mamba_radix_cache_strategy)
    extra_buffer = mamba_extra_buffer_of(view)
    overlap = not args.disable_overlap_schedule
    lazy = args.mamba_radix_cache_strategy == "extra_buffer_lazy"
    # _calculate_mamba_ratio (SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK unset).
    ratio = BASE_RATIO + get_mamba_tracking_slots(extra_buffer=extra_buffer, overlap=overlap, lazy=lazy)
    # resolve_max_num_reqs with --max-running-requests given.
    cap = min(max(1, args.max_running_requests), pool // 2)
    if geometry.is_hybrid:
        cap = min(cap, slots // ratio)
    # HybridReqToTokenPool.alloc: a working slot plus the ping-pong track buffers per running request.
    held = 1 + get_mamba_tracking_slots(extra_buffer=True, overlap=overlap) if extra_buffer else 1
    return SGLangOutcome(pool, cap, slots - cap * held if geometry.is_hybrid else 0, ratio)
