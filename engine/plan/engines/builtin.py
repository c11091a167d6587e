"""headroom's own engine: it allocates exactly the tokens and slots the plan names.

Its quantized-KV attention dequantizes tile by tile inside the kernel, so the dequant transient is
one block's workspace, independent of the prefix length (DESIGN.md, "The memory model").
"""

from __future__ import annotations

import math

from headroom.engine.plan.engines.base import (
    EngineModel,
    Layout,
    MiB,
    activation_bytes,
    dense_prefix_bytes,
    planned_memory_flags,
    req_to_token_table_bytes,
)
from headroom.engine.plan.geometry import ModelGeometry
from headroom.engine.plan.kv_format import KV_DTYPES, kv_format, kv_heads_per_gpu
from headroom.engine.plan.quant_format import WEIGHT_DEQUANT_MIN_ROWS
from headroom.engine.plan.weight_bytes import largest_quantized_linear_params

# A long KIVI chunk's prefix is dequantized a block at a time into a dense workspace of this many tokens of
# one layer: kernels/paged_kv.py BLOCKWISE_WORKSPACE_TOKENS, the engine's value (a test holds them equal; the
# planner imports no torch).
DEQUANT_BLOCK_TOKENS = 16384
# Calibrated on the H200 (bench/results/gpu_plans_before_calibration.json, torch 2.11 + CUDA 13, three plans
# of a Qwen3.5-4B-shaped model at chunk 8192): memory outside torch's allocator (CUDA context, cuBLAS and
# Triton modules) peaked at 686 MiB, so 704 MiB.
_CUDA_CONTEXT_BYTES = 704 * MiB
# Decode CUDA graphs (engine/runtime/decode_graphs.py): one per batch size up to this many running requests (a
# bound on capture time, about 0.1 s a graph, and on graph memory).
DECODE_GRAPH_MAX_BATCH = 64
# Device memory of the captured graphs: their private pool, the driver's graph objects and the cuBLAS
# workspaces of the warm-up and capture streams, which CaptureReport.device_bytes measures (free device memory
# before capture minus after). H200, fresh process, the engine with one warm-up stream and issue 18's fused
# kernels (quant_weights.json, all three weight formats): 230 MiB for 4 graphs, of which an 88-90 MiB pool,
# ~71 MiB of driver objects outside torch's allocator and ~71 MiB of stream workspaces; session 4's servers
# (16 graphs) logged a 106 MiB pool, so the pool grows ~1.5 MiB a graph. Earlier engines took more (348 MiB for
# 4 graphs and 516 for 8, gpu_plans_recalibrated.json: unfused decode passes, a warm-up stream per size). Per
# graph: 8 MiB (170 MiB for 16 graphs against 68 MiB of pool in a process whose streams were warm,
# gpu_engine_e.json: ~6.4 MiB of driver objects a graph, plus the pool's growth). The base is what is left of
# the measured 230 MiB, 198 MiB, rounded up to 224 (26 MiB over the measurement at 4 graphs).
_GRAPH_BASE_BYTES = 224 * MiB
_GRAPH_BYTES_EACH = 8 * MiB
# The shape-based activation estimate (engines/base.py) saw 644-649 MiB where torch's allocator peaked
# 1,181-1,242 MiB above the static pools (fla and attention workspaces, q/k/v and gate copies): x1.95.
_ACTIVATION_SCALE = 1.95
# Caching-allocator slack (torch's max reserved minus max allocated, the graphs' private pool aside, which the
# graph line holds): blocks the allocator caches after one of the pass's transient tensors is freed and that a
# later request of another size cannot reuse. Those blocks are the pass's own tensors, tokens x width, so they
# scale with the chunk as the activations do: a multiple of them, plus, with quantized weights, the cached dense
# copies of the linears a prefill-sized pass dequantizes one after another (several shapes, each cached after
# its use; weight_dequant_transient holds the widest once). Measured on the current engine (H200, session 5
# call 3, bench/results/session5/: chunk 8192, 1,258-1,266 MiB of activations, pool excluded): 113-129 MiB
# with bf16 weights whatever the KV format (bf16, fp8, int2; x0.09-0.10), 184 MiB with fp8 weights and 424 MiB
# with int4 (x4.1 of the 45 MiB widest copy over the bf16-weight slack). Engines before the session-4 kernels
# left 3-10x more (gpu_plans_*.json; their unfused elementwise ops and KIVI's page-sized quantize temporaries).
_SLACK_SCALE = 0.15
_SLACK_WEIGHT_COPIES = 6
# SGLang's own allocator and kernels were never measured here: its model (engines/sglang.py) keeps the
# factor the first calibration of this engine found.
_FRAGMENTATION_SCALE = 0.85
# Tensor parallel (tp > 1): NCCL's communicator buffers and its own device allocations, outside torch's
# allocator, on every rank. An estimate (about 16-32 channels x a few 4 MiB buffers per peer, plus margin),
# not yet measured here: bench/tp_speed.py reports each rank's peak against its ledger.
_TP_COMMUNICATOR_BYTES = 512 * MiB
# The prefix cache's checkpoint policy (engine/cache/checkpoint_policy.py): SSM states one finished session
# keeps once redundant ones are trimmed, and the most a running request takes during its prefill.
CHECKPOINTS_PER_SESSION = 3
CHECKPOINT_GRANULE = 64
CHECKPOINT_STOPS_PER_REQUEST = 6
# Without a retained-sessions target the plan retains as many sessions as the pool holds, each of context /
# DEFAULT_SESSION_FRACTION tokens (the smoke test's default session length), or longer where a session's
# checkpoints would otherwise take more than DEFAULT_STATE_SHARE of the memory its KV and checkpoints share
# (a 4B model's fp32 states are 49 MiB a slot; with int2 KV, three of them outweigh 30K tokens of KV).
DEFAULT_SESSION_FRACTION = 4
DEFAULT_STATE_SHARE = 0.25


def decode_graph_batch(sparse_moe: bool, running: int) -> int:
    """Decode graphs the engine captures by default (one per batch size up to this): none for sparse MoE models
    (data-dependent routing); KIVI pools are graphed like the others (their open pages sit in a static window
    buffer). The planner prices them and ModelRunner captures them from this one rule."""
    if sparse_moe:
        return 0
    return min(running, DECODE_GRAPH_MAX_BATCH)


def decode_graph_count(geometry: ModelGeometry, layout: Layout) -> int:
    return decode_graph_batch(geometry.num_experts > 0, layout.running)


class BuiltinEngine(EngineModel):
    name = "builtin"
    kv_dtypes = KV_DTYPES
    default_ssm_dtype = "fp32"

    def page_tokens(self, geometry: ModelGeometry, layout: Layout) -> int:
        return kv_format(layout.kv_dtype).page_tokens

    def reuse_interval(self, layout: Layout) -> int:
        # The cache checkpoints a prompt's tail on multiples of 64 tokens (and of the KV page).
        return math.lcm(CHECKPOINT_GRANULE, kv_format(layout.kv_dtype).page_tokens)

    def retained(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> tuple[int, int]:
        """The targets exactly when given; otherwise every pool token reusable: as many default-length
        sessions as the pool holds."""
        if retained_sessions:
            return retained_sessions, session_tokens
        default_tokens = self.default_session_tokens(geometry, layout)
        return total_tokens // default_tokens, default_tokens

    def default_session_tokens(self, geometry: ModelGeometry, layout: Layout) -> int:
        """A quarter context, lengthened (up to the context) until a session's checkpoints take at most
        DEFAULT_STATE_SHARE of the bytes its KV and checkpoints take together."""
        quarter = max(1, layout.context_length // DEFAULT_SESSION_FRACTION)
        if not geometry.is_hybrid:
            return quarter
        states = CHECKPOINTS_PER_SESSION * self.ssm_slot_bytes(geometry, layout)
        kv_floor = states * (1 - DEFAULT_STATE_SHARE) / DEFAULT_STATE_SHARE
        floor = math.ceil(kv_floor / self.kv_bytes_per_token(geometry, layout))
        return min(layout.context_length, max(quarter, floor))

    def ssm_slots_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        if not geometry.is_hybrid:
            return 0
        # Checkpoints the retained sessions keep, those one prefill takes while it runs (locked, so they could
        # otherwise push out a retained session's), and one working slot per running request.
        sessions, _ = self.retained(geometry, layout, total_tokens, retained_sessions, session_tokens)
        return sessions * CHECKPOINTS_PER_SESSION + CHECKPOINT_STOPS_PER_REQUEST + layout.running

    def static_extras(self, geometry: ModelGeometry, layout: Layout) -> dict[str, int]:
        fmt = kv_format(layout.kv_dtype)
        residual = (
            layout.running * fmt.residual_tokens * geometry.num_full_attention_layers
            * 2 * kv_heads_per_gpu(geometry, layout.tp) * geometry.head_dim * 2
        )
        return {
            "req_to_token_table": req_to_token_table_bytes(layout.running, layout.context_length),
            "kv_residual_window": residual,
        }

    def non_static(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        # Only KIVI reads a long chunk's prefix through a dense workspace (fp8 dequantizes inside the kernel).
        # The workspace holds K and V in the model's dtype (dense_prefix_bytes counts 2 bytes an element).
        workspace = (dense_prefix_bytes(geometry, DEQUANT_BLOCK_TOKENS, layout.tp) * geometry.dtype_bytes // 2
                     if kv_format(layout.kv_dtype).is_kivi else 0)
        # Prefill-sized passes dequantize one quantized weight at a time (its rank's shard) for cuBLAS.
        weight_copy = 0
        if layout.chunk + layout.running >= WEIGHT_DEQUANT_MIN_ROWS:
            widest = largest_quantized_linear_params(geometry, geometry.weight_quant)
            weight_copy = -(-widest // layout.tp) * geometry.dtype_bytes
        activations = int(_ACTIVATION_SCALE * activation_bytes(geometry, layout.chunk, layout.running, layout.tp))
        graphs = decode_graph_count(geometry, layout)
        lines = {
            "cuda_context": _CUDA_CONTEXT_BYTES,
            "activations": activations,
            "dequant_transient": workspace,
            "weight_dequant_transient": weight_copy,
            "graph_reserve": _GRAPH_BASE_BYTES + graphs * _GRAPH_BYTES_EACH if graphs else 0,
            "fragmentation": int(_SLACK_SCALE * activations) + _SLACK_WEIGHT_COPIES * weight_copy,
        }
        if layout.tp > 1:
            lines["tp_communicator"] = _TP_COMMUNICATOR_BYTES
        return lines

    def render(self, values: dict[str, int | float | str]) -> list[str]:
        flags = [
            *planned_memory_flags(values),
            "--kv-cache-dtype", str(values["kv_dtype"]),
            "--ssm-slots", str(values["ssm_slots"]),
            # `headroom serve` re-plans from these flags: without the plan's reserve it would assume its default.
            "--max-new-tokens", str(values["max_new_tokens"]),
        ]
        if int(values["tp"]) > 1:
            # One process a GPU (engine/runtime/leader.py); rendered only when there is more than one.
            flags += ["--tensor-parallel-size", str(values["tp"])]
        return flags
