"""EngineConfig: what the builtin engine runs with; normally derived from a planner Plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headroom.engine.plan.kv_format import KV_DTYPES
from headroom.engine.plan.types import Plan

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Sizes in tokens / slots / bytes. dtype `auto` = the checkpoint's dtype; kv_dtype `auto` = model dtype.

    static_budget_bytes (weights + pools) comes from the plan (mem_fraction_static x GPU memory);
    None skips that check (CPU tests). cuda_graph_max_batch: decode passes of up to this many sequences
    replay CUDA graphs (engine/runtime/decode_graphs.py); None = min(max_running_requests, 64) on CUDA for a
    dense or hybrid model (any KV format), off for sparse MoE and off the GPU; 0 = off. tensor_parallel_size: processes (devices) the model is split
    over (engine/runtime/parallel.py); the pool sizes and the static budget are per device, as the plan's ledger.
    cpu_threads: torch's intra-op threads in the engine loop's thread on a CPU device (ModelRunner.prepare_thread).
    """

    model_path: str
    device: str = "cpu"
    dtype: str = "auto"
    kv_dtype: str = "auto"
    ssm_dtype: str = "fp32"
    max_total_tokens: int = 4096
    ssm_slots: int = 16
    chunked_prefill_size: int = 512
    context_length: int = 4096
    max_running_requests: int = 8
    enable_prefix_cache: bool = True
    static_budget_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    seed: int = 0
    cuda_graph_max_batch: int | None = None
    tensor_parallel_size: int = 1
    # 1: on a 2-core CPU a forward (the embedded model, 16 decodes) in a thread other than the main one took 33 ms
    # with torch's 2 OpenMP threads and 12.5 with one; in the main thread 22.5 with two and 12.7 with one
    # (bench/cpu_engine_thread.py, bench/results/session8/cpu_engine_thread.json).
    cpu_threads: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of auto, {', '.join(KV_DTYPES)}")
        for name in ("max_total_tokens", "chunked_prefill_size", "context_length", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.ssm_slots < 0:
            raise ValueError(f"ssm_slots must be >= 0, got {self.ssm_slots}")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0 (0 = off), got {self.cuda_graph_max_batch}")

    @classmethod
    def from_plan(cls, plan: Plan, model_path: str, **overrides: Any) -> EngineConfig:
        """The plan's pool sizes, chunk and limits; overrides (device, dtype, ...) win."""
        if plan.engine != "builtin":
            raise ValueError(f"plan is for engine {plan.engine!r}; the builtin engine needs an engine='builtin' plan")
        fields: dict[str, Any] = dict(
            model_path=model_path,
            device="cuda",
            kv_dtype=plan.kv_dtype,
            ssm_dtype=plan.ssm_dtype,
            max_total_tokens=plan.max_total_tokens,
            ssm_slots=plan.ssm_slots,
            chunked_prefill_size=plan.chunked_prefill_size,
            context_length=plan.context_length,
            max_running_requests=plan.max_running_requests,
            static_budget_bytes=int(plan.mem_fraction_static * plan.gpu_memory_bytes),
            gpu_memory_bytes=plan.gpu_memory_bytes,
            tensor_parallel_size=plan.tp,
        )
        fields.update(overrides)
        return cls(**fields)
