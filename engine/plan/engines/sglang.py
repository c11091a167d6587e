"""SGLang 0.5.23 (PyPI, stock): its sizing rules, each transcribed from the function named beside it.

Paths are inside the release's `sglang/srt/`. tests/peers/ parses every rendered flag list with this
release's ServerArgs and applies these rules (the engine's own functions where they run without a GPU).
- Base: the static fraction applies to the free memory measured after the CUDA context is up
  (distributed/bootstrap.measure_pre_model_load_memory), not to the total; the KV budget is
  free-after-weights - base x (1 - f) (mem_cache/kv_cache_configurator._profile_available_bytes).
- SSM pool: --max-mamba-cache-size K usable slots plus one padding slot, (K + 1) x slot bytes, taken before
  the KV pool (_handle_max_mamba_cache).
- Running requests: min(--max-running-requests, pool // 2, K // (3 + tracking slots))
  (resolve_max_num_reqs, _calculate_mamba_ratio); the plan renders --mamba-radix-cache-strategy
  extra_buffer with overlap scheduling on (SGLang's own choice for GDN models on CUDA,
  arg_groups/overrides._mamba_radix_cache_resolution), so tracking = 2 (allocation_sizing.get_mamba_tracking_slots)
  and a running request holds 1 + 2 slots (memory_pool.HybridReqToTokenPool.alloc: working slot + ping-pong).
- Outside the static budget: SGLang's constant 512 MiB of backend metadata and its graph reserve
  (arg_groups/memory_hook.handle_gpu_memory_settings, reserve_for_graph_mb), and the activations of one chunk
  as headroom measured them on an H200 (engines/builtin.py's calibration: 1.95 x the shape estimate, allocator
  slack 0.85 x that). SGLang's own default adds 1.5 MiB a chunk token and a 10 GiB floor above 60 GiB
  (default_reserve_mib, about 12.9 GiB at chunk 8192): a model-independent heuristic. The evidence for the
  smaller figure: SGLang (0.5.19, the field report's fork) served a 27B hybrid at chunk 8192 for days with
  1.8 GiB outside its static budget, the INT2 dequant transient (962 MB) included (seed 004). Not yet
  measured on 0.5.23 (docs/peers.md).
- KV dtypes: bf16 and fp8 only (arg_groups/fields/model.py ModelArgs.kv_cache_dtype choices: auto, fp8_e5m2,
  fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16); integer KV is the int-kv fork's (sglang_int_kv.py).
"""

from __future__ import annotations

from headroom.engine.plan.engines.base import (
    EngineModel,
    Layout,
    MiB,
    activation_bytes,
    planned_memory_flags,
    req_to_token_table_bytes,
)
from headroom.engine.plan.engines.builtin import _ACTIVATION_SCALE, _FRAGMENTATION_SCALE
from headroom.engine.plan.geometry import ModelGeometry

# ModelArgs.kv_cache_dtype choices; names spelt out so the width never depends on the checkpoint's dtype.
_KV_FLAG = {"bf16": "bfloat16", "fp8": "fp8_e4m3"}
_KV_ELEMENT_BYTES = {"bf16": 2, "fp8": 1}
# ExecMamba.mamba_ssm_dtype choices (float32, bfloat16, float16).
_SSM_FLAG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MAMBA_STRATEGY = "extra_buffer"
# kv_cache_configurator.MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO.
MAMBA_BASE_RATIO = 3
# allocation_sizing.get_mamba_tracking_slots(extra_buffer=True, overlap=True).
TRACKING_SLOTS = 2
# In use before SGLang measures its base: the CUDA context and cuBLAS, 719 MiB on an H200 before any model
# (measured for issue 13). With tp > 1 NCCL and the custom all-reduce buffers are up too: an estimate, unmeasured.
CUDA_CONTEXT_BYTES = 719 * MiB
TP_COMMUNICATOR_BYTES = 512 * MiB
# memory_hook.handle_gpu_memory_settings: (GPU memory below, MiB) -> default decode graph max batch (tp < 4, tp >= 4).
_DECODE_GRAPH_MAX_BS = ((20 * 1024, 8, 8), (35 * 1024, 48, 160), (60 * 1024, 32, 160), (160 * 1024, 256, 512))
_LARGE_GPU_MIB = 60 * 1024
_LARGE_GPU_FLOOR_MIB = 10 * 1024
# handle_gpu_memory_settings: "Constant meta data (e.g., from attention backend)".
_METADATA_MIB = 512


def prefill_graph_sizes(max_bs: int) -> list[int]:
    """arg_groups/cuda_graph_hook.generate_prefill_cuda_graph_batch_sizes: captured prefill token counts."""
    sizes = (
        list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
        + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512))
    )
    return [s for s in sizes if s <= max_bs]


def decode_graph_max_bs(gpu_mib: float, tp: int, running: int) -> int:
    """handle_gpu_memory_settings: the GPU-size default, capped at --max-running-requests."""
    default = 512
    for below, small_tp, large_tp in _DECODE_GRAPH_MAX_BS:
        if gpu_mib < below:
            default = small_tp if tp < 4 else large_tp
            break
    return min(default, running)


def graph_reserve_mib(gpu_mib: float, chunk: int, tp: int, running: int, max_total_tokens: int) -> float:
    """reserve_for_graph_mb: 2 MiB a decode graph batch, 8 MiB a prefill graph (prefill graphs are on by
    default on CUDA, cuda_graph_config.default_prefill_backend; they capture up to the chunk, capped by the pool)."""
    prefill_max_bs = min(chunk, max_total_tokens)
    return decode_graph_max_bs(gpu_mib, tp, running) * 2 + len(prefill_graph_sizes(prefill_max_bs)) * 8


def default_reserve_mib(gpu_mib: float, chunk: int, tp: int, running: int, max_total_tokens: int) -> float:
    """handle_gpu_memory_settings (post-capture KV sizing off, its default): 512 + 1.5 MiB a chunk token +
    tp/8 GiB + reserve_for_graph_mb (2 MiB a decode graph batch, 8 MiB a prefill graph), at least 10 GiB
    on GPUs above 60 GiB."""
    graphs = graph_reserve_mib(gpu_mib, chunk, tp, running, max_total_tokens)
    reserve = _METADATA_MIB + max(chunk, 2048) * 1.5 + tp / 8 * 1024 + graphs
    if gpu_mib > _LARGE_GPU_MIB:
        reserve = max(reserve, _LARGE_GPU_FLOOR_MIB)
    return reserve


class SGLangEngine(EngineModel):
    name = "sglang"
    version = "0.5.23"
    kv_dtypes = tuple(_KV_FLAG)
    kv_dtype_note = (
        "stock SGLang 0.5.23's --kv-cache-dtype accepts only auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4 "
        "and fp4_mx_block16; integer KV is the field report's fork: engine flavour int-kv "
        "(`headroom plan --engine-flavour int-kv`, CR engine.flavour: int-kv) with an image that has it"
    )
    default_ssm_dtype = "fp32"
    token_cap_only = True

    def kv_bytes_per_token(self, geometry: ModelGeometry, layout: Layout) -> int:
        # pool_configurator.DefaultPoolConfigurator._compute_cell_size; model_config.get_num_kv_heads floors.
        heads = max(1, geometry.num_kv_heads // layout.tp)
        element = _KV_ELEMENT_BYTES[layout.kv_dtype]
        return heads * 2 * geometry.head_dim * geometry.num_full_attention_layers * element

    def slots_per_running(self, layout: Layout) -> int:
        return 1 + TRACKING_SLOTS

    def checkpoints_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        if not geometry.is_hybrid:
            return 0
        # A checkpoint per chunk of cached pool (seed 004), never fewer than the retained sessions' own.
        retained = super().checkpoints_needed(geometry, layout, total_tokens, retained_sessions, session_tokens)
        return max(-(-total_tokens // layout.chunk), retained)

    def ssm_slots_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        if not geometry.is_hybrid:
            return 0
        checkpoints = self.checkpoints_needed(geometry, layout, total_tokens, retained_sessions, session_tokens)
        held = layout.running * self.slots_per_running(layout)
        # resolve_max_num_reqs caps running at K // (3 + tracking): K must reach that for R to run at all.
        return max(checkpoints + held, layout.running * (MAMBA_BASE_RATIO + TRACKING_SLOTS))

    def ssm_pool_bytes(self, slots: int, slot_bytes: int) -> int:
        # _handle_max_mamba_cache: "+1 accounts for each pool's padding slot".
        return (slots + 1) * slot_bytes if slots else 0

    def outside_base(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        return {"cuda_context": CUDA_CONTEXT_BYTES + (TP_COMMUNICATOR_BYTES if layout.tp > 1 else 0)}

    def static_extras(self, geometry: ModelGeometry, layout: Layout) -> dict[str, int]:
        return {}

    def non_static(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        # Prefill graphs capture up to min(chunk, pool); pricing the chunk is the larger side.
        graphs = graph_reserve_mib(gpu_memory / MiB, layout.chunk, layout.tp, layout.running, layout.chunk)
        activations = int(_ACTIVATION_SCALE * activation_bytes(geometry, layout.chunk, layout.running, layout.tp))
        return {
            "backend_metadata": _METADATA_MIB * MiB,
            "activations": activations,
            "fragmentation": int(_FRAGMENTATION_SCALE * activations),
            "graph_reserve": int(graphs * MiB),
            # ReqToTokenPool is allocated after the KV budget is measured, so from the non-static side.
            "req_to_token_outside": req_to_token_table_bytes(layout.running + 1, layout.context_length),
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
                "--mamba-radix-cache-strategy", MAMBA_STRATEGY,
            ]
        return args
