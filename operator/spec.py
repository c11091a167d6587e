"""The InferenceServer spec as a pydantic model, and its translation into a PlanRequest.

The CRD schema (crds/inferenceservers.headroom.dev.yaml) is the source of truth; this model
re-checks the same fields at the operator's edge so that a spec which slipped past an older CRD
still fails with a message naming the field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from headroom.engine.plan import ModelGeometry, Pinned, PlanRequest, Targets, geometry_from_config, parse_size
from headroom.engine.plan.engines import UnknownProfile, resolve_profile
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SpecError(ValueError):
    """A spec the operator cannot act on; the message names the field and the value."""


class _Camel(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)


class PvcSource(_Camel):
    claim_name: str = Field(alias="claimName", min_length=1)


class ConfigMapRef(_Camel):
    name: str = Field(min_length=1)
    key: str = "config.json"


class ModelSpec(_Camel):
    path: str = Field(min_length=1)
    pvc: PvcSource | None = None
    host_path: str | None = Field(default=None, alias="hostPath")
    config_map: ConfigMapRef | None = Field(default=None, alias="configMap")
    config: dict[str, Any] | None = None
    weight_bytes: int | str | None = Field(default=None, alias="weightBytes")

    @model_validator(mode="after")
    def _one_source_each(self) -> ModelSpec:
        if (self.pvc is None) == (self.host_path is None):
            raise ValueError("model needs exactly one source: pvc or hostPath")
        if (self.config_map is None) == (self.config is None):
            raise ValueError("model needs exactly one geometry source: configMap or inline config")
        if self.path.startswith("/"):
            raise ValueError(f"model.path {self.path!r} must be relative to the volume")
        return self


class GpuSpec(_Camel):
    count: int = Field(ge=1, le=8)
    memory: str | None = None
    product: str | None = None


# A release in an image tag: lmsysorg/sglang:v0.5.23-cu129 -> 0.5.23.
_TAG_VERSION = re.compile(r"^v?(\d+\.\d+\.\d+)")


def image_version(image: str) -> str | None:
    """The release an image tag names, or None (no tag, or a tag such as 'latest')."""
    tag = image.rsplit("/", 1)[-1].partition(":")[2].partition("@")[0]
    match = _TAG_VERSION.match(tag)
    return match.group(1) if match else None


class EngineSpec(_Camel):
    kind: Literal["builtin", "sglang", "vllm"] = "builtin"
    image: str | None = None
    # The engine release the plan is priced for; default: the version in the image tag.
    version: str | None = None
    # A fork's capability the stock release lacks (int-kv: the field report's SGLang with integer KV).
    flavour: Literal["int-kv"] | None = None
    port: int = Field(default=8000, ge=1, le=65535)
    extra_args: list[str] = Field(default_factory=list, alias="extraArgs")

    @model_validator(mode="after")
    def _image_for_third_party(self) -> EngineSpec:
        if self.kind != "builtin" and not self.image:
            raise ValueError(f"engine.image is required for the {self.kind} engine")
        if self.kind != "builtin":
            self.resolved_version()
        return self

    def resolved_version(self) -> str | None:
        """The profile's release: engine.version, else the image tag's; refused when there is no profile for it."""
        if self.kind == "builtin":
            return None
        version = self.version or image_version(self.image or "")
        if version is None:
            raise ValueError(
                f"engine.image {self.image!r} names no release in its tag; set engine.version to a release "
                "headroom has a profile for"
            )
        try:
            return resolve_profile(self.kind, version, self.flavour).version
        except UnknownProfile as exc:
            raise ValueError(f"engine {self.image}: {exc}") from exc


class KvCacheSpec(_Camel):
    dtype: Literal["bf16", "fp8", "int8", "int4", "int2"] = "bf16"
    # Recurrent-state dtype of hybrid models' SSM slots; None: the engine's default (fp32).
    ssm_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(default=None, alias="ssmDtype")


class TargetsSpec(_Camel):
    context_length: int | Literal["auto"] | None = Field(default=None, alias="contextLength")
    retained_sessions: int = Field(default=0, ge=0, alias="retainedSessions")
    session_tokens: int = Field(default=0, ge=0, alias="sessionTokens")
    max_running_requests: int | None = Field(default=None, ge=1, alias="maxRunningRequests")
    max_new_tokens: int = Field(default=1024, ge=1, alias="maxNewTokens")

    @field_validator("context_length")
    @classmethod
    def _positive_context(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"targets.contextLength must be >= 1 or 'auto', got {value}")
        return value

    @model_validator(mode="after")
    def _sessions_need_tokens(self) -> TargetsSpec:
        if self.retained_sessions > 0 and self.session_tokens <= 0:
            raise ValueError(
                f"targets.sessionTokens is required when targets.retainedSessions > 0 "
                f"(retainedSessions={self.retained_sessions})"
            )
        return self


class OverridesSpec(_Camel):
    mem_fraction_static: float | None = Field(default=None, gt=0.0, lt=1.0, alias="memFractionStatic")
    max_total_tokens: int | None = Field(default=None, ge=1, alias="maxTotalTokens")
    chunked_prefill_size: int | None = Field(default=None, ge=1, alias="chunkedPrefillSize")
    context_length: int | None = Field(default=None, ge=1, alias="contextLength")


class SmokeThresholdsSpec(_Camel):
    """Names map onto headroom.client's SmokeThresholds (smoke_gate.THRESHOLD_FIELDS)."""

    max_short_ttft_seconds: float | None = Field(default=None, ge=0, alias="maxShortTtftSeconds")
    min_prefill_tokens_per_second: float | None = Field(default=None, ge=0, alias="minPrefillTokensPerSecond")
    min_retention_hit_rate: float | None = Field(default=None, ge=0, le=1, alias="minRetentionHitRate")
    cliff_util_percent: float | None = Field(default=None, ge=0, le=100, alias="cliffUtilPercent")
    cliff_power_ratio: float | None = Field(default=None, ge=0, le=1, alias="cliffPowerRatio")


class SmokeTestSpec(_Camel):
    enabled: bool = True
    timeout_seconds: int = Field(default=900, ge=10, alias="timeoutSeconds")
    thresholds: SmokeThresholdsSpec = Field(default_factory=SmokeThresholdsSpec)


class RolloutSpec(_Camel):
    auto_rollback: bool = Field(default=True, alias="autoRollback")
    ready_timeout_seconds: int = Field(default=1800, ge=30, alias="readyTimeoutSeconds")


class SecretKeyRef(_Camel):
    name: str = Field(min_length=1)
    key: str = Field(default="api-key", min_length=1)


class AuthSpec(_Camel):
    """The engine's API key: a Secret in the InferenceServer's namespace (docs/security.md)."""

    api_key_secret: SecretKeyRef | None = Field(default=None, alias="apiKeySecret")


class InferenceServerSpec(_Camel):
    model: ModelSpec
    gpu: GpuSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    kv_cache: KvCacheSpec = Field(default_factory=KvCacheSpec, alias="kvCache")
    targets: TargetsSpec = Field(default_factory=TargetsSpec)
    overrides: OverridesSpec = Field(default_factory=OverridesSpec)
    smoke_test: SmokeTestSpec = Field(default_factory=SmokeTestSpec, alias="smokeTest")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)


def parse_spec(raw: dict[str, Any]) -> InferenceServerSpec:
    """Validate a raw `spec` dict; SpecError names every failing field as spec.<path>."""
    try:
        return InferenceServerSpec.model_validate(dict(raw))
    except ValidationError as exc:
        problems = [
            f"spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" if err["loc"] else f"spec: {err['msg']}"
            for err in exc.errors()
        ]
        raise SpecError("; ".join(problems)) from exc


def model_geometry(spec: InferenceServerSpec, config_json: dict[str, Any]) -> ModelGeometry:
    """Geometry from config.json, with spec.model.weightBytes (bytes or '54Gi') applied when given."""
    geometry = geometry_from_config(config_json)
    if spec.model.weight_bytes is None:
        return geometry
    try:
        weight_bytes = parse_size(spec.model.weight_bytes, field="spec.model.weightBytes")
    except ValueError as exc:
        raise SpecError(str(exc)) from exc
    return geometry.with_weight_bytes(weight_bytes)


def plan_request(spec: InferenceServerSpec, geometry: ModelGeometry, gpu_memory_bytes: int) -> PlanRequest:
    """The planner's question for this spec; gpu_memory_bytes is one GPU's memory in bytes."""
    context = spec.targets.context_length
    targets = Targets(
        context_length=None if context in (None, "auto") else int(context),
        retained_sessions=spec.targets.retained_sessions,
        session_tokens=spec.targets.session_tokens,
        max_running_requests=spec.targets.max_running_requests,
        max_new_tokens=spec.targets.max_new_tokens,
    )
    pinned = Pinned(
        mem_fraction_static=spec.overrides.mem_fraction_static,
        max_total_tokens=spec.overrides.max_total_tokens,
        chunked_prefill_size=spec.overrides.chunked_prefill_size,
        context_length=spec.overrides.context_length,
    )
    return PlanRequest(
        geometry=geometry,
        gpu_memory_bytes=gpu_memory_bytes,
        kv_dtype=spec.kv_cache.dtype,
        ssm_dtype=spec.kv_cache.ssm_dtype,
        engine=spec.engine.kind,
        engine_version=spec.engine.resolved_version(),
        engine_flavour=spec.engine.flavour,
        tp=spec.gpu.count,
        targets=targets,
        pinned=pinned,
    )
