"""The field report's SGLang fork with integer KV (seed 004: SGLang 0.5.19 + an INT2/INT4 KV patch).

An opt-in profile (`--engine sglang --engine-flavour int-kv`, CR `engine.flavour: int-kv`), never the default:
stock SGLang rejects int8/int4/int2 KV (engines/sglang.py). The fork's code is not public, so this profile is
held to the field report's measurements, not to a release's parsers:

- Pool size: SGLang sizes the token pool from the static budget left after weights
  (mem_fraction_static * total - weights), then applies --max-total-tokens as a cap only
  (seed 004: 210000 stayed 148,058 until the fraction moved).
- Hybrid models: a mamba/SSM checkpoint is donated to the radix tree at every chunked-prefill
  boundary, so a pool full of cached prefixes needs pool / chunk checkpoint slots, plus one working
  slot per running request (seed 004: 210K / 4096 = 51 > 32 slots broke prefix reuse; / 8192 = 26 fit).
- INT2/INT4 KV (the fork's OSCAR path): prefill dequantizes the cached prefix of the layer being
  computed to fp16 outside the static budget, so it grows with the prefix: the seed measured about
  962 MB at 112K tokens with 4 KV heads of 256 on TP2, i.e. 4 x the dense fp16 K+V of one layer per GPU.
"""

from __future__ import annotations

from headroom.engine.plan.engines.base import (
    EngineModel,
    Layout,
    MiB,
    activation_bytes,
    dense_prefix_bytes,
    planned_memory_flags,
    req_to_token_table_bytes,
    session_checkpoints,
)
from headroom.engine.plan.geometry import ModelGeometry
from headroom.engine.plan.kv_format import kv_heads_per_gpu

# Bytes per element and per-token-per-head scale bytes of each KV dtype in SGLang (int ones: the fork).
_KV_ELEMENT_BITS = {"bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
_KV_FLAG = {"bf16": "auto", "fp8": "fp8_e4m3", "int8": "int8", "int4": "int4", "int2": "int2"}
_SSM_FLAG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Calibrated on seed 004 (962 MB at 112K tokens, TP2, 4 x 256 KV heads).
_DEQUANT_COPIES = 4
# CUDA context, CUDA graphs and fragmentation, calibrated so that seed 004's running configuration
# (0.85, context 114,688, chunk 8192 on 12,227 MiB) fits: the field ran it for days.
_CUDA_CONTEXT_BYTES = 224 * MiB
_GRAPH_RESERVE_BYTES = 32 * MiB
_FRAGMENTATION_SHARE = 0.001


class SGLangIntKVEngine(EngineModel):
    name = "sglang"
    version = "0.5.19"
    flavour = "int-kv"
    kv_dtypes = tuple(_KV_ELEMENT_BITS)
    default_ssm_dtype = "fp32"
    token_cap_only = True

    def kv_bytes_per_token(self, geometry: ModelGeometry, layout: Layout) -> int:
        bits = _KV_ELEMENT_BITS[layout.kv_dtype]
        # The integer formats keep an fp16 scale and zero point per token and head for K and for V.
        scales = 2 * 4 if bits < 8 else 0
        per_head = 2 * geometry.head_dim * bits // 8 + scales
        return per_head * kv_heads_per_gpu(geometry, layout.tp) * geometry.num_full_attention_layers

    def ssm_slots_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        if not geometry.is_hybrid:
            return 0
        # One checkpoint per chunk of pool, and never fewer than the retained sessions' own chunk
        # boundaries: a session that ends mid-chunk still holds a checkpoint for its partial chunk.
        retained = session_checkpoints(retained_sessions, session_tokens, layout.chunk)
        return max(-(-total_tokens // layout.chunk), retained) + layout.running

    def static_extras(self, geometry: ModelGeometry, layout: Layout) -> dict[str, int]:
        return {"req_to_token_table": req_to_token_table_bytes(layout.running, layout.context_length)}

    def non_static(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        transient = 0
        if _KV_ELEMENT_BITS[layout.kv_dtype] < 8:
            transient = _DEQUANT_COPIES * dense_prefix_bytes(geometry, layout.context_length, layout.tp)
        return {
            "cuda_context": _CUDA_CONTEXT_BYTES,
            "activations": activation_bytes(geometry, layout.chunk, layout.running, layout.tp),
            "dequant_transient": transient,
            "graph_reserve": _GRAPH_RESERVE_BYTES,
            "fragmentation": int(_FRAGMENTATION_SHARE * gpu_memory),
        }

    def render(self, values: dict[str, int | float | str]) -> list[str]:
        args = [
            *planned_memory_flags(values),
            "--kv-cache-dtype", _KV_FLAG[str(values["kv_dtype"])],
            "--tp-size", str(values["tp"]),
        ]
        if int(values["ssm_slots"]):
            args += [
                "--max-mamba-cache-size", str(values["ssm_slots"]),
                "--mamba-ssm-dtype", _SSM_FLAG[str(values["ssm_dtype"])],
            ]
        return args
