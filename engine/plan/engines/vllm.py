"""vLLM's memory semantics.

--gpu-memory-utilization u budgets *everything* vLLM uses (weights, KV cache, profiled peak
activations, CUDA graphs, non-torch memory) within u * total; 1 - u is left to other processes and
fragmentation. So here the ledger's static part holds the activations too, and the solver's fraction
is u. Hybrid models keep Gated DeltaNet states in the same paged pool as attention ("hybrid state
pages": attention pages are enlarged to the size of one layer's state), one state per running
request plus, with prefix caching, states cached at scheduled chunk boundaries. vLLM has no integer
KV cache: int8/int4/int2 are refused with fp8 as the alternative.
"""

from __future__ import annotations

from headroom.engine.plan.engines.base import (
    EngineModel,
    Layout,
    MiB,
    activation_bytes,
    req_to_token_table_bytes,
    session_checkpoints,
)
from headroom.engine.plan.geometry import ModelGeometry
from headroom.engine.plan.kv_format import kv_heads_per_gpu

_KV_FLAG = {"bf16": "auto", "fp8": "fp8"}
_MAMBA_FLAG = {"fp32": "float32", "bf16": "auto", "fp16": "float16"}
_NON_TORCH_BYTES = 512 * MiB
_GRAPH_RESERVE_BYTES = 384 * MiB
_FRAGMENTATION_SHARE = 0.01


class VLLMEngine(EngineModel):
    name = "vllm"
    kv_dtypes = ("bf16", "fp8")
    default_ssm_dtype = "fp32"

    def kv_bytes_per_token(self, geometry: ModelGeometry, layout: Layout) -> int:
        element = 2 if layout.kv_dtype == "bf16" else 1
        return 2 * geometry.head_dim * element * kv_heads_per_gpu(geometry, layout.tp) * (
            geometry.num_full_attention_layers
        )

    def ssm_slots_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        if not geometry.is_hybrid:
            return 0
        return session_checkpoints(retained_sessions, session_tokens, layout.chunk) + layout.running

    def static_extras(self, geometry: ModelGeometry, layout: Layout) -> dict[str, int]:
        # Inside the utilization budget: the profiled forward pass and vLLM's non-torch allocations.
        return {
            "block_table": req_to_token_table_bytes(layout.running, layout.context_length),
            "activations_profiled": activation_bytes(geometry, layout.chunk, layout.running, layout.tp),
            "cuda_context_and_graphs": _NON_TORCH_BYTES + _GRAPH_RESERVE_BYTES,
        }

    def non_static(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        return {"fragmentation": int(_FRAGMENTATION_SHARE * gpu_memory)}

    def render(self, values: dict[str, int | float | str]) -> list[str]:
        args = [
            "--gpu-memory-utilization", f"{values['mem_fraction_static']:.3f}",
            "--kv-cache-memory-bytes", str(values["kv_cache_memory_bytes"]),
            "--max-model-len", str(values["context_length"]),
            "--max-num-batched-tokens", str(values["chunked_prefill_size"]),
            "--max-num-seqs", str(values["max_running_requests"]),
            "--kv-cache-dtype", _KV_FLAG[str(values["kv_dtype"])],
            "--tensor-parallel-size", str(values["tp"]),
            "--enable-chunked-prefill",
            "--enable-prefix-caching",
        ]
        if int(values["ssm_slots"]):
            args += ["--mamba-ssm-cache-dtype", _MAMBA_FLAG[str(values["ssm_dtype"])]]
        return args
