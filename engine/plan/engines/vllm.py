"""vLLM 0.33.0 (PyPI): its sizing rules, each transcribed from the function named beside it (paths in `vllm/`).

- Startup gate: free memory at the worker's first snapshot must be >= u x total
  (v1/worker/utils.request_memory, called from gpu_worker.init_device), so u <= 1 - (in use at startup) / total.
- --kv-cache-memory-bytes is the whole pool; --gpu-memory-utilization then only gates startup, and the
  weights, profiled activations and graphs must fit beside the pool (the ledger's static side, inside u).
- Hybrid models share one block pool: attention blocks are enlarged until one layer's page holds a
  Gated DeltaNet state (platforms/interface._align_hybrid_block_size, block size a multiple of the
  kernel's 16 and, in align mode, of FlashInfer's 64-token GDN checkpoint grid, which Hopper selects); the
  state page is padded to the attention page. Layers are grouped G to a group
  (v1/core/kv_cache_planning._get_kv_cache_groups_uniform_page_size); a block is G pages.
- Prefix caching on a hybrid model selects "align" mode (model_executor/models/config.MambaModelConfig), in
  which a running request holds 2 states plus one prefill-checkpoint block (MambaSpec.max_memory_usage_bytes,
  num_prefill_checkpoint_blocks = 1 for the FlashInfer GDN prefill).
- --mamba-ssm-cache-dtype auto means the checkpoint's mamba_ssm_dtype (float32 for Qwen3.5,
  Qwen3_5ForConditionalGenerationConfig), so the plan always names the dtype it priced.
- KV dtypes (config/cache.py CacheDType): bf16 and fp8 here. vLLM's int8/int4_per_token_head are not KIVI and
  are not priced by this profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from headroom.engine.plan.engines.base import (
    EngineModel,
    Layout,
    MiB,
    activation_bytes,
    fraction_flag,
    req_to_token_table_bytes,
)
from headroom.engine.plan.geometry import ModelGeometry
from headroom.engine.plan.kv_format import ssm_slot_bytes

_KV_FLAG = {"bf16": "auto", "fp8": "fp8"}
_KV_ELEMENT_BYTES = {"bf16": 2, "fp8": 1}
# MambaDType: explicit names, never "auto" (which reads the checkpoint's dtype).
_MAMBA_FLAG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# FlashAttention's kernel block sizes (MultipleOf(16)) and FLASHINFER_GDN_CHECKPOINT_ALIGNMENT.
_KERNEL_BLOCK_ALIGNMENT = 16
_GDN_CHECKPOINT_ALIGNMENT = 64
# Align mode: 2 states + 1 prefill-checkpoint block per running request.
STATES_PER_RUNNING = 3
# In use at the startup snapshot: CUDA context + cuBLAS, 719 MiB on an H200 before any model (measured for
# issue 13). With tp > 1 the NCCL communicators too: an estimate, unmeasured.
STARTUP_OVERHEAD_BYTES = 719 * MiB
TP_COMMUNICATOR_BYTES = 512 * MiB
# Inside u, beside the pool: non-torch growth after the snapshot and CUDA graphs (estimates, unmeasured).
_NON_TORCH_BYTES = 512 * MiB
_GRAPH_RESERVE_BYTES = 384 * MiB
_FRAGMENTATION_SHARE = 0.01


@dataclass(frozen=True)
class BlockLayout:
    """vLLM's block pool for one model: block_size tokens; a block is layers_per_group pages of page_bytes."""

    block_size: int
    page_bytes: int
    layers_per_group: int
    attention_groups: int
    state_groups: int

    @property
    def block_bytes(self) -> int:
        return self.layers_per_group * self.page_bytes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_layout(geometry: ModelGeometry, kv_dtype: str, ssm_dtype: str, tp: int) -> BlockLayout:
    """_align_hybrid_block_size + _get_kv_cache_groups_uniform_page_size for one GPU of `tp`."""
    heads = max(1, geometry.num_kv_heads // tp)
    # FullAttentionSpec(block_size=1).page_size_bytes: K and V of one token of one layer.
    attn_page_1tok = 2 * heads * geometry.head_dim * _KV_ELEMENT_BYTES[kv_dtype]
    n_attn, n_state = geometry.num_full_attention_layers, geometry.num_linear_attention_layers
    if not geometry.is_hybrid:
        return BlockLayout(_KERNEL_BLOCK_ALIGNMENT, _KERNEL_BLOCK_ALIGNMENT * attn_page_1tok, n_attn, 1, 0)
    state_page = ssm_slot_bytes(geometry, tp, ssm_dtype) // n_state
    alignment = lcm(_KERNEL_BLOCK_ALIGNMENT, _GDN_CHECKPOINT_ALIGNMENT)
    block_size = alignment * _cdiv(state_page, alignment * attn_page_1tok)
    smallest, largest = min(n_attn, n_state), max(n_attn, n_state)
    group = largest if largest < smallest * 1.5 else smallest
    return BlockLayout(block_size, block_size * attn_page_1tok, group, _cdiv(n_attn, group), _cdiv(n_state, group))


class VLLMEngine(EngineModel):
    name = "vllm"
    version = "0.33.0"
    kv_dtypes = tuple(_KV_FLAG)
    kv_dtype_note = (
        "vLLM 0.33.0's integer KV (int8_per_token_head, int4_per_token_head) keeps a scale per token and head, "
        "not KIVI's grouped layout, and this profile does not price it"
    )
    default_ssm_dtype = "fp32"

    def _blocks(self, geometry: ModelGeometry, layout: Layout) -> BlockLayout:
        return block_layout(geometry, layout.kv_dtype, layout.ssm_dtype, layout.tp)

    def page_tokens(self, geometry: ModelGeometry, layout: Layout) -> int:
        # The pool hands out whole blocks, so the plan's token count is a whole number of them.
        return self._blocks(geometry, layout).block_size

    def kv_bytes_per_token(self, geometry: ModelGeometry, layout: Layout) -> int:
        blocks = self._blocks(geometry, layout)
        return blocks.attention_groups * blocks.block_bytes // blocks.block_size

    def ssm_slot_bytes(self, geometry: ModelGeometry, layout: Layout) -> int:
        blocks = self._blocks(geometry, layout)
        return blocks.state_groups * blocks.block_bytes

    def slots_per_running(self, layout: Layout) -> int:
        return STATES_PER_RUNNING

    def ssm_slots_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        if not geometry.is_hybrid:
            return 0
        checkpoints = self.checkpoints_needed(geometry, layout, total_tokens, retained_sessions, session_tokens)
        return checkpoints + layout.running * STATES_PER_RUNNING

    def ssm_pool_bytes(self, slots: int, slot_bytes: int) -> int:
        # BlockPool keeps one null block back; priced as one more state (at least one block).
        return (slots + 1) * slot_bytes if slots else 0

    def static_extras(self, geometry: ModelGeometry, layout: Layout) -> dict[str, int]:
        return {
            "block_table": req_to_token_table_bytes(layout.running, layout.context_length),
            "activations_profiled": activation_bytes(geometry, layout.chunk, layout.running, layout.tp),
            "non_torch_and_graphs": _NON_TORCH_BYTES + _GRAPH_RESERVE_BYTES,
        }

    def non_static(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        startup = STARTUP_OVERHEAD_BYTES + (TP_COMMUNICATOR_BYTES if layout.tp > 1 else 0)
        return {"startup_in_use": startup, "fragmentation": int(_FRAGMENTATION_SHARE * gpu_memory)}

    def render(self, values: dict[str, int | float | str]) -> list[str]:
        args = [
            "--gpu-memory-utilization", fraction_flag(float(values["mem_fraction_static"])),
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
