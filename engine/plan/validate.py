"""Edge validation of a PlanRequest: every message names the field and the value."""

from __future__ import annotations

from headroom.engine.plan.engines import engine_model
from headroom.engine.plan.kv_format import KV_DTYPES, SSM_DTYPES
from headroom.engine.plan.types import PlanRefused, PlanRequest

# Below this a GPU cannot hold a CUDA context and any model worth planning.
_MIN_GPU_BYTES = 256 * 1024**2


def _positive(name: str, value: int | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate_request(request: PlanRequest) -> None:
    """Raise ValueError for malformed input, PlanRefused('kv_dtype') for a dtype the engine lacks."""
    t, pin = request.targets, request.pinned
    if request.gpu_memory_bytes < _MIN_GPU_BYTES:
        raise ValueError(f"gpu memory must be at least 256 MiB, got {request.gpu_memory_bytes} bytes")
    if request.tp < 1:
        raise ValueError(f"tp must be >= 1, got {request.tp}")
    if request.kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype {request.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if request.ssm_dtype is not None and request.ssm_dtype not in SSM_DTYPES:
        raise ValueError(f"ssm dtype {request.ssm_dtype!r} is not one of {', '.join(SSM_DTYPES)}")
    model = engine_model(request.engine, request.engine_version, request.engine_flavour)
    _positive("context_length", t.context_length)
    _positive("retained_sessions", t.retained_sessions, allow_zero=True)
    _positive("session_tokens", t.session_tokens, allow_zero=True)
    _positive("max_running_requests", t.max_running_requests)
    _positive("max_new_tokens", t.max_new_tokens)
    _positive("max_total_tokens", pin.max_total_tokens)
    _positive("chunked_prefill_size", pin.chunked_prefill_size)
    _positive("pinned context_length", pin.context_length)
    if t.retained_sessions and not t.session_tokens:
        raise ValueError(f"retained_sessions {t.retained_sessions} needs session_tokens > 0")
    if pin.mem_fraction_static is not None and not 0 < pin.mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {pin.mem_fraction_static}")
    if pin.context_length and t.context_length and pin.context_length != t.context_length:
        raise ValueError(
            f"pinned context_length {pin.context_length} disagrees with target context_length {t.context_length}"
        )
    if request.kv_dtype not in model.kv_dtypes:
        raise PlanRefused(
            f"engine {model.profile} has no {request.kv_dtype} KV cache (it offers {', '.join(model.kv_dtypes)})"
            + (f"; {model.kv_dtype_note}" if model.kv_dtype_note else ""),
            "kv_dtype",
        )
