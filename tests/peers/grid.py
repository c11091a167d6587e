"""The grid of plans the peer tests and bench/peer_grid.py run: presets x GPUs x KV dtypes x tp x sessions."""

from __future__ import annotations

from dataclasses import dataclass

from headroom.engine.plan import Pinned, PlanRequest, Targets, geometry_from_config
from headroom.engine.plan.presets import PRESETS, preset_config

GiB = 1024**3
GPU_GIB = (12, 24, 80, 141)
KV_DTYPES = ("bf16", "fp8", "int8", "int4", "int2")
TPS = (1, 2)
SESSIONS = ((0, 0), (4, 32768))


@dataclass(frozen=True)
class Case:
    preset: str
    gpu_gib: int
    kv_dtype: str
    tp: int
    sessions: int
    session_tokens: int
    engine: str
    flavour: str | None = None
    running: int | None = None

    def request(self) -> PlanRequest:
        config, weights = preset_config(self.preset)
        geometry = geometry_from_config(config)
        geometry = geometry.with_weight_bytes(weights) if weights else geometry
        return PlanRequest(
            geometry=geometry, gpu_memory_bytes=self.gpu_gib * GiB, kv_dtype=self.kv_dtype, engine=self.engine,
            engine_flavour=self.flavour, tp=self.tp,
            targets=Targets(retained_sessions=self.sessions, session_tokens=self.session_tokens,
                            max_running_requests=self.running),
            pinned=Pinned(),
        )


def random_cases(engine: str):
    """A hypothesis strategy over the grid's axes for `engine`, with max_running_requests drawn too."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw) -> Case:
        sessions, tokens = draw(st.sampled_from(SESSIONS))
        return Case(
            preset=draw(st.sampled_from(["qwen3.5-4b", "qwen3.5-27b", "qwen3-next-80b-a3b", "seed-27b-int2"])),
            gpu_gib=draw(st.sampled_from(GPU_GIB)), kv_dtype=draw(st.sampled_from(KV_DTYPES)),
            tp=draw(st.sampled_from(TPS)), sessions=sessions, session_tokens=tokens, engine=engine,
            running=draw(st.one_of(st.none(), st.sampled_from([1, 4, 16]))),
        )

    return cases()


def grid(engine: str) -> list[Case]:
    return [
        Case(preset, gpu, kv, tp, sessions, tokens, engine)
        for preset in sorted(PRESETS) for gpu in GPU_GIB for kv in KV_DTYPES for tp in TPS
        for sessions, tokens in SESSIONS
    ]
