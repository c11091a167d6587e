"""What each engine model tells the solver: its byte formulas and how it spells the flags.

All byte counts are per GPU. A `Layout` is one candidate setting the solver is pricing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from headroom.engine.plan.geometry import ModelGeometry
from headroom.engine.plan.kv_format import kv_bytes_per_token, kv_heads_per_gpu, ssm_slot_bytes

MiB = 1024**2
# Every engine computes attention and the MLP on one chunk at a time; activations live as long as one layer.
_ACTIVATION_DTYPE_BYTES = 2
# Gated DeltaNet chunked prefill keeps one state per 64-token block per value head, in the input dtype, as fla does.
_GDN_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Layout:
    """One candidate: chunk C, context length, running requests R, KV dtype, tensor-parallel size."""

    chunk: int
    context_length: int
    running: int
    kv_dtype: str
    tp: int
    ssm_dtype: str


def activation_bytes(geometry: ModelGeometry, chunk: int, running: int, tp: int) -> int:
    """Peak activations of one forward pass over `chunk` prefill tokens plus `running` decodes.

    Layers run one after another, so the peak is the residual stream plus the widest layer's
    intermediates for the tokens of the pass, plus fp32 logits of the rows that sample and, for
    hybrid models, the per-block recurrent states of Gated DeltaNet's chunked prefill.
    """
    tokens = chunk + running
    h = geometry.hidden_size
    mlp_width = (
        geometry.num_experts_per_tok * geometry.moe_intermediate_size + geometry.shared_expert_intermediate_size
        if geometry.num_experts
        else geometry.intermediate_size
    )
    # gate and up projections plus the activated product coexist for one moment.
    mlp = 3 * -(-mlp_width // tp)
    attn_width = (geometry.num_attention_heads * 2 + 2 * geometry.num_kv_heads) * geometry.head_dim
    widest = max(mlp, -(-attn_width // tp))
    if geometry.is_hybrid:
        key_dim = geometry.linear_num_key_heads * geometry.linear_key_head_dim
        value_dim = geometry.linear_num_value_heads * geometry.linear_value_head_dim
        widest = max(widest, -(-(2 * key_dim + 2 * value_dim) // tp))
    per_token = _ACTIVATION_DTYPE_BYTES * (2 * h + widest)
    logits = (running + 1) * -(-geometry.vocab_size // tp) * 4
    gdn_states = 0
    if geometry.is_hybrid:
        value_heads = -(-geometry.linear_num_value_heads // tp)
        blocks = -(-chunk // _GDN_BLOCK_TOKENS)
        gdn_states = (
            blocks * value_heads * geometry.linear_key_head_dim * geometry.linear_value_head_dim
            * _ACTIVATION_DTYPE_BYTES
        )
    return tokens * per_token + logits + gdn_states


class EngineModel(ABC):
    """Memory formulas and flag rendering of one serving engine (one profile: a release, or a fork)."""

    name: str
    # The release the formulas are transcribed from (None: headroom's own engine); flavour names a fork.
    version: str | None = None
    flavour: str | None = None
    kv_dtypes: tuple[str, ...]
    # Said when a KV dtype outside kv_dtypes is asked for: where that dtype exists, if anywhere.
    kv_dtype_note: str = ""
    default_ssm_dtype: str = "fp32"
    # True when max-total-tokens only caps a pool sized by the static fraction (SGLang); False when
    # the engine allocates exactly the tokens the plan names.
    token_cap_only: bool = False

    def kv_bytes_per_token(self, geometry: ModelGeometry, layout: Layout) -> int:
        return kv_bytes_per_token(geometry, layout.kv_dtype, layout.tp)

    def ssm_slot_bytes(self, geometry: ModelGeometry, layout: Layout) -> int:
        return ssm_slot_bytes(geometry, layout.tp, layout.ssm_dtype)

    def page_tokens(self, geometry: ModelGeometry, layout: Layout) -> int:
        return 1

    @property
    def profile(self) -> str:
        """'sglang 0.5.23', 'sglang 0.5.19 int-kv', 'builtin'."""
        return " ".join(p for p in (self.name, self.version, self.flavour) if p)

    def outside_base(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        """Memory already in use when the engine measures the base its fraction applies to (none: the total)."""
        return {}

    def ssm_pool_bytes(self, slots: int, slot_bytes: int) -> int:
        """Bytes of the SSM pool for `slots` usable slots (an engine may allocate padding slots)."""
        return slots * slot_bytes

    def slots_per_running(self, layout: Layout) -> int:
        """SSM slots one running request holds (its working state, plus any tracking buffers)."""
        return 1

    def checkpoints_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        """Checkpoint slots the prefix cache keeps, beyond what running requests hold (the plan's promise)."""
        return session_checkpoints(retained_sessions, session_tokens, layout.chunk) if geometry.is_hybrid else 0

    def refuse_layout(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> str | None:
        """Why this engine would not start with this layout (None: it would); checked before pricing."""
        return None

    @abstractmethod
    def ssm_slots_needed(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> int:
        """Working slots of running requests plus the checkpoints the prefix cache must keep."""

    def reuse_interval(self, layout: Layout) -> int:
        """Tokens a hybrid model's reusable prefix is rounded down to: its SSM checkpoints sit on chunk ends."""
        return layout.chunk

    def retained(
        self, geometry: ModelGeometry, layout: Layout, total_tokens: int, retained_sessions: int, session_tokens: int
    ) -> tuple[int, int]:
        """Sessions, and tokens each, whose prefixes the plan promises to keep reusable: the targets."""
        return retained_sessions, session_tokens

    @abstractmethod
    def static_extras(self, geometry: ModelGeometry, layout: Layout) -> dict[str, int]:
        """Static allocations besides weights, KV pool and SSM pool (tables, residual windows)."""

    @abstractmethod
    def non_static(self, geometry: ModelGeometry, layout: Layout, gpu_memory: int) -> dict[str, int]:
        """What must fit outside the static budget: context, activations, transients, reserves."""

    @abstractmethod
    def render(self, values: dict[str, int | float | str]) -> list[str]:
        """Command-line flags of this engine for the solved values."""


def session_checkpoints(retained_sessions: int, session_tokens: int, chunk: int) -> int:
    """SSM checkpoints the retained sessions hold: one per chunk boundary, the partial last chunk included."""
    return retained_sessions * -(-session_tokens // chunk)


def dense_prefix_bytes(geometry: ModelGeometry, prefix_tokens: int, tp: int) -> int:
    """fp16 K and V of `prefix_tokens` tokens of one attention layer on one GPU."""
    return prefix_tokens * 2 * kv_heads_per_gpu(geometry, tp) * geometry.head_dim * 2


def req_to_token_table_bytes(running: int, context_length: int) -> int:
    """int32 map from (request, position) to KV slot that paged attention reads."""
    return running * context_length * 4


def fraction_flag(value: float) -> str:
    """A memory fraction as a flag: the shortest text that reads back as the same float, so the engine (and
    `headroom serve`'s re-plan) gets exactly the fraction the plan validated: 0.925 for a computed one, all of a
    pinned 0.861524 (three rounded decimals would give 0.862, which may not fit)."""
    return repr(float(value))


def planned_memory_flags(values: dict[str, int | float | str]) -> list[str]:
    """The five jointly planned flags in SGLang's spelling, which `headroom serve` shares."""
    return [
        "--mem-fraction-static", fraction_flag(float(values["mem_fraction_static"])),
        "--max-total-tokens", str(values["max_total_tokens"]),
        "--chunked-prefill-size", str(values["chunked_prefill_size"]),
        "--context-length", str(values["context_length"]),
        "--max-running-requests", str(values["max_running_requests"]),
    ]
